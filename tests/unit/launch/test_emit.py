"""`lmstack plan --emit torchrun|slurm|k8s`: each form, run as its scheduler would run it (a stand-in
`torchrun` records what it was started with; `scontrol`/`srun` and the training operator's environment
are simulated), starts torchrun on every node with the topology lmstack's own relaunch uses, and sets
exactly the variables `lmstack train` reads for it (LaunchContext, launch/torchrun.topology). The Slurm
script passes `bash -n` and its #SBATCH lines say the layout; the Kubernetes manifest passes the real
Kubernetes schema (kubernetes-validate, strict) for its core objects and the PyTorchJob v1 API
(kubeflow-training's models, generated from the training operator's OpenAPI) for the job."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lmstack.cli.main import main
from lmstack.launch.context import LaunchContext
from lmstack.launch.emit import K8S_CONFIG_DIR, TOPOLOGY_ENV, LaunchSpec, k8s_objects
from lmstack.launch.torchrun import Topology, topology

NODES, GPUS, PORT = 2, 8, 29611
# what bash itself adds to the environment of a command it runs
SHELL_VARS = {"PWD", "OLDPWD", "SHLVL", "_"}

FAKE_TORCHRUN = """#!{python}
import json, os, sys, uuid
out = os.path.join(os.environ["CAPTURE_DIR"], uuid.uuid4().hex + ".json")
with open(out, "w") as f:
    json.dump({{"argv": sys.argv[1:], "env": dict(os.environ)}}, f)
"""
FAKE_SCONTROL = """#!/bin/bash
[ "$1 $2" = "show hostnames" ] && [ "$3" = "$SLURM_JOB_NODELIST" ] || exit 3
printf 'gpu-node-a\\ngpu-node-b\\n'
"""
# srun: run the command once per node (the options before it are srun's), as one task per node
FAKE_SRUN = """#!{python}
import os, subprocess, sys
args = sys.argv[1:]
while args and args[0].startswith("--"):
    args.pop(0)
for node in range(int(os.environ["SLURM_JOB_NUM_NODES"])):
    rc = subprocess.call(args, env={{**os.environ, "SLURM_NODEID": str(node), "SLURM_PROCID": str(node)}})
    if rc:
        sys.exit(rc)
"""


class Recording(dict):
    """An environment that records every variable read from it."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.read: set[str] = set()

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.read.add(key)
        return super().__contains__(key)


def topology_reads() -> set[str]:
    """The variables `lmstack train` reads to start torchrun on a node (launch/torchrun.topology)."""
    env = Recording(NNODES="2", NODE_RANK="0", MASTER_ADDR="h", MASTER_PORT="1")
    topology(env, gpus=GPUS)
    return env.read


@pytest.fixture
def bin_dir(tmp_path):
    d = tmp_path / "bin"
    d.mkdir()
    for name, text in (("torchrun", FAKE_TORCHRUN), ("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN)):
        (d / name).write_text(text.format(python=sys.executable))
        (d / name).chmod(0o755)
    return d


QWEN_7B = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False)  # fmt: skip


@pytest.fixture
def cfg(tmp_path) -> Path:
    model = tmp_path / "qwen2.5-7b"  # config.json alone: what the planner reads
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], **QWEN_7B})
    )
    path = tmp_path / "train.yaml"
    path.write_text(
        yaml.safe_dump(
            dict(
                model_name_or_path=str(model),
                stage="sft",
                template="qwen",
                finetuning_type="full",
                dataset="alpaca_en_demo",
                cutoff_len=2048,
                packing=True,
                bf16=True,
                output_dir=str(tmp_path / "out"),
                per_device_train_batch_size=1,
            )
        )  # fmt: skip
    )
    return path


def emit(capsys, cfg: Path, form: str, *extra: str) -> str:
    capsys.readouterr()
    argv = ["plan", str(cfg), "--gpus", str(GPUS), "--nodes", str(NODES), "--gpu", "h100", "--no-data"]
    assert main([*argv, "--emit", form, "--master-port", str(PORT), *extra]) == 0
    return capsys.readouterr().out


def base_env(bin_dir: Path, capture: Path, **more: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in (*TOPOLOGY_ENV, "RANK", "WORLD_SIZE", "LOCAL_RANK")
    }
    return {**env, "PATH": f"{bin_dir}:{env['PATH']}", "CAPTURE_DIR": str(capture), **more}


def started(capture: Path) -> list[dict]:
    runs = [json.loads(p.read_text()) for p in capture.glob("*.json")]
    return sorted(runs, key=lambda r: int(r["env"]["NODE_RANK"]))


def check_nodes(runs: list[dict], base: dict, master: str, train: list[str]) -> None:
    """Each node started torchrun with lmstack's relaunch topology; the variables the form set are
    exactly the ones `lmstack train` reads for it, and read back they give the same layout."""
    assert [int(r["env"]["NODE_RANK"]) for r in runs] == list(range(NODES))
    for rank, run in enumerate(runs):
        env = run["env"]
        want = Topology(NODES, rank, GPUS, master, PORT)
        assert run["argv"] == [*want.args(), *train], run["argv"]
        set_by_form = {k for k in env if env[k] != base.get(k)} - SHELL_VARS
        set_by_form = {k for k in set_by_form if not k.startswith("SLURM_")}  # the scheduler's own
        assert set_by_form == set(TOPOLOGY_ENV) == topology_reads(), set_by_form
        assert topology(env, gpus=GPUS) == want
        ctx = LaunchContext.from_env(Recording(env), probe_cuda=False)
        assert (ctx.nnodes, ctx.node_rank, ctx.nproc_per_node) == (NODES, rank, GPUS)
        assert not ctx.under_launcher  # the torchrun agent's env: its workers get RANK/LOCAL_RANK from it


def recommended_train(capsys, cfg: Path, config_path: str | None = None) -> list[str]:
    capsys.readouterr()
    main(
        ["plan", str(cfg), "--gpus", str(GPUS), "--nodes", str(NODES), "--gpu", "h100", "--no-data", "--json"]
    )
    changes = json.loads(capsys.readouterr().out)["recommendation"]["yaml_changes"]
    assert changes  # a 7B full run on 2 x 8 x 80 GB is not plain DDP: the launch carries the changes
    return ["-m", "lmstack.cli", "train", config_path or str(cfg.resolve()),
            *(f"{k}={json.dumps(v)}" for k, v in changes.items())]  # fmt: skip


def test_torchrun_form_one_line_per_node(capsys, cfg, bin_dir, tmp_path):
    text = emit(capsys, cfg, "torchrun", "--master-addr", "10.0.0.1")
    lines = [x for x in text.splitlines() if x and not x.startswith("#")]
    assert len(lines) == NODES
    capture = tmp_path / "runs"
    capture.mkdir()
    base = base_env(bin_dir, capture)
    for line in lines:
        words = shlex.split(line)
        assigned = [w.split("=", 1)[0] for w in words[: words.index("torchrun")]]
        assert assigned == list(TOPOLOGY_ENV)
        subprocess.run(["bash", "-c", line], env=base, check=True)
    check_nodes(started(capture), base, "10.0.0.1", recommended_train(capsys, cfg))


def test_torchrun_form_takes_the_master_from_each_node_when_not_given(capsys, cfg, bin_dir, tmp_path):
    lines = [x for x in emit(capsys, cfg, "torchrun").splitlines() if x and not x.startswith("#")]
    capture = tmp_path / "runs"
    capture.mkdir()
    proc = subprocess.run(
        ["bash", "-c", lines[0]], env=base_env(bin_dir, capture), capture_output=True, text=True
    )
    assert proc.returncode != 0 and "set MASTER_ADDR to the address of node 0" in proc.stderr
    assert not list(capture.iterdir())  # torchrun never started
    base = base_env(bin_dir, capture, MASTER_ADDR="node0.cluster")
    for line in lines:
        subprocess.run(["bash", "-c", line], env=base, check=True)
    runs = started(capture)
    assert {r["env"]["MASTER_ADDR"] for r in runs} == {"node0.cluster"}
    assert all(r["argv"][r["argv"].index("--master_addr") + 1] == "node0.cluster" for r in runs)


def test_slurm_script(capsys, cfg, bin_dir, tmp_path):
    text = emit(capsys, cfg, "slurm", "--job-name", "sft-7b")
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    subprocess.run(["bash", "-n", str(script)], check=True)  # the shell's own syntax check
    assert text.startswith("#!/bin/bash\n")
    directives = {}
    for line in text.splitlines():
        if line.startswith("#SBATCH"):
            key, _, value = line.removeprefix("#SBATCH").strip().partition("=")
            directives[key] = value
    assert directives == {"--job-name": "sft-7b", "--nodes": str(NODES), "--ntasks-per-node": "1",
                          "--gpus-per-node": str(GPUS)}  # fmt: skip
    # sbatch reads #SBATCH only before the first command: every directive comes before it
    first_command = next(i for i, x in enumerate(text.splitlines()) if x and not x.startswith("#"))
    assert all(i < first_command for i, x in enumerate(text.splitlines()) if x.startswith("#SBATCH"))
    capture = tmp_path / "runs"
    capture.mkdir()
    base = base_env(bin_dir, capture, SLURM_JOB_NODELIST="gpu-node-[a-b]", SLURM_JOB_NUM_NODES=str(NODES))
    subprocess.run(["bash", str(script)], env=base, check=True)
    check_nodes(started(capture), base, "gpu-node-a", recommended_train(capsys, cfg))


def test_kubernetes_manifest_passes_the_schemas(capsys, cfg):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    training = pytest.importorskip("kubeflow.training")
    docs = list(yaml.safe_load_all(emit(capsys, cfg, "k8s", "--image", "registry.local/lmstack:0.1")))
    config_map, job = docs
    version = kubernetes_validate.utils.latest_version()
    kubernetes_validate.validate(config_map, version, strict=True)
    assert yaml.safe_load(config_map["data"][cfg.name]) == yaml.safe_load(cfg.read_text())
    # the PyTorchJob v1 API: every field known and of its type (a misspelt or mistyped field would not
    # survive the round trip through the generated models)
    client = training.ApiClient()
    model = client._ApiClient__deserialize(job, "KubeflowOrgV1PyTorchJob")
    assert client.sanitize_for_serialization(model) == job
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    assert job["spec"]["nprocPerNode"] == str(GPUS)
    replicas = job["spec"]["pytorchReplicaSpecs"]
    # the operator's own validation (pytorch_validation.go): Master and Worker only, one Master, each with
    # an image and a container named "pytorch"
    assert set(replicas) == {"Master", "Worker"}
    assert replicas["Master"]["replicas"] == 1 and replicas["Worker"]["replicas"] == NODES - 1
    for spec in replicas.values():
        pod = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": "x"},
            "template": spec["template"],
        }
        kubernetes_validate.validate(pod, version, strict=True)  # the pod template: core v1 schema
        [container] = spec["template"]["spec"]["containers"]
        assert container["name"] == "pytorch" and container["image"] == "registry.local/lmstack:0.1"
        assert container["resources"]["limits"]["nvidia.com/gpu"] == str(GPUS)
        assert container["ports"] == [{"name": "pytorchjob-port", "containerPort": PORT}]


def test_kubernetes_pods_start_torchrun_with_the_operators_rank(capsys, cfg, bin_dir, tmp_path):
    """Each pod as the training operator starts it (envvar.go: MASTER_ADDR the master's service,
    MASTER_PORT its pytorchjob-port, WORLD_SIZE the pod count, RANK: Master 0, Worker i -> i + 1)."""
    _, job = yaml.safe_load_all(emit(capsys, cfg, "k8s", "--image", "img"))
    capture = tmp_path / "runs"
    capture.mkdir()
    base = base_env(bin_dir, capture)
    pods = [("Master", 0, 0)] + [("Worker", i, i + 1) for i in range(NODES - 1)]
    for kind, _, rank in pods:
        [container] = job["spec"]["pytorchReplicaSpecs"][kind]["template"]["spec"]["containers"]
        port = container["ports"][0]["containerPort"]
        operator = {"MASTER_ADDR": "lmstack-master-0", "MASTER_PORT": str(port), "WORLD_SIZE": str(NODES),
                    "RANK": str(rank), "PYTHONUNBUFFERED": "0"}  # fmt: skip
        env = {**base, **{e["name"]: e["value"] for e in container["env"]}, **operator}
        subprocess.run(container["command"], env=env, check=True)
    runs = started(capture)
    for run in runs:  # what the operator set is not the form's: the form set the rest
        for name in ("WORLD_SIZE", "RANK", "PYTHONUNBUFFERED"):
            run["env"].pop(name)
    check_nodes(
        runs, base, "lmstack-master-0", recommended_train(capsys, cfg, f"{K8S_CONFIG_DIR}/{cfg.name}")
    )


def test_k8s_needs_an_image_and_megatron_layouts_are_not_emitted(capsys, cfg):
    assert main(["plan", str(cfg), "--gpus", "8", "--gpu", "h100", "--no-data", "--emit", "k8s"]) == 2
    assert "--emit k8s: give --image" in capsys.readouterr().err
    assert main(["plan", str(cfg), "--gpus", "8", "--gpu", "h100", "--megatron", "--emit", "slurm"]) == 2
    assert "does not run Megatron" in capsys.readouterr().err
    assert main(["plan", str(cfg), "--gpus", "8", "--gpu", "h100", "--image", "img", "--configured"]) == 2
    assert "--configured, --image: only used with --emit" in capsys.readouterr().err
    assert main(["plan", str(cfg), "--gpus", "8", "--gpu", "h100", "--emit", "slurm", "--json"]) == 2
    assert "give one of them" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--image"):
        k8s_objects(LaunchSpec("c.yaml", 1, 1), "c.yaml", "")


def test_configured_layout_and_a_layout_that_does_not_fit(capsys, cfg):
    """--configured emits the YAML as it is (no changes); a configured setup that does not fit is
    refused, as is a plan where nothing fits."""
    assert main(["plan", str(cfg), "--gpus", "8", "--gpu", "h100", "--no-data", "--emit", "torchrun",
                 "--configured", "deepspeed=z3", "gradient_checkpointing=true"]) == 0  # fmt: skip
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("NNODES=")][0]
    assert line.endswith(f"train {cfg.resolve()} deepspeed=z3 gradient_checkpointing=true"), line
    assert main(["plan", str(cfg), "--gpus", "1", "--gpu", "a10g", "--no-data", "--emit", "torchrun",
                 "--configured"]) == 2  # fmt: skip
    assert "the configured setup does not fit" in capsys.readouterr().err
