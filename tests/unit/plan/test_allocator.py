"""plan.allocator: the run plan decides the CUDA caching allocator's mode (issues 20 and 19). Expandable
segments when the batch shapes change (padded rows, pairs, generation, image rows, other eval batches),
the default allocator for packed rows of one shape, nothing without CUDA; the user's own allocator
variable wins; known incompatibilities keep it off. The torchrun workers get it in their environment,
and the planner's reserved figure follows it."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from lmstack.config.load import build_config
from lmstack.launch.context import LaunchContext
from lmstack.memory import memory as mem
from lmstack.memory import plan as run_planner
from lmstack.plan.from_config import request_from_plan
from lmstack.plan.runplan import RunPlan
from lmstack.plan.whatif import gpu_context

REPO = Path(__file__).resolve().parents[3]
CPU = LaunchContext()
GPU = replace(gpu_context(1, 80), alloc_conf=None, nccl_register_hook=False)  # whatever this shell sets
ON = "expandable_segments:True"


def resolve(base_cfg, ctx=GPU, **over) -> RunPlan:
    return RunPlan.resolve(build_config({**base_cfg, **over}), ctx)


def test_unpacked_rows_on_a_gpu_get_expandable_segments_and_the_plan_says_why(base_cfg):
    p = resolve(base_cfg)
    assert not p.packing
    assert p.allocator.expandable and p.allocator.setting == ON and p.allocator.source == "plan"
    assert "padded to each batch's longest (not packed)" in p.reasons["allocator"]
    assert p.decisions()["allocator"] == "expandable_segments"
    line = next(x for x in p.describe().splitlines() if x.strip().startswith("allocator"))
    assert "expandable_segments" in line and "not packed" in line  # what `lmstack plan` / `check` print
    assert p.to_dict()["reasons"]["allocator"] == p.reasons["allocator"]  # the run manifest records it


def test_packed_rows_of_one_shape_keep_the_default_allocator(base_cfg):
    p = resolve(base_cfg, packing=True)
    assert not p.allocator.expandable and p.allocator.setting is None
    assert p.decisions()["allocator"] == "default"
    assert "packed rows of one shape" in p.reasons["allocator"]


def test_packed_rows_with_eval_batches_of_another_size_change_shape(base_cfg):
    evals = dict(packing=True, val_size=0.1, eval_strategy="steps", eval_steps=2)
    p = resolve(base_cfg, **evals, per_device_eval_batch_size=1)
    assert p.allocator.setting == ON and "evaluation batches of 1 rows" in p.reasons["allocator"]
    same = resolve(base_cfg, **evals, per_device_eval_batch_size=4)  # = per_device_train_batch_size
    assert same.allocator.setting is None


@pytest.mark.parametrize(
    ("over", "why"),
    [
        ({"stage": "dpo", "dataset": "dpo_en_demo"}, "chosen/rejected pairs padded"),
        ({"stage": "rm", "dataset": "dpo_en_demo"}, "chosen/rejected pairs padded"),
        ({"stage": "kto", "dataset": "kto_en_demo"}, "KTO rows and their KL batch"),
        ({"stage": "grpo", "reward_funcs": "m:f"}, "stage grpo generates"),
    ],
)
def test_stages_that_cannot_pack_or_that_generate_get_expandable_segments(base_cfg, over, why):
    p = resolve(base_cfg, **over)
    assert p.allocator.setting == ON and why in p.reasons["allocator"], p.reasons["allocator"]


def test_every_stage_that_cannot_pack_decides_expandable_from_the_stage_table(base_cfg):
    from lmstack.config.stages import STAGE_SPECS
    from lmstack.plan import decide

    cfg = build_config(base_cfg)
    for spec in STAGE_SPECS.values():
        if not spec.packs or spec.generates:
            assert decide.allocator(cfg, GPU, "cuda", spec, False, False).expandable, spec.name


def test_no_cuda_no_allocator_setting(base_cfg):
    p = resolve(base_cfg, ctx=CPU)
    assert p.device == "cpu"
    assert not p.allocator.expandable and p.allocator.setting is None
    assert p.decisions()["allocator"] is None and "no CUDA caching allocator" in p.reasons["allocator"]


def test_the_users_allocator_variable_wins_and_the_plan_says_so(base_cfg):
    ctx = LaunchContext.from_env({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, probe_cuda=False)
    assert ctx.alloc_conf == ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    p = resolve(base_cfg, ctx=replace(GPU, alloc_conf=ctx.alloc_conf))  # unpacked: the plan would turn it on
    assert not p.allocator.expandable and p.allocator.setting is None and p.allocator.source == "environment"
    why = p.reasons["allocator"]
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False in the environment kept" in why
    assert "the plan would choose otherwise" in why
    theirs = LaunchContext.from_env({"PYTORCH_ALLOC_CONF": "max_split_size_mb:128,expandable_segments:True"},
                                    probe_cuda=False).alloc_conf  # fmt: skip
    packed = resolve(base_cfg, ctx=replace(GPU, alloc_conf=theirs), packing=True)
    assert packed.allocator.expandable and packed.allocator.setting is None  # theirs is on; nothing applied
    assert "PYTORCH_ALLOC_CONF=max_split_size_mb:128,expandable_segments:True" in packed.reasons["allocator"]


@pytest.mark.parametrize(
    ("value", "on"),
    [("expandable_segments:True", True), ("expandable_segments:False", False), ("max_split_size_mb:64", False),
     ("backend:cudaMallocAsync,expandable_segments:True", False), (" expandable_segments : True ", True)],
)  # fmt: skip
def test_the_environments_setting_is_read_as_torch_reads_it(value, on):
    from lmstack.plan.decide import expandable_in

    assert expandable_in(value) is on


def test_cudagraphs_and_nccl_buffer_registration_keep_it_off_with_the_reason(base_cfg):
    p = resolve(base_cfg, torch_compile=True, torch_compile_backend="cudagraphs")
    assert p.allocator.setting is None and "cudagraphs" in p.reasons["allocator"]
    assert "torchtitan#3306" in p.reasons["allocator"]
    hook = LaunchContext.from_env({"TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK": "1"}, probe_cuda=False)
    p = resolve(base_cfg, ctx=replace(GPU, nccl_register_hook=hook.nccl_register_hook))
    assert p.allocator.setting is None and "NVIDIA/nccl#2332" in p.reasons["allocator"]
    inductor = resolve(base_cfg, torch_compile=True)  # regional compile without CUDA graphs: no conflict
    assert inductor.allocator.setting == ON


def test_the_workers_environment_carries_the_plans_setting(base_cfg):
    from lmstack.launch import torchrun

    assert (
        torchrun.alloc_conf_variable("2.9.1+cu128") == "PYTORCH_CUDA_ALLOC_CONF"
    )  # 2.9 ignored the new name
    assert torchrun.alloc_conf_variable("2.11.0+cu130") == "PYTORCH_ALLOC_CONF"
    p = resolve(base_cfg)
    child = torchrun.worker_env({"FORCE_TORCHRUN": "1", "PATH": "/bin"}, p.allocator.setting)
    import torch

    name = torchrun.alloc_conf_variable(torch.__version__)
    assert child[name] == ON and "FORCE_TORCHRUN" not in child and child["PATH"] == "/bin"
    # every rank reads it back and keeps the same mode
    rank = LaunchContext.from_env(
        {**child, "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}, probe_cuda=False
    )
    worker = resolve(base_cfg, ctx=replace(GPU, alloc_conf=rank.alloc_conf, rank=1, local_rank=1))
    assert worker.allocator.expandable and worker.allocator.setting is None  # torch read it from the env
    assert "as the plan would choose" in worker.reasons["allocator"]
    assert torchrun.worker_env({"A": "1"}, None) == {"A": "1"}  # the default allocator: nothing added


def test_a_relaunched_job_hands_the_setting_to_its_workers(base_cfg, tmp_path):
    """Real torchrun (1 CPU worker): the parent's GPU plan chose expandable segments; the worker's own plan
    records the variable it found in its environment (on CPU it has no effect, and says so)."""
    from lmstack.launch import prepare

    out = tmp_path / "relaunch"
    cfg = {**base_cfg, "output_dir": str(out), "max_steps": 1, "max_samples": 16, "cutoff_len": 64}
    parent = resolve(cfg)
    assert parent.allocator.setting == ON
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(FORCE_TORCHRUN="1", NPROC_PER_NODE="1", CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1",
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", XDG_CACHE_HOME=str(tmp_path / "xdg"))  # fmt: skip
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        env.pop(name, None)
    assert prepare.relaunch_if_needed(parent, None, cfg, env=env) is not None
    manifest = json.loads((out / "run_manifest.json").read_text())
    why = manifest["plan"]["reasons"]["allocator"]
    assert "expandable_segments:True in the environment" in why and "no effect" in why, why


def test_a_cpu_train_run_applies_nothing(base_cfg):
    import torch

    from lmstack.train.run import apply_allocator, train

    get = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    before = get() if get else None
    metrics = train(None, {**base_cfg, "max_steps": 2, "use_cpu": True})
    assert metrics["train_loss"] > 0
    p = resolve(base_cfg, ctx=CPU)
    assert apply_allocator(p) is False
    if get:
        assert get() == before  # the allocator settings of this process were never touched


def test_the_planner_reserves_for_the_allocator_the_plan_chose(base_cfg):
    p = resolve(base_cfg)
    req = request_from_plan(p, 1, 80)
    assert req.expandable_segments
    gpu = run_planner(req).configured.estimate.gpu
    assert gpu.reserved / gpu.allocated == pytest.approx(mem.EXPANDABLE_FRAGMENTATION_FACTOR)
    off = resolve(
        base_cfg, ctx=replace(GPU, alloc_conf=("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False"))
    )
    default = run_planner(request_from_plan(off, 1, 80)).configured.estimate.gpu
    assert default.reserved / default.allocated == pytest.approx(mem.UNPACKED_FRAGMENTATION_FACTOR)
    assert default.allocated == pytest.approx(gpu.allocated)  # the allocator changes the margin only


def test_the_measured_unpacked_run_is_covered_by_the_default_allocators_margin(tmp_path, monkeypatch):
    """bench/results/plan_accuracy.json sft_unpacked_0.5b_lora_mb8 ran with the default allocator: 24.48 GiB
    allocated, 42.56 reserved. Recomputed with that allocator (the environment says so), the planner's
    reserved figure covers it; with the plan's own choice (expandable segments) it is the small margin."""
    sys.path.insert(0, str(REPO / "bench"))
    import plan_check
    from plan_accuracy import predict

    run = next(r for r in json.loads((REPO / "bench/results/plan_accuracy.json").read_text())["runs"]
               if r["name"] == "sft_unpacked_0.5b_lora_mb8")  # fmt: skip
    plan_check.config_only_assets(tmp_path)
    cfg = plan_check.local(run["config"], tmp_path, run["config"]["model_name_or_path"])
    seq = run["lengths"]["seq_len"]
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    default = predict(cfg, plan_check.H200_GIB, seq_len=seq)
    assert default["reserved"] >= run["reserved_gib"], (default["reserved"], run["reserved_gib"])
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    chosen = predict(cfg, plan_check.H200_GIB, seq_len=seq)
    assert chosen["allocated"] == pytest.approx(default["allocated"])
    assert chosen["reserved"] == pytest.approx(
        chosen["allocated"] * mem.EXPANDABLE_FRAGMENTATION_FACTOR, abs=0.01
    )


def test_a_resume_may_change_the_allocator(base_cfg):
    """The allocator changes no number a checkpoint holds: a resume under another mode is allowed."""
    from lmstack.reliability.manifest import run_identity
    from lmstack.reliability.run_changes import run_changes

    on = resolve(base_cfg)
    off = resolve(base_cfg, ctx=replace(GPU, alloc_conf=("PYTORCH_ALLOC_CONF", "expandable_segments:False")))
    unsafe, safe = run_changes(
        run_identity(on.cfg, on.decisions())["run"], run_identity(off.cfg, off.decisions())["run"]
    )
    assert not unsafe and len(safe) == 1 and safe[0].startswith("run plan allocator:")
