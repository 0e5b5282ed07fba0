"""`lmstack train` relaunches itself under torchrun (as llamafactory-cli does).

When more than one GPU is visible, or `FORCE_TORCHRUN=1`, the CLI re-runs itself as
`python -m torch.distributed.run --nnodes .. --node_rank .. --nproc_per_node .. --master_addr ..
--master_port .. -m lmstack.cli.main train <cfg.yaml> [overrides]`. The topology comes from the
standard variables NNODES, NODE_RANK, NPROC_PER_NODE, MASTER_ADDR, MASTER_PORT (what every launcher sets);
the child command is an argument list (never a shell string) and is logged. A node that finds no
complete rendezvous (its master unreachable, another node missing) fails after torchrun's rendezvous
timeout (600 s; `PET_RDZV_CONF=timeout=N`, torchrun's own variable) with one line naming the master,
NNODES, NODE_RANK and that timeout; torchrun's error file (TORCHELASTIC_ERROR_FILE) tells it apart.
The run plan's allocator setting (plan.allocator: expandable segments) reaches every worker through its
environment, so each rank's caching allocator starts in the same mode.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from lmstack.config.errors import ConfigError, LmstackError

logger = logging.getLogger(__name__)

DEFAULT_MULTINODE_PORT = 29500
DEFAULT_RDZV_TIMEOUT = 600  # torchrun's static rendezvous (static_tcp_rendezvous._default_timeout_seconds)


def under_launcher(env: Mapping[str, str] | None = None) -> bool:
    """True inside a torchrun / accelerate / deepspeed worker (the launcher set the topology)."""
    env = os.environ if env is None else env
    return "LOCAL_RANK" in env or "WORLD_SIZE" in env


def force_torchrun(env: Mapping[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    return env.get("FORCE_TORCHRUN", "0").strip().lower() in ("1", "true", "yes")


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def should_relaunch(from_cli: bool, env: Mapping[str, str] | None = None, gpus: int | None = None) -> bool:
    """Relaunch when not already a worker and (FORCE_TORCHRUN=1, or > 1 GPU on the CLI path).

    In-process calls (`train(None, {...})` from Python or tests) only relaunch with FORCE_TORCHRUN=1.
    """
    env = os.environ if env is None else env
    if under_launcher(env):
        return False
    if force_torchrun(env):
        return True
    return from_cli and (visible_gpus() if gpus is None else gpus) > 1


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _int_env(env: Mapping[str, str], name: str, default: int, minimum: int = 1) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name}: got {raw!r}; expected an integer") from None
    if value < minimum:
        raise ConfigError(f"{name}: got {value}; must be >= {minimum}")
    return value


@dataclass(frozen=True)
class Topology:
    nnodes: int
    node_rank: int
    nproc_per_node: int
    master_addr: str
    master_port: int

    def args(self) -> list[str]:
        return [
            "--nnodes",
            str(self.nnodes),
            "--node_rank",
            str(self.node_rank),
            "--nproc_per_node",
            str(self.nproc_per_node),
            "--master_addr",
            self.master_addr,
            "--master_port",
            str(self.master_port),
        ]


def topology(env: Mapping[str, str] | None = None, gpus: int | None = None) -> Topology:
    """Read the topology variables; defaults: 1 node, one process per GPU (1 on CPU), a free port."""
    env = os.environ if env is None else env
    gpus = visible_gpus() if gpus is None else gpus
    nnodes = _int_env(env, "NNODES", 1)
    node_rank = _int_env(env, "NODE_RANK", 0, minimum=0)
    if node_rank >= nnodes:
        raise ConfigError(f"NODE_RANK: got {node_rank}; must be < NNODES ({nnodes})")
    nproc = _int_env(env, "NPROC_PER_NODE", max(gpus, 1))
    if gpus and nproc > gpus:
        raise ConfigError(
            f"NPROC_PER_NODE: got {nproc} but only {gpus} GPU(s) are visible; "
            "lower NPROC_PER_NODE or check CUDA_VISIBLE_DEVICES"
        )
    addr = env.get("MASTER_ADDR") or ""
    if nnodes > 1 and not addr:
        raise ConfigError(
            f"MASTER_ADDR: required when NNODES={nnodes}; set it to the address of node 0 on every node"
        )
    addr = addr or "127.0.0.1"
    if env.get("MASTER_PORT"):
        port = _int_env(env, "MASTER_PORT", DEFAULT_MULTINODE_PORT)
    elif nnodes > 1:  # every node must agree on the port: a random one cannot work
        port = DEFAULT_MULTINODE_PORT
        logger.info("MASTER_PORT not set; using %d on every node", port)
    else:
        port = free_port()
    return Topology(nnodes, node_rank, nproc, addr, port)


def override_args(overrides: list[str] | dict | None) -> list[str]:
    """Overrides for the child's argv: CLI lists pass through; dict values are written as JSON
    (valid YAML, so the child parses them back to the same values)."""
    if overrides is None:
        return []
    if isinstance(overrides, dict):
        return [f"{k}={json.dumps(v)}" for k, v in overrides.items()]
    return list(overrides)


def torchrun_command(
    config_path: str | Path, overrides: list[str] | dict | None, topo: Topology, python: str | None = None
) -> list[str]:
    return [
        python or sys.executable,
        "-m",
        "torch.distributed.run",
        *topo.args(),
        "-m",
        "lmstack.cli.main",
        "train",
        str(config_path),
        *override_args(overrides),
    ]


def alloc_conf_variable(torch_version: str) -> str:
    """The variable that carries allocator settings to a CUDA worker: PYTORCH_ALLOC_CONF from torch 2.11
    (2.9 renamed it, but 2.9.x ignored expandable_segments there for CUDA: pytorch/pytorch#183387),
    PYTORCH_CUDA_ALLOC_CONF before."""
    major, minor = (int(x) for x in torch_version.split("+")[0].split(".")[:2])
    return "PYTORCH_ALLOC_CONF" if (major, minor) >= (2, 11) else "PYTORCH_CUDA_ALLOC_CONF"


def worker_env(env: Mapping[str, str], allocator: str | None = None) -> dict[str, str]:
    """The workers' environment: this one, without FORCE_TORCHRUN (they must not relaunch again), with the
    plan's allocator setting (None: the default allocator or the user's own variable, passed as it is)."""
    child_env = dict(env)
    child_env.pop("FORCE_TORCHRUN", None)
    if allocator:
        import torch

        child_env[alloc_conf_variable(torch.__version__)] = allocator
    return child_env


def relaunch(
    config_path: str | Path,
    overrides: list[str] | dict | None,
    env: dict[str, str],
    allocator: str | None = None,
) -> None:
    """Run the job under torchrun and wait; a non-zero exit of any rank raises LmstackError.
    `allocator`: plan.allocator.setting, put in every worker's environment."""
    topo = topology(env)
    cmd = torchrun_command(config_path, overrides, topo)
    logger.info(
        "launching %d process(es) per node on %d node(s) (node %d), master %s:%d",
        topo.nproc_per_node,
        topo.nnodes,
        topo.node_rank,
        topo.master_addr,
        topo.master_port,
    )
    logger.info("child command: %s", " ".join(_quote(c) for c in cmd))
    child_env = worker_env(env, allocator)
    with tempfile.TemporaryDirectory(prefix="lmstack_torchrun_") as tmp:
        # torchrun writes its own exception (not a worker's) there: tells a failed rendezvous apart
        error_file = Path(child_env.setdefault("TORCHELASTIC_ERROR_FILE", str(Path(tmp) / "error.json")))
        before = _mtime(error_file)
        proc = subprocess.run(cmd, env=child_env, check=False)
        failed = proc.returncode != 0 and _mtime(error_file) != before
        rendezvous = _rendezvous_failure(error_file) if failed else None
    if rendezvous is not None:
        timeout = rendezvous_timeout(env)
        raise LmstackError(
            f"torchrun: node {topo.node_rank} found no complete rendezvous at MASTER_ADDR:MASTER_PORT="
            f"{topo.master_addr}:{topo.master_port} with NNODES={topo.nnodes}, NODE_RANK={topo.node_rank} "
            f"within the rendezvous timeout of {timeout} s ({rendezvous}); start every node with the same "
            f"MASTER_ADDR, MASTER_PORT and NNODES and its own NODE_RANK (0..{topo.nnodes - 1}), and make "
            f"node 0 reachable at that address from this host (torchrun's PET_RDZV_CONF=timeout=N sets the "
            "wait)"
        )
    if proc.returncode != 0:
        raise LmstackError(
            f"torchrun exited with code {proc.returncode}; the failing rank's error is printed above"
        )


def rendezvous_timeout(env: Mapping[str, str]) -> int:
    """How long torchrun's static rendezvous waits for every node: `timeout` in PET_RDZV_CONF (the
    variable of torchrun's --rdzv-conf, `key=value,...`), else torchrun's default."""
    for item in env.get("PET_RDZV_CONF", "").split(","):
        key, _, value = item.partition("=")
        if key.strip() == "timeout" and value.strip().isdigit():
            return int(value)
    return DEFAULT_RDZV_TIMEOUT


def _mtime(path: Path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None


def _rendezvous_failure(error_file: Path) -> str | None:
    """The first line of torchrun's error when its rendezvous failed (its error file, written by
    torch.distributed.elastic's @record on torchrun's main); None for any other failure."""
    try:
        record = json.loads(error_file.read_text())["message"]
        stack, message = record["extraInfo"]["py_callstack"], record["message"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if "next_rendezvous" not in str(stack):
        return None
    return (str(message).strip().splitlines() or ["rendezvous failed"])[0]


def _quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)
