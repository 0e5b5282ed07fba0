"""Launch files for a planned layout (`lmstack plan ... --emit torchrun|slurm|k8s`).

Every form starts, on each node, torchrun with the topology lmstack's own relaunch uses
(launch/torchrun.Topology: --nnodes --node_rank --nproc_per_node --master_addr --master_port) running
`-m lmstack.cli train CONFIG [key=value ...]`, and sets in the environment exactly the topology
variables `lmstack train` reads (TOPOLOGY_ENV: LaunchContext and launch/torchrun.topology), with the
same values, so a worker's LaunchContext sees the real NNODES / NODE_RANK / NPROC_PER_NODE and not its
defaults. torchrun itself gives each worker RANK, LOCAL_RANK and WORLD_SIZE. Nothing else is set: the
CUDA allocator mode is applied by each worker from its own run plan (train/run.apply_allocator).

- torchrun: one line per node; the master's address is given (--master-addr) or read from
  $MASTER_ADDR on each node when the line runs (the shell stops with a message when it is unset).
- slurm: an sbatch script (one task per node, every GPU of the node to it); the master is the job's
  first node (`scontrol show hostnames "$SLURM_JOB_NODELIST"`), a node's rank its $SLURM_NODEID.
- k8s: a ConfigMap holding the YAML and a Kubeflow training-operator PyTorchJob (kubeflow.org/v1) with a
  Master and (nodes - 1) Worker replicas, one pod per node. The operator gives each pod MASTER_ADDR,
  MASTER_PORT (its `pytorchjob-port`) and RANK (Master 0, Worker i -> i + 1, its envvar.go); the pod's
  command turns RANK into NODE_RANK and torchrun's --node_rank, and torchrun replaces the operator's
  RANK / WORLD_SIZE (pods) with the per-process ones.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from lmstack.launch.torchrun import DEFAULT_MULTINODE_PORT, Topology

FORMS = ("torchrun", "slurm", "k8s")
# the environment every form sets: the topology variables `lmstack train` reads
TOPOLOGY_ENV = ("NNODES", "NODE_RANK", "NPROC_PER_NODE", "MASTER_ADDR", "MASTER_PORT")
K8S_CONTAINER = "pytorch"  # the training operator finds its port in the container of this name
K8S_PORT_NAME = "pytorchjob-port"
K8S_CONFIG_DIR = "/etc/lmstack"


@dataclass(frozen=True)
class LaunchSpec:
    """One planned layout to launch: `nnodes` nodes x `nproc_per_node` GPUs, each running
    `lmstack train config overrides`."""

    config: str  # the YAML's path as every node sees it (a shared file system; k8s: its ConfigMap copy)
    nnodes: int
    nproc_per_node: int
    overrides: tuple[str, ...] = ()  # key=value, applied after the YAML (the plan's changes among them)
    master_addr: str | None = None  # None: each node's $MASTER_ADDR (torchrun form)
    master_port: int = DEFAULT_MULTINODE_PORT
    job_name: str = "lmstack"
    image: str | None = None  # k8s: the container image with lmstack installed
    summary: str = ""  # what the planner chose, written as a comment at the top
    notes: tuple[str, ...] = field(default_factory=tuple)  # more comment lines (what to install, ...)

    def __post_init__(self) -> None:
        if self.nnodes < 1 or self.nproc_per_node < 1:
            raise ValueError(
                f"nodes and GPUs per node must be >= 1 (got {self.nnodes} x {self.nproc_per_node})"
            )


def node_env(
    spec: LaunchSpec, node_rank: int | str, master_addr: str, master_port: int | str
) -> dict[str, str]:
    """The variables a node sets (TOPOLOGY_ENV), in that order."""
    values = (spec.nnodes, node_rank, spec.nproc_per_node, master_addr, master_port)
    return {name: str(value) for name, value in zip(TOPOLOGY_ENV, values, strict=True)}


def train_args(spec: LaunchSpec, config: str | None = None) -> list[str]:
    return ["-m", "lmstack.cli", "train", config or spec.config, *spec.overrides]


def _header(spec: LaunchSpec, prefix: str = "# ") -> list[str]:
    lines = [f"lmstack plan: {spec.nnodes} node(s) x {spec.nproc_per_node} GPU(s)"]
    lines += [spec.summary] if spec.summary else []
    lines += list(spec.notes)
    return [prefix + line for line in lines]


def torchrun_lines(spec: LaunchSpec) -> str:
    """One shell line per node: the topology variables, then torchrun with the same values."""
    addr = spec.master_addr or '"${MASTER_ADDR:?set MASTER_ADDR to the address of node 0}"'
    out = _header(spec)
    out.append("# run line N on node N; every node must reach node 0 at the master address and port")
    for rank in range(spec.nnodes):
        env = node_env(spec, rank, "@ADDR@", spec.master_port)
        topo = Topology(spec.nnodes, rank, spec.nproc_per_node, "@ADDR@", spec.master_port)
        words = [f"{k}={shlex.quote(v)}" for k, v in env.items()] + ["torchrun", *topo.args()]
        words += [shlex.quote(a) for a in train_args(spec)]
        quoted_addr = addr if spec.master_addr is None else shlex.quote(spec.master_addr)
        out.append(" ".join(words).replace("@ADDR@", quoted_addr))
    return "\n".join(out) + "\n"


def slurm_script(spec: LaunchSpec) -> str:
    """An sbatch script: #SBATCH nodes / one task per node / GPUs per node, the master from the job's
    first host, then one srun task per node running torchrun with that node's rank."""
    inner = (
        'export NODE_RANK="$SLURM_NODEID"; exec torchrun --nnodes "$NNODES" --node_rank "$NODE_RANK" '
        '--nproc_per_node "$NPROC_PER_NODE" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" '
        + " ".join(shlex.quote(a) for a in train_args(spec))
    )
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={spec.job_name}",
        f"#SBATCH --nodes={spec.nnodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={spec.nproc_per_node}",
        *_header(spec),
        "set -euo pipefail",
        'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)"',
        "export MASTER_ADDR",
        f"export MASTER_PORT={spec.master_port}",
        f"export NNODES={spec.nnodes}",
        f"export NPROC_PER_NODE={spec.nproc_per_node}",
        'srun --nodes="$NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c ' + shlex.quote(inner),
    ]
    return "\n".join(lines) + "\n"


def k8s_objects(spec: LaunchSpec, config_name: str, config_text: str) -> list[dict]:
    """[ConfigMap with the YAML, PyTorchJob] as plain dicts (the k8s form's documents)."""
    if not spec.image:
        raise ValueError("--emit k8s needs --image: the container image with lmstack installed")
    cm_name = f"{spec.job_name}-config"
    config_path = f"{K8S_CONFIG_DIR}/{config_name}"
    inner = (
        'export NODE_RANK="$RANK"; exec torchrun --nnodes "$NNODES" --node_rank "$NODE_RANK" '
        '--nproc_per_node "$NPROC_PER_NODE" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" '
        + " ".join(shlex.quote(a) for a in train_args(spec, config_path))
    )
    gpus = str(spec.nproc_per_node)

    def replica(count: int) -> dict:
        env = [
            {"name": "NNODES", "value": str(spec.nnodes)},
            {"name": "NPROC_PER_NODE", "value": str(spec.nproc_per_node)},
        ]
        container = {
            "name": K8S_CONTAINER,
            "image": spec.image,
            "command": ["bash", "-c", inner],
            "env": env,
            "ports": [{"name": K8S_PORT_NAME, "containerPort": spec.master_port}],
            "resources": {"limits": {"nvidia.com/gpu": gpus}, "requests": {"nvidia.com/gpu": gpus}},
            "volumeMounts": [{"name": "config", "mountPath": K8S_CONFIG_DIR, "readOnly": True}],
        }
        return {
            "replicas": count,
            "restartPolicy": "OnFailure",
            "template": {
                "spec": {
                    "containers": [container],
                    "volumes": [{"name": "config", "configMap": {"name": cm_name}}],
                }
            },
        }

    replicas = {"Master": replica(1)}
    if spec.nnodes > 1:
        replicas["Worker"] = replica(spec.nnodes - 1)
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": cm_name},
        "data": {config_name: config_text},
    }
    job = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": spec.job_name},
        # runPolicy is required by the v1 API (kubeflow-training's models); cleanPodPolicy None is its default
        "spec": {
            "nprocPerNode": gpus,
            "pytorchReplicaSpecs": replicas,
            "runPolicy": {"cleanPodPolicy": "None"},
        },
    }
    return [config_map, job]


def k8s_manifest(spec: LaunchSpec, config_name: str, config_text: str) -> str:
    import yaml

    class Dumper(yaml.SafeDumper):
        """Multi-line strings (the YAML in the ConfigMap) as literal blocks."""

    def text(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
        style = "|" if "\n" in value and not value.endswith((" ", "\t")) else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    Dumper.add_representer(str, text)
    docs = k8s_objects(spec, config_name, config_text)
    head = "\n".join(
        [
            *_header(spec),
            "# the model, dataset_dir and output_dir the YAML names must be reachable in the pods",
        ]
    )
    body = "---\n".join(yaml.dump(d, Dumper=Dumper, sort_keys=False, allow_unicode=True) for d in docs)
    return head + "\n" + body


def render(form: str, spec: LaunchSpec, config_name: str = "", config_text: str = "") -> str:
    if form == "torchrun":
        return torchrun_lines(spec)
    if form == "slurm":
        return slurm_script(spec)
    if form == "k8s":
        return k8s_manifest(spec, config_name, config_text)
    raise ValueError(f"--emit: got {form!r}; allowed: {' | '.join(FORMS)}")
