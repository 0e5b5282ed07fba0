"""LF's Ray contract before anything starts: the fields (`ray_num_workers`, `ray_init_kwargs` as a mapping
or a JSON string, `master_addr`, `master_port`), USE_RAY=1 as the switch, the run plan's Ray launch, and
the refusals (no `ray` package, Ray fields without USE_RAY, two launchers at once)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lmstack.config.errors import ConfigError
from lmstack.config.load import build_config
from lmstack.launch import ray as ray_launch
from lmstack.launch.context import LaunchContext
from lmstack.plan.rules import check_rules
from lmstack.plan.runplan import RunPlan

CPU = LaunchContext()
RAY = replace(CPU, use_ray=True, packages=frozenset({"ray"}))


def plan_of(base_cfg, ctx=RAY, **over) -> RunPlan:
    return RunPlan.resolve(build_config({**base_cfg, **over}), ctx)


def launch_problems(base_cfg, ctx=RAY, **over) -> list[str]:
    return check_rules(plan_of(base_cfg, ctx, **over), launch=True)[1]


def test_use_ray_plans_ray_num_workers_processes(base_cfg):
    plan = plan_of(base_cfg, ray_num_workers=2, ray_init_kwargs={"num_cpus": 2}, master_port="29611")
    assert plan.world_size == 2 and "ray_num_workers" in plan.reasons["world_size"]
    assert plan.ray.num_workers == 2 and plan.ray.init_kwargs == {"num_cpus": 2}
    assert plan.ray.master_port == 29611 and plan.ray.master_addr is None and not plan.ray.use_gpu
    assert launch_problems(base_cfg, ray_num_workers=2) == []


def test_a_ray_worker_trains_as_a_torchrun_worker(base_cfg):
    """Inside a worker (RANK/WORLD_SIZE set by the launcher, USE_RAY still set) nothing relaunches."""
    worker = replace(RAY, under_launcher=True, world_size=2, rank=1)
    plan = plan_of(base_cfg, worker, ray_num_workers=2)
    assert plan.ray is None and plan.world_size == 2
    assert check_rules(plan, launch=True)[1] == []


def test_ray_init_kwargs_json_string_is_a_mapping(base_cfg):
    cfg = build_config(
        {**base_cfg, "ray_init_kwargs": '{"address": "auto", "runtime_env": {"pip": ["emoji"]}}'}
    )
    assert cfg.training.ray_init_kwargs == {"address": "auto", "runtime_env": {"pip": ["emoji"]}}
    typed = build_config({**base_cfg, "ray_init_kwargs": '{"num_cpus": "2", "log_to_driver": "false"}'})
    assert typed.training.ray_init_kwargs == {"num_cpus": 2, "log_to_driver": False}
    with pytest.raises(ConfigError, match="ray_init_kwargs.*mapping or a JSON object string"):
        build_config({**base_cfg, "ray_init_kwargs": "address=auto"})
    with pytest.raises(ConfigError, match="ray_init_kwargs.*not valid JSON"):
        build_config({**base_cfg, "ray_init_kwargs": '{"address": }'})
    with pytest.raises(ConfigError, match="ray_num_workers"):
        build_config({**base_cfg, "ray_num_workers": 0})


def test_missing_ray_package_is_refused_with_the_install_line(base_cfg):
    found = launch_problems(base_cfg, replace(RAY, packages=frozenset()), ray_num_workers=2)
    assert len(found) == 1
    assert "USE_RAY=1" in found[0] and "pip install 'lmstack[ray]'" in found[0]


@pytest.mark.parametrize(
    "field, value",
    [
        ("ray_num_workers", 4),
        ("ray_init_kwargs", {"num_cpus": 2}),
        ("master_addr", "10.0.0.1"),
        ("master_port", 29500),
    ],
)
def test_ray_fields_without_use_ray_are_refused_not_ignored(base_cfg, field, value):
    found = launch_problems(base_cfg, CPU, **{field: value})
    assert len(found) == 1 and f"{field}: " in found[0] and "USE_RAY=1" in found[0]
    # `check` may run elsewhere than the job (no USE_RAY there): it accepts LF's Ray YAML as written
    assert check_rules(plan_of(base_cfg, CPU, **{field: value}), launch=False)[1] == []


def test_use_ray_with_force_torchrun_is_refused(base_cfg):
    found = launch_problems(base_cfg, replace(RAY, force_torchrun=True), ray_num_workers=2)
    assert any("USE_RAY=1 and FORCE_TORCHRUN=1" in p for p in found)


def test_single_process_stage_is_refused_on_several_ray_workers(base_cfg):
    found = launch_problems(base_cfg, stage="ppo", reward_model="/nowhere", ray_num_workers=2)
    assert any("stage: ppo runs in one process" in p for p in found)


def test_workers_get_the_drivers_environment_but_not_its_topology():
    env = {
        "HF_HUB_OFFLINE": "1",
        "LMSTACK_OUTPUT_LOCK_HELD": "/out",
        "RANK": "0",
        "MASTER_PORT": "1",
        "CUDA_VISIBLE_DEVICES": "0,1",
        "RAY_ADDRESS": "auto",
        "PWD": "/x",
    }
    assert ray_launch.worker_environment(env) == {"HF_HUB_OFFLINE": "1", "LMSTACK_OUTPUT_LOCK_HELD": "/out"}


def test_unknown_ray_init_kwargs_are_refused_before_ray_starts():
    pytest.importorskip("ray")
    with pytest.raises(
        ConfigError, match="ray_init_kwargs: num_cpu is not a parameter of ray.init.*num_cpus"
    ):
        ray_launch.init_cluster({"num_cpu": 2}, {})


def test_train_without_the_ray_package_stops_before_the_model_loads(base_cfg, tmp_path, monkeypatch):
    """`lmstack train` under USE_RAY=1 on a machine without ray: the refusal names the install line and
    nothing was loaded or written (the plan's checks run before the launch)."""
    import importlib.util

    from lmstack.train.run import train

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a)
    )
    monkeypatch.setenv("USE_RAY", "1")
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=r"pip install 'lmstack\[ray\]'"):
        train(None, {**base_cfg, "output_dir": str(out), "ray_num_workers": 2})
    assert not out.exists() or not any(out.iterdir())


def test_cluster_checks_follow_lfs_rules(monkeypatch):
    """No more workers than the cluster has devices of the run's kind; master_addr a live node."""
    ray = pytest.importorskip("ray")
    from lmstack.plan.runplan import RayPlan

    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0, "GPU": 1.0})
    nodes = [
        {"NodeManagerAddress": "10.0.0.1", "NodeID": "head", "Alive": True},
        {"NodeManagerAddress": "10.0.0.2", "NodeID": "gone", "Alive": False},
    ]
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    spec = RayPlan(num_workers=2, init_kwargs={}, master_addr=None, master_port=None, use_gpu=False)
    assert ray_launch.check_cluster(spec) is None
    assert ray_launch.check_cluster(replace(spec, master_addr="10.0.0.1")) == "head"
    with pytest.raises(ConfigError, match=r"ray_num_workers: 3 workers need 3 CPUs .* the Ray cluster has 2"):
        ray_launch.check_cluster(replace(spec, num_workers=3))
    with pytest.raises(ConfigError, match=r"ray_num_workers: 2 workers need 2 GPUs .* has 1"):
        ray_launch.check_cluster(replace(spec, use_gpu=True))
    with pytest.raises(ConfigError, match=r"master_addr: 10.0.0.2 is not a live node .*live nodes: 10.0.0.1"):
        ray_launch.check_cluster(replace(spec, master_addr="10.0.0.2"))
