"""`lmstack plan` plans for the target machine, not the one it runs on: what is installed here never
changes the answer (the plan says what to install there); `--gpu NAME` sets the target GPU's memory,
compute capability and interconnect; key=value overrides go anywhere on the line, as for `train`."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import sys

import pytest
import yaml

from lmstack.cli.main import main

LLAMA2_70B = dict(vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                  num_attention_heads=64, num_key_value_heads=8)  # fmt: skip
HIDEABLE = ("deepspeed", "bitsandbytes", "torchao")


@pytest.fixture
def llama70b(tmp_path):
    d = tmp_path / "llama-2-70b"
    d.mkdir()
    (d / "config.json").write_text(
        json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"], **LLAMA2_70B})
    )
    return str(d)


def write_cfg(tmp_path, **fields) -> str:
    flat = {**dict(stage="sft", template="llama2", dataset="alpaca_en_demo", cutoff_len=2048, packing=True,
                   output_dir=str(tmp_path / "out"), per_device_train_batch_size=1, gradient_accumulation_steps=8,
                   bf16=True), **fields}  # fmt: skip
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(flat))
    return str(path)


class _Refuse:
    """A meta-path finder that makes `import NAME` fail for the hidden packages, as on a machine
    without them."""

    def __init__(self, names):
        self.names = set(names)

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return None


def machine(monkeypatch, installed: set[str]):
    """This machine has exactly `installed` of HIDEABLE: find_spec finds them (or not) and an import of a
    missing one fails."""
    real = importlib.util.find_spec

    def find_spec(name, package=None):
        top = name.split(".")[0]
        if top in HIDEABLE:
            return importlib.machinery.ModuleSpec(name, None) if top in installed else None
        return real(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    hidden = set(HIDEABLE) - installed
    for name in list(sys.modules):
        if name.split(".")[0] in hidden:
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_Refuse(hidden), *sys.meta_path])


def plan_json(capsys, *argv) -> dict:
    capsys.readouterr()
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_70b_full_on_8x80gb_answers_the_same_without_deepspeed(llama70b, tmp_path, monkeypatch, capsys):
    cfg = write_cfg(tmp_path, model_name_or_path=llama70b, finetuning_type="full")
    argv = (cfg, "--gpus", "8", "--gpu-memory", "80", "--no-data")
    with monkeypatch.context() as m:
        machine(m, installed=set())
        with pytest.raises(ImportError):
            __import__("deepspeed")
        without = plan_json(capsys, *argv)
    with monkeypatch.context() as m:
        machine(m, installed=set(HIDEABLE))
        present = plan_json(capsys, *argv)
    for got in (without, present):
        got.pop("run_plan")  # the same but for the hostname of the snapshot
    assert without == present
    rec = without["recommendation"]
    assert rec is not None and rec["fits"], without["notes"]
    assert rec["yaml_changes"]["deepspeed"].startswith("z3")  # ZeRO-3 (offload) on 8 x 80 GB
    assert not any(c["why_not"].startswith("unsupported here") for c in without["candidates"])
    assert without["target_installs"]["recommended"] == ["deepspeed"]
    assert without["target_installs"]["configured"] == []  # plain DDP needs nothing extra


def test_qlora_and_fp8_rows_are_planned_without_bitsandbytes_or_torchao(
    llama70b, tmp_path, monkeypatch, capsys
):
    """70B LoRA on one 80 GB GPU is QLoRA (bitsandbytes on the target); FP8 rows on an H100 (torchao)."""
    machine(monkeypatch, installed=set())
    cfg = write_cfg(tmp_path, model_name_or_path=llama70b, finetuning_type="lora", lora_target="all")
    got = plan_json(capsys, cfg, "--gpus", "1", "--gpu", "h100", "--no-data", "--cpu-memory", "128")
    assert got["recommendation"]["yaml_changes"]["quantization_bit"] == 4
    assert "bitsandbytes" in got["target_installs"]["recommended"]
    full = plan_json(capsys, write_cfg(tmp_path, model_name_or_path=llama70b, finetuning_type="full"),
                     "--gpus", "8", "--nodes", "4", "--gpu", "h100", "--no-data")  # fmt: skip
    fp8_full = [c for c in full["candidates"] if c["fp8"] == "float8-training"]
    assert fp8_full and not any(c["why_not"].startswith("unsupported") for c in fp8_full)


@pytest.mark.parametrize(
    ("gpu", "gib", "fp8_rows", "header"),
    [
        ("h200", 139.8, True, "sm90 (NVIDIA H200 (SXM)), nvlink"),
        ("H100", 79.1, True, "sm90 (NVIDIA H100 80GB (SXM)), nvlink"),
        ("l40s", 44.3, True, "sm89 (NVIDIA L40S), pcie"),
        ("a100", 79.1, False, "sm80 (NVIDIA A100 80GB (SXM)), nvlink"),
        ("a10g", 22.0, False, "sm86 (NVIDIA A10G), pcie"),
    ],
)
def test_gpu_sets_memory_capability_and_interconnect(qwen, tmp_path, capsys, gpu, gib, fp8_rows, header):
    cfg = write_cfg(tmp_path, model_name_or_path=qwen("0.5b"), finetuning_type="full", template="qwen")
    got = plan_json(capsys, cfg, "--gpus", "2", "--gpu", gpu, "--no-data")
    assert any(c["fp8"] for c in got["candidates"]) == fp8_rows
    assert all(c["per_gpu_gib"]["total"] <= gib * 0.92 for c in got["candidates"] if c["fits"])
    main(["plan", cfg, "--gpus", "2", "--gpu", gpu, "--no-data"])
    first = capsys.readouterr().out.splitlines()[0]
    assert f"2 GPU(s) x {gib:g} GiB, {header}" in first, first


def test_gpu_memory_and_capability_flags_win_over_the_table(qwen, tmp_path, capsys):
    cfg = write_cfg(tmp_path, model_name_or_path=qwen("0.5b"), finetuning_type="full", template="qwen")
    main(
        [
            "plan",
            cfg,
            "--gpus",
            "1",
            "--gpu",
            "a100",
            "--gpu-memory",
            "70",
            "--gpu-capability",
            "9.0",
            "--no-data",
        ]
    )
    first = capsys.readouterr().out.splitlines()[0]
    assert "1 GPU(s) x 70 GiB, sm90 (given by --gpu-capability), nvlink" in first, first


def test_unknown_gpu_is_refused_naming_the_known_ones(qwen, tmp_path, capsys):
    cfg = write_cfg(tmp_path, model_name_or_path=qwen("0.5b"), template="qwen")
    assert main(["plan", cfg, "--gpu", "h300", "--gpus", "1", "--no-data"]) == 2
    err = capsys.readouterr().err
    assert "--gpu: unknown GPU 'h300'; known: b200, h200, h100" in err and "--gpu-capability" in err


def test_tensor_parallel_is_refused_on_pcie_gpus(llama70b, tmp_path, capsys):
    cfg = write_cfg(tmp_path, model_name_or_path=llama70b, finetuning_type="full")
    capsys.readouterr()
    main(["plan", cfg, "--gpus", "8", "--gpu", "l40s", "--megatron", "--json", "--no-data"])
    pcie = json.loads(capsys.readouterr().out)
    assert all(not x["valid"] and "PCIe only" in x["reason"] for x in pcie if x["tp"] > 1)
    assert any(x["valid"] for x in pcie if x["tp"] == 1)
    main(["plan", cfg, "--gpus", "8", "--gpu", "h100", "--megatron", "--json", "--no-data"])
    nvlink = json.loads(capsys.readouterr().out)
    assert any(x["valid"] for x in nvlink if x["tp"] > 1)


@pytest.mark.parametrize(
    "order",
    [
        ["CFG", "--gpus", "2", "finetuning_type=lora", "lora_rank=32"],
        ["finetuning_type=lora", "CFG", "--gpus", "2", "lora_rank=32"],
        ["--gpus", "2", "lora_rank=32", "CFG", "finetuning_type=lora"],
        ["CFG", "lora_rank=32", "--gpus", "2", "--no-data", "finetuning_type=lora"],
    ],
)
def test_overrides_anywhere_on_the_line(qwen, tmp_path, capsys, order):
    cfg = write_cfg(tmp_path, model_name_or_path=qwen("0.5b"), finetuning_type="full", template="qwen")
    argv = [cfg if x == "CFG" else x for x in order]
    got = plan_json(capsys, *argv, "--gpu-memory", "80", *([] if "--no-data" in argv else ["--no-data"]))
    assert got["configured"]["finetuning_type"] == "lora"
    assert got["configured"]["per_gpu_gib"]["optimizer"] == 0.0  # the base is frozen: only the adapters train
    ref = plan_json(capsys, cfg, "--gpus", "2", "--gpu-memory", "80", "--no-data", "finetuning_type=lora")
    assert (
        got["configured"]["per_gpu_gib"]["adapters"] > ref["configured"]["per_gpu_gib"]["adapters"]
    )  # rank 32 > 8


def test_two_config_files_are_refused(qwen, tmp_path, capsys):
    cfg = write_cfg(tmp_path, model_name_or_path=qwen("0.5b"), template="qwen")
    with pytest.raises(SystemExit):
        main(["plan", cfg, cfg, "--gpus", "1"])
    assert "one config file and key=value overrides" in capsys.readouterr().err
