"""torchrun relaunch decisions and command lines; the FSDP accelerate configs and wrap class."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from lmstack.config.errors import ConfigError
from lmstack.launch import fsdp, torchrun

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    "env,from_cli,gpus,expected",
    [
        ({}, True, 1, False),
        ({}, True, 2, True),  # the CLI on a multi-GPU machine
        ({}, False, 8, False),  # in-process train(None, {...}) never relaunches by itself
        ({"FORCE_TORCHRUN": "1"}, False, 0, True),
        ({"FORCE_TORCHRUN": "true"}, True, 0, True),
        ({"FORCE_TORCHRUN": "0"}, True, 1, False),
        ({"FORCE_TORCHRUN": "1", "LOCAL_RANK": "0"}, True, 8, False),  # already a worker
        ({"WORLD_SIZE": "2"}, True, 2, False),  # accelerate launch / torchrun started us
    ],
)
def test_should_relaunch(env, from_cli, gpus, expected):
    assert torchrun.should_relaunch(from_cli, env=env, gpus=gpus) is expected


def test_single_node_defaults_one_process_per_gpu_and_a_free_port():
    topo = torchrun.topology({}, gpus=4)
    assert (topo.nnodes, topo.node_rank, topo.nproc_per_node, topo.master_addr) == (1, 0, 4, "127.0.0.1")
    assert 0 < topo.master_port < 65536
    assert torchrun.topology({}, gpus=0).nproc_per_node == 1  # CPU: one process unless NPROC_PER_NODE


def test_multi_node_topology_as_seed_003_shows():
    env = {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    topo = torchrun.topology(env, gpus=8)
    cmd = torchrun.torchrun_command("cfg.yaml", ["learning_rate=1e-4"], topo, python="py")
    assert cmd == [
        "py",
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--node_rank",
        "1",
        "--nproc_per_node",
        "8",
        "--master_addr",
        "10.0.0.1",
        "--master_port",
        "29500",
        "-m",
        "lmstack.cli.main",
        "train",
        "cfg.yaml",
        "learning_rate=1e-4",
    ]


def test_multi_node_port_defaults_to_a_fixed_one():
    topo = torchrun.topology({"NNODES": "2", "MASTER_ADDR": "10.0.0.1"}, gpus=8)
    assert topo.master_port == torchrun.DEFAULT_MULTINODE_PORT


@pytest.mark.parametrize(
    "env,gpus,pattern",
    [
        ({"NNODES": "2"}, 8, r"MASTER_ADDR: required when NNODES=2"),
        (
            {"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "h"},
            8,
            r"NODE_RANK: got 2; must be < NNODES \(2\)",
        ),
        ({"NPROC_PER_NODE": "x"}, 0, r"NPROC_PER_NODE: got 'x'; expected an integer"),
        ({"NPROC_PER_NODE": "4"}, 2, r"NPROC_PER_NODE: got 4 but only 2 GPU\(s\) are visible"),
        ({"NPROC_PER_NODE": "0"}, 0, r"NPROC_PER_NODE: got 0; must be >= 1"),
    ],
)
def test_bad_topology_is_explained(env, gpus, pattern):
    with pytest.raises(ConfigError, match=pattern):
        torchrun.topology(env, gpus=gpus)


def test_dict_overrides_round_trip_through_the_child_argv():
    from lmstack.config.load import parse_overrides

    values = {"dataset": "a,b", "learning_rate": 1e-4, "packing": None, "lora_rank": 8, "bf16": True}
    args = torchrun.override_args(values)
    assert all(isinstance(a, str) for a in args)
    assert parse_overrides(args) == values
    assert torchrun.override_args(["x=1"]) == ["x=1"] and torchrun.override_args(None) == []


def test_cli_module_entry_points_exist():
    import subprocess

    for module in ("lmstack.cli", "lmstack.cli.main"):
        out = subprocess.run(
            [sys.executable, "-m", module, "version"], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0 and out.stdout.startswith("lmstack "), (module, out.stderr)


@pytest.mark.parametrize("name", ["fsdp_config.yaml", "fsdp_config_offload.yaml", "fsdp2_config.yaml"])
def test_accelerate_fsdp_configs(name):
    data = fsdp.read_accelerate_config(REPO / "examples/accelerate" / name)
    assert fsdp.config_is_fsdp(data)
    fc = data["fsdp_config"]
    assert fc["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    assert "fsdp_transformer_layer_cls_to_wrap" not in fc  # model-specific: lmstack fills it
    assert data["mixed_precision"] == "bf16"
    if name == "fsdp2_config.yaml":
        assert fc["fsdp_version"] == 2 and fc["fsdp_reshard_after_forward"] is True
    else:
        assert fc["fsdp_sharding_strategy"] == "FULL_SHARD"
        assert fc["fsdp_offload_params"] is ("offload" in name)
        assert fc["fsdp_use_orig_params"] is False  # FSDP1 + LoRA needs it (H200 run)
    text = (REPO / "examples/accelerate" / name).read_text()
    assert "-m lmstack.cli train" in text and "_no_split_modules" in text
    assert yaml.safe_load(text) == data


def test_accelerate_configs_load_in_accelerate():
    """accelerate itself accepts the files (its own config class)."""
    from accelerate.commands.config.config_args import load_config_from_file

    for name in ("fsdp_config.yaml", "fsdp_config_offload.yaml", "fsdp2_config.yaml"):
        loaded = load_config_from_file(str(REPO / "examples/accelerate" / name))
        assert str(loaded.distributed_type).endswith("FSDP")


def test_wrap_class_filled_from_the_model(tiny_model):
    env = {"ACCELERATE_USE_FSDP": "true", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP"}
    note = fsdp.fill_wrap_class(str(tiny_model), env=env)
    assert env["FSDP_TRANSFORMER_CLS_TO_WRAP"] == "Qwen2DecoderLayer"
    assert note and "Qwen2DecoderLayer" in note


def test_wrap_class_given_or_not_fsdp_is_left_alone(tiny_model):
    env = {"ACCELERATE_USE_FSDP": "true", "FSDP_TRANSFORMER_CLS_TO_WRAP": "MyLayer"}
    assert (
        fsdp.fill_wrap_class(str(tiny_model), env=env) is None
        and env["FSDP_TRANSFORMER_CLS_TO_WRAP"] == "MyLayer"
    )
    env = {}
    assert fsdp.fill_wrap_class(str(tiny_model), env=env) is None and env == {}
    env = {"ACCELERATE_USE_FSDP": "true", "FSDP_AUTO_WRAP_POLICY": "SIZE_BASED_WRAP"}
    assert fsdp.fill_wrap_class(str(tiny_model), env=env) is None


@pytest.mark.parametrize(
    "conf,expected",
    [
        ("", torchrun.DEFAULT_RDZV_TIMEOUT),  # torchrun's static rendezvous default
        ("timeout=30", 30),
        ("read_timeout=5, timeout=45", 45),
        ("timeout=soon", torchrun.DEFAULT_RDZV_TIMEOUT),  # torchrun would refuse it; not a number here
    ],
)
def test_rendezvous_timeout_read_as_torchrun_reads_it(conf, expected):
    assert torchrun.rendezvous_timeout({"PET_RDZV_CONF": conf}) == expected


def test_only_a_failed_rendezvous_is_called_one(tmp_path):
    """torchrun's error file (its @record): the agent's rendezvous error is named; a worker's error
    that torchrun copied there is not (the worker's own traceback is printed above)."""
    import json

    def error_file(message: str, stack: str):
        path = tmp_path / "error.json"
        path.write_text(json.dumps({"message": {"message": message, "extraInfo": {"py_callstack": stack}}}))
        return path

    agent = error_file(
        "DistStoreError: Timed out after 6 seconds waiting for clients. 1/2 clients joined.\n",
        'File "static_tcp_rendezvous.py", line 67, in next_rendezvous\n    self._store = TCPStore(',
    )
    assert torchrun._rendezvous_failure(agent) == (
        "DistStoreError: Timed out after 6 seconds waiting for clients. 1/2 clients joined."
    )
    worker = error_file("RuntimeError: injected failure on rank 1", 'File "trainer.py", in training_step')
    assert torchrun._rendezvous_failure(worker) is None
    (tmp_path / "error.json").write_text("not json")
    assert torchrun._rendezvous_failure(tmp_path / "error.json") is None
    assert torchrun._rendezvous_failure(tmp_path / "missing.json") is None
