"""USE_RAY=1: `lmstack train` runs the job on Ray Train workers (LLaMA-Factory's Ray launch).

LF's contract (its RayArguments and tuner): `ray_num_workers` workers, `ray.init(**ray_init_kwargs)` unless
Ray is already initialised, no more workers than the cluster has devices, `master_addr` must be a live
Ray node (default: where rank 0 runs), `master_port` a free port when not given, and the outputs land in
output_dir as in any other run. lmstack builds it on Ray Train's `TorchTrainer`: each worker gets a
torchrun worker's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR,
MASTER_PORT) and runs `lmstack train` with the same config, so the stages, checkpoints, resume and outputs
are the torchrun ones. The process group is initialised by the worker as under torchrun (gloo on CPU with
one CPU per worker, NCCL with one GPU per worker); Ray only places the workers (rank 0 on master_addr's
node through a node label selector) and names the rendezvous. The workers get the driver's environment
(the job's runtime_env, as LF hands its environment to its Ray workers), less the topology and devices.

A worker that fails or dies ends the whole run (Ray Train's FailureConfig(max_failures=0)): the driver
raises LmstackError saying the final outputs were not written and how to resume. Checkpoints are written atomically
(reliability/checkpoint.py), and the final outputs only after the last step, so a killed run leaves
complete checkpoints and no half-written output; `resume_from_checkpoint: auto` continues it. A Ray
cluster this process started (no `address` in ray_init_kwargs, no RAY_ADDRESS) is shut down when the run
ends.
Ray's own run records go to a temporary folder (RunConfig.storage_path), not to output_dir. The workers
read the config file and write output_dir through their own file system: on several nodes both must be
on storage every node sees (as with LF).
"""

from __future__ import annotations

import inspect
import logging
import os
import socket
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmstack.config.errors import ConfigError, LmstackError

if TYPE_CHECKING:
    from lmstack.plan.runplan import RayPlan, RunPlan

logger = logging.getLogger(__name__)


# what the workers do not take from the driver's environment: the topology each one gets from Ray Train,
# the devices Ray assigns it, Ray's own settings and this host's names
NOT_FORWARDED = frozenset(
    """RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE NODE_RANK NNODES NPROC_PER_NODE MASTER_ADDR MASTER_PORT
    FORCE_TORCHRUN PWD OLDPWD HOSTNAME""".split()
)


def worker_environment(env: dict[str, str]) -> dict[str, str]:
    """The driver's environment for the workers (as LF hands its environment to every Ray worker, and
    torchrun to its children), less NOT_FORWARDED, RAY_* and the *_VISIBLE_DEVICES Ray sets per worker."""
    return {
        k: v
        for k, v in env.items()
        if k not in NOT_FORWARDED and not k.startswith("RAY_") and not k.endswith("_VISIBLE_DEVICES")
    }


def init_cluster(init_kwargs: dict, env: dict[str, str]) -> bool:
    """`ray.init(**ray_init_kwargs)` unless Ray is initialised already, with `env` added to the job's
    runtime_env (the user's own env_vars win); returns whether it was called here (and must be shut
    down). Unknown keys are refused naming ray.init's parameters."""
    import ray

    if ray.is_initialized():
        return False
    accepted = set(inspect.signature(ray.init).parameters) - {"kwargs"}
    unknown = sorted(set(init_kwargs) - accepted)
    if unknown:
        raise ConfigError(
            f"ray_init_kwargs: {', '.join(unknown)} is not a parameter of ray.init; allowed: "
            f"{' | '.join(sorted(k for k in accepted if not k.startswith('_')))}"
        )
    runtime_env = dict(init_kwargs.get("runtime_env") or {})
    runtime_env["env_vars"] = {**env, **(runtime_env.get("env_vars") or {})}
    ray.init(**{**init_kwargs, "runtime_env": runtime_env})
    return True


def check_cluster(spec: RayPlan) -> str | None:
    """The cluster can place the workers (LF: no more workers than devices); `master_addr` is a live
    node. Returns that node's id (None: no master_addr)."""
    import ray

    device = "GPU" if spec.use_gpu else "CPU"
    have = int(ray.cluster_resources().get(device, 0))
    if spec.num_workers > have:
        raise ConfigError(
            f"ray_num_workers: {spec.num_workers} workers need {spec.num_workers} {device}s (one each) and the "
            f"Ray cluster has {have}; lower ray_num_workers or add nodes"
        )
    if spec.master_addr is None:
        return None
    alive = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    if spec.master_addr not in alive:
        raise ConfigError(
            f"master_addr: {spec.master_addr} is not a live node of the Ray cluster; live nodes: "
            f"{' | '.join(sorted(alive))} (or remove master_addr: rank 0's node hosts the rendezvous)"
        )
    return alive[spec.master_addr]


def _rendezvous_address(port: int | None) -> tuple[str, int]:
    """Runs on rank 0's worker: its node's address, and the port (a free one when not given)."""
    import ray

    if port is None:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
    return ray.util.get_node_ip_address(), port


def _set_rendezvous(addr: str, port: int) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)


def torch_config(spec: RayPlan, timeout_s: int) -> Any:
    """A TorchConfig whose backend only names the rendezvous: the worker initialises the process group
    itself, as a torchrun worker does (the Trainer and DeepSpeed expect to)."""
    from ray.train.backend import Backend
    from ray.train.torch import TorchConfig

    master_addr, master_port = spec.master_addr, spec.master_port

    class Rendezvous(Backend):
        share_cuda_visible_devices = True  # every worker of a node sees its GPUs; LOCAL_RANK picks one

        def on_start(self, worker_group, backend_config) -> None:
            addr, port = worker_group.execute_single(0, _rendezvous_address, master_port)
            if master_addr is not None and addr != master_addr:
                raise LmstackError(f"master_addr: {master_addr} asked, but Ray placed rank 0 on {addr}")
            worker_group.execute(_set_rendezvous, addr=addr, port=port)

        def on_shutdown(self, worker_group, backend_config) -> None:
            return None  # the worker's own `lmstack train` destroys its process group (launch/dist.py)

    class RendezvousConfig(TorchConfig):
        @property
        def backend_cls(self):
            return Rendezvous

    return RendezvousConfig(backend="nccl" if spec.use_gpu else "gloo", timeout_s=timeout_s)


# what each worker runs: the module a torchrun worker runs (`-m lmstack.cli.main train ...`), or a script
# path that takes the same arguments after the script's own name (`<script> <config> [overrides]`)
WORKER_ENTRY = "lmstack.cli.main"


def worker_loop(config: dict) -> None:
    """One Ray Train worker: a torchrun worker's environment, then the same entry point a torchrun
    worker runs (`lmstack.cli.main train <config> [overrides]`), in this process."""
    import runpy
    import sys

    import ray.train

    ctx = ray.train.get_context()
    os.environ.update(
        RANK=str(ctx.get_world_rank()),
        LOCAL_RANK=str(ctx.get_local_rank()),
        WORLD_SIZE=str(ctx.get_world_size()),
        LOCAL_WORLD_SIZE=str(ctx.get_local_world_size()),
        NODE_RANK=str(ctx.get_node_rank()),
        **config["env"],
    )
    if Path(config["cwd"]).is_dir():  # relative paths in the config mean what they meant to the driver
        os.chdir(config["cwd"])
    entry, args = config["entry"], [config["config_path"], *config["overrides"]]
    try:
        if entry.endswith(".py"):
            sys.argv = [entry, *args]
            runpy.run_path(entry, run_name="__main__")
        else:
            sys.argv = ["lmstack", "train", *args]
            runpy.run_module(entry, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    if code != 0:
        raise LmstackError(f"lmstack train exited with code {code} on rank {ctx.get_world_rank()}")


def run(plan: RunPlan, config_path: str, overrides: list[str]) -> None:
    """Trains on `plan.ray.num_workers` Ray Train workers and waits; a failed worker raises LmstackError."""
    import ray
    import ray.train
    from ray.train.torch import TorchTrainer

    spec, out = plan.ray, str(Path(plan.cfg.training.output_dir).absolute())
    # lmstack's own variables included: output_dir's run lock is held by this driver (LMSTACK_OUTPUT_LOCK_HELD)
    env = {**worker_environment(dict(os.environ)), "USE_RAY": "1"}
    started = init_cluster(spec.init_kwargs, env)
    try:
        master_node = check_cluster(spec)
        device = {"GPU": 1} if spec.use_gpu else {"CPU": 1}
        scaling = ray.train.ScalingConfig(
            num_workers=spec.num_workers,
            use_gpu=spec.use_gpu,
            resources_per_worker=device,
            label_selector=None
            if master_node is None
            else [{ray._raylet.RAY_NODE_ID_KEY: master_node}] + [{}] * (spec.num_workers - 1),
        )
        logger.info(
            "launching %d Ray Train worker(s) (%s), master %s",
            spec.num_workers,
            "1 GPU each, nccl" if spec.use_gpu else "1 CPU each, gloo",
            spec.master_addr or "rank 0's node",
        )
        with tempfile.TemporaryDirectory(prefix="lmstack_ray_") as storage:
            trainer = TorchTrainer(
                worker_loop,
                train_loop_config={
                    "config_path": str(Path(config_path).absolute()),
                    "overrides": list(overrides),
                    "cwd": os.getcwd(),
                    "env": env,  # again, for a Ray this process did not start (no runtime_env of ours)
                    "entry": WORKER_ENTRY,
                },
                torch_config=torch_config(spec, plan.cfg.training.ddp_timeout),
                scaling_config=scaling,
                run_config=ray.train.RunConfig(
                    name=f"lmstack-{Path(out).name}",
                    storage_path=storage,
                    failure_config=ray.train.FailureConfig(max_failures=0),
                ),
            )
            try:
                trainer.fit()
            except ray.train.TrainingFailedError as err:
                raise LmstackError(_failure_message(err, out)) from None
    finally:
        if started:
            ray.shutdown()


def _failure_message(err: Exception, output_dir: str) -> str:
    first = next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)
    return (
        f"Ray Train: a worker failed, so the run stopped ({first}). The final outputs were not written; "
        f"{output_dir} keeps the checkpoints completed before the failure: run again with "
        "resume_from_checkpoint: auto to continue from the newest (the failing worker's error is printed above)"
    )
