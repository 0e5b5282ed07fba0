"""Reliability on the tiny model (CPU): a run killed (SIGKILL) or stopped (SIGTERM) and resumed with
`resume_from_checkpoint: auto` equals a straight run; partial/corrupted checkpoints are never
resumed from; non-finite losses abort or skip; no pickle runs; no secret reaches an output file."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from lmstack.config.errors import ConfigError, DataError, LmstackError
from lmstack.reliability import NonFiniteLoss
from lmstack.reliability.checkpoint import MANIFEST, verify_checkpoint, write_manifest
from lmstack.train.run import train

REPO = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("reliability_driver.py")
CANARY_ENV = "hf_canaryENV0123456789abcdef"
CANARY_YAML = "hf_canaryYAML0123456789abcdef"
CANARY_KEY = "canary-wandb-key-0123456789"


@pytest.fixture
def cfg(base_cfg) -> dict:
    """8 steps over 24 samples (6 steps per epoch: the resume crosses an epoch boundary)."""
    return {
        **base_cfg,
        "max_steps": 8,
        "max_samples": 24,
        "cutoff_len": 64,
        "save_steps": 2,
        "lora_dropout": 0.0,
    }


def log_losses(out: Path) -> list[tuple[int, float]]:
    rows = [json.loads(x) for x in (out / "trainer_log.jsonl").read_text().splitlines()]
    return [(r["current_steps"], r["loss"]) for r in rows if "loss" in r]


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    name = (
        "adapter_model.safetensors" if (out / "adapter_model.safetensors").is_file() else "model.safetensors"
    )
    return load_file(out / name)


def assert_same_run(a: Path, b: Path) -> None:
    assert log_losses(a) == log_losses(b)  # every step, once, same value
    assert [s for s, _ in log_losses(a)] == list(range(1, 9))
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys()
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], rtol=0, atol=1e-6, msg=key)


def write_yaml(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg))
    return path


def env(**extra: str) -> dict:
    out = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **extra}
    out["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), out.get("PYTHONPATH", "")])
    return out


def start(cmd: list[str], flag: Path, hook: str, log: Path, **extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        cmd,
        env=env(LMSTACK_TEST_HOOK=hook, LMSTACK_TEST_FLAG=str(flag), **extra),
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        cwd=REPO,
        start_new_session=True,
    )


def wait_for(flag: Path, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while not flag.is_file():
        if proc.poll() is not None:
            raise AssertionError(f"process exited with {proc.returncode} before the hook point")
        if time.time() > deadline:
            proc.kill()
            raise AssertionError("hook point not reached in time")
        time.sleep(0.1)


def start_killed_run(cfg: dict, tmp_path: Path, hook: str, **extra: str) -> tuple[subprocess.Popen, Path]:
    """Starts the CLI in a subprocess that stops at `hook`; `kill_at_hook` then SIGKILLs it. The
    caller runs its in-process reference run meanwhile (two cores: the two runs overlap)."""
    flag, log = tmp_path / "reached", tmp_path / "killed.log"
    yml = write_yaml(tmp_path / "killed.yaml", cfg)
    return start([sys.executable, str(DRIVER), str(yml)], flag, hook, log, **extra), flag


def kill_at_hook(proc: subprocess.Popen, flag: Path) -> None:
    wait_for(flag, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)


# ---- kill -9 and resume -------------------------------------------------------------------------

DPO = {"stage": "dpo", "dataset": "dpo_en_demo", "learning_rate": 1e-3}


@pytest.mark.parametrize(
    "variant",
    [
        pytest.param({}, id="sft-lora"),
        pytest.param({"finetuning_type": "full", "learning_rate": 1e-3}, id="sft-full"),
        pytest.param({"gradient_accumulation_steps": 2, "per_device_train_batch_size": 2}, id="sft-lora-ga2"),
        pytest.param(DPO, id="dpo-lora"),
    ],
)
def test_sigkill_then_auto_resume_equals_straight_run(cfg, tmp_path, variant):
    cfg = {**cfg, **variant, "save_steps": 4}
    resumed = {**cfg, "output_dir": str(tmp_path / "resumed")}
    proc, flag = start_killed_run(resumed, tmp_path, "block:4")  # blocks in step 5, after checkpoint-4
    straight = {**cfg, "output_dir": str(tmp_path / "straight")}
    train(None, straight)
    kill_at_hook(proc, flag)
    out = Path(resumed["output_dir"])
    assert verify_checkpoint(out / "checkpoint-4") is None
    assert not (out / "checkpoint-8").exists()
    train(None, {**resumed, "resume_from_checkpoint": "auto"})
    assert_same_run(Path(straight["output_dir"]), out)


def flip_byte(path: Path, offset: int = -100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_killed_save_and_corrupted_checkpoint_are_never_resumed(cfg, tmp_path, caplog):
    resumed = {**cfg, "output_dir": str(tmp_path / "resumed")}
    # killed while checkpoint-6 is being saved: its files are in staging, the manifest is not
    proc, flag = start_killed_run(resumed, tmp_path, "save_block:6")
    straight = {**cfg, "output_dir": str(tmp_path / "straight")}
    train(None, straight)
    kill_at_hook(proc, flag)
    out = Path(resumed["output_dir"])
    staging = out / ".checkpoint-6.staging"
    assert (staging / "checkpoint-6" / "adapter_model.safetensors").is_file()
    assert not (staging / "checkpoint-6" / MANIFEST).exists() and not (out / "checkpoint-6").exists()
    # a byte flipped in checkpoint-4 (same size: only the sha256 can tell)
    flip_byte(out / "checkpoint-4" / "optimizer.pt")
    # a folder as a plain Trainer leaves it when killed mid-save: no manifest
    partial = out / "checkpoint-7"
    partial.mkdir()
    shutil.copy(out / "checkpoint-2" / "adapter_model.safetensors", partial)

    caplog.set_level("INFO")
    train(None, {**resumed, "resume_from_checkpoint": "auto", "save_total_limit": 2})
    text = caplog.text
    assert "skipping" in text and "checkpoint-7: no manifest.json" in text
    assert "checkpoint-4: optimizer.pt: sha256 differs" in text
    assert f"auto -> {out / 'checkpoint-2'}" in text
    assert "removed" in text and not staging.exists()
    assert_same_run(Path(straight["output_dir"]), out)
    # save_total_limit: 2 kept the newest complete ones; the manifest-less folder is left alone
    assert sorted(p.name for p in out.glob("checkpoint-*")) == [
        "checkpoint-6",
        "checkpoint-7",
        "checkpoint-8",
    ]
    assert verify_checkpoint(out / "checkpoint-8") is None


def test_explicit_resume_from_incomplete_checkpoint_is_refused(cfg, tmp_path):
    out = tmp_path / "run"
    bad = out / "checkpoint-3"
    bad.mkdir(parents=True)
    (bad / "trainer_state.json").write_text("{}")
    with pytest.raises(
        ConfigError, match=r"resume_from_checkpoint: .*checkpoint-3 is not a complete checkpoint: no manifest"
    ):
        train(None, {**cfg, "output_dir": str(out), "resume_from_checkpoint": str(bad)})


# ---- signals ------------------------------------------------------------------------------------


def scan_for(secrets: list[str], root: Path, extra_text: str = "") -> list[str]:
    hits = [f"log: {s}" for s in secrets if s in extra_text]
    for path in root.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            hits += [f"{path}: {s}" for s in secrets if s.encode() in data]
    return hits


def cli_in_process(monkeypatch, argv: list[str]) -> int:
    """`lmstack ...` in this process (its logging setup and redaction hooks undone afterwards)."""
    import logging
    import warnings

    from lmstack.cli.main import main

    root, factory = logging.getLogger(), logging.getLogRecordFactory()
    handlers, level = root.handlers[:], root.level
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)
    try:
        return main(argv)
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        logging.setLogRecordFactory(factory)


def test_sigterm_saves_exits_143_resume_matches_and_no_secret_leaks(cfg, tmp_path, monkeypatch, capfd):
    secrets = [CANARY_ENV, CANARY_YAML, CANARY_KEY]
    resumed = {**cfg, "output_dir": str(tmp_path / "resumed"), "save_steps": 4, "hf_hub_token": CANARY_YAML}
    flag, log = tmp_path / "reached", tmp_path / "term.log"
    yml = write_yaml(tmp_path / "term.yaml", resumed)
    canary_env = {"HF_TOKEN": CANARY_ENV, "WANDB_API_KEY": CANARY_KEY}
    proc = start([sys.executable, str(DRIVER), str(yml)], flag, "signal_wait:4", log, **canary_env)
    straight = {**cfg, "output_dir": str(tmp_path / "straight"), "save_steps": 4}
    train(None, straight)
    wait_for(flag, proc)
    proc.send_signal(signal.SIGTERM)  # arrives during step 5
    assert proc.wait(timeout=120) == 143
    text = log.read_text()
    out = Path(resumed["output_dir"])
    assert "SIGTERM received" in text and "stopped by SIGTERM after step 5" in text
    assert verify_checkpoint(out / "checkpoint-5") is None and not (out / "checkpoint-6").exists()

    for name, value in canary_env.items():
        monkeypatch.setenv(name, value)
    assert cli_in_process(monkeypatch, ["train", str(yml), "resume_from_checkpoint=auto"]) == 0
    assert_same_run(Path(straight["output_dir"]), out)
    captured = capfd.readouterr()
    assert scan_for(secrets, out, text + captured.out + captured.err) == []
    saved = yaml.safe_load((out / "lmstack_config.yaml").read_text())
    assert saved["hf_hub_token"] == "***"

    # the run manifest: redacted config, versions, data hashes, git commit, hardware
    manifest = json.loads((out / "run_manifest.json").read_text())
    assert manifest["config"]["hf_hub_token"] == "***"
    assert manifest["resumed_from"] == str(out / "checkpoint-5")
    assert len(manifest["previous"]) == 1  # the first start is kept
    assert (
        manifest["versions"]["torch"]
        and manifest["versions"]["transformers"]
        and manifest["versions"]["peft"]
    )
    data_file = str(REPO / "data" / "alpaca_en_demo.json")
    import hashlib

    assert (
        manifest["data_files"][data_file]["sha256"]
        == hashlib.sha256(Path(data_file).read_bytes()).hexdigest()
    )
    commit = manifest["lmstack_git_commit"]
    assert commit is None or len(commit) == 40
    assert manifest["hardware"]["cpu_count"] == os.cpu_count()


def test_error_messages_from_the_cli_are_redacted(tmp_path, base_cfg):
    bad = {**base_cfg, "report_to": CANARY_YAML, "hf_hub_token": CANARY_ENV}
    yml = write_yaml(tmp_path / "bad.yaml", bad)
    done = subprocess.run(
        [sys.executable, "-m", "lmstack.cli.main", "train", str(yml)],
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert done.returncode == 2
    assert "report_to: got '***'" in done.stderr
    assert CANARY_YAML not in done.stderr + done.stdout and CANARY_ENV not in done.stderr + done.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(
    cfg: dict, tmp_path: Path, name: str, hook: str = "", **extra: str
) -> tuple[subprocess.Popen, Path, Path]:
    yml = write_yaml(tmp_path / f"{name}.yaml", cfg)
    flag, log = tmp_path / f"{name}.reached", tmp_path / f"{name}.log"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        str(DRIVER),
        str(yml),
    ]
    return start(cmd, flag, hook, log, OMP_NUM_THREADS="1", **extra), flag, log


def test_sigterm_to_one_of_two_gloo_ranks_stops_both_and_resume_matches(cfg, tmp_path):
    cfg = {**cfg, "save_steps": 4, "per_device_train_batch_size": 2}
    stop = {**cfg, "output_dir": str(tmp_path / "stopped")}
    straight = {**cfg, "output_dir": str(tmp_path / "straight")}
    proc, flag, log = torchrun(stop, tmp_path, "stop", "signal_wait:4", LMSTACK_TEST_RANK="1")
    ref, _, ref_log = torchrun(straight, tmp_path, "straight")
    wait_for(flag, proc)
    os.kill(int(flag.read_text()), signal.SIGTERM)  # rank 1 only
    proc.wait(timeout=120)
    assert ref.wait(timeout=180) == 0, ref_log.read_text()[-3000:]
    text = log.read_text()
    assert "rank1] WARNING SIGTERM received" in text
    assert text.count("stopped by SIGTERM after step 5") == 2, text[-3000:]  # both ranks, same step
    out = Path(stop["output_dir"])
    ckpt = out / "checkpoint-5"
    assert verify_checkpoint(ckpt) is None
    assert (ckpt / "rng_state_0.pth").is_file() and (ckpt / "rng_state_1.pth").is_file()
    again, _, again_log = torchrun({**stop, "resume_from_checkpoint": "auto"}, tmp_path, "again")
    assert again.wait(timeout=180) == 0, again_log.read_text()[-3000:]
    assert_same_run(Path(straight["output_dir"]), out)


# ---- non-finite loss ----------------------------------------------------------------------------


def poison_loss(monkeypatch, bad_calls: set[int]) -> None:
    """The training loss is NaN on the given (1-based) compute_loss calls: one call per step here."""
    from transformers import Trainer

    original = Trainer.compute_loss
    calls = {"n": 0}

    def compute_loss(self, model, inputs, *args, **kwargs):
        out = original(self, model, inputs, *args, **kwargs)
        if model.training:
            calls["n"] += 1
            if calls["n"] in bad_calls:
                out = (out[0] * float("nan"), *out[1:]) if isinstance(out, tuple) else out * float("nan")
        return out

    monkeypatch.setattr(Trainer, "compute_loss", compute_loss)


def test_nonfinite_abort_names_the_step(cfg, tmp_path, monkeypatch):
    poison_loss(monkeypatch, {3})
    run = {**cfg, "save_steps": 1, "max_steps": 5, "output_dir": str(tmp_path / "abort")}
    with pytest.raises(NonFiniteLoss, match=r"step 3: the loss is nan.*on_nonfinite: abort"):
        train(None, run)
    out = Path(run["output_dir"])
    assert verify_checkpoint(out / "checkpoint-2") is None and not (out / "checkpoint-3").exists()


def test_nonfinite_skip_leaves_params_unchanged_and_budget_aborts(cfg, tmp_path, monkeypatch):
    poison_loss(monkeypatch, {3, 5})
    run = {
        **cfg,
        "save_steps": 1,
        "max_steps": 6,
        "on_nonfinite": "skip",
        "nonfinite_skip_budget": 1,
        "output_dir": str(tmp_path / "skip"),
    }
    with pytest.raises(NonFiniteLoss, match=r"step 5: .*nonfinite_skip_budget: 1 is used up"):
        train(None, run)
    out = Path(run["output_dir"])
    w2, w3, w4 = (load_file(out / f"checkpoint-{i}" / "adapter_model.safetensors") for i in (2, 3, 4))
    for key in w2:
        assert torch.equal(w2[key], w3[key]), key  # the NaN step changed nothing
    assert any(not torch.equal(w3[k], w4[k]) for k in w3)  # the next step trains again
    opt2, opt3 = (torch.load(out / f"checkpoint-{i}" / "optimizer.pt", weights_only=True) for i in (2, 3))
    for k, state in opt2["state"].items():
        assert torch.equal(state["exp_avg"], opt3["state"][k]["exp_avg"])
    logged = dict(log_losses(out))
    assert math.isnan(logged[3])  # shown, not filtered
    assert math.isfinite(logged[4]) and math.isfinite(logged[2])
    # the budget survives a resume: checkpoint-4 remembers the skip at step 3
    assert json.loads((out / "checkpoint-4" / MANIFEST).read_text())["nonfinite_skipped_steps"] == [3]
    poison_loss(monkeypatch, {1})
    with pytest.raises(NonFiniteLoss, match=r"step 5: .*already skipped 1 steps \(\[3\]\)"):
        train(None, {**run, "resume_from_checkpoint": "auto"})


# ---- safe loading -------------------------------------------------------------------------------


class Payload:
    """Unpickling this writes a marker file: proof that code ran."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "code ran"))


def test_crafted_pickle_in_a_checkpoint_never_runs(cfg, tmp_path):
    marker = tmp_path / "pwned"
    proof = tmp_path / "proof"
    torch.save({"x": Payload(proof)}, tmp_path / "evil.pt")
    torch.load(tmp_path / "evil.pt", weights_only=False)  # the payload works when unpickled unsafely
    assert proof.is_file()
    torch.save({"state": Payload(marker), "param_groups": []}, tmp_path / "evil.pt")

    run = {**cfg, "max_steps": 2, "save_steps": 1, "output_dir": str(tmp_path / "run")}
    train(None, run)
    out = Path(run["output_dir"])
    for target, what in (("optimizer.pt", "optimizer/scheduler"), ("rng_state.pth", "RNG state")):
        ckpt = out / f"evil-{target}" / "checkpoint-1"
        shutil.copytree(out / "checkpoint-1", ckpt)
        shutil.copy(tmp_path / "evil.pt", ckpt / target)
        again = {**run, "output_dir": str(ckpt.parent), "resume_from_checkpoint": str(ckpt), "max_steps": 3}
        with pytest.raises(ConfigError, match=f"{target}"):  # the manifest catches the swap first
            train(None, again)
        write_manifest(ckpt)  # an attacker who also rewrites the manifest
        with pytest.raises(LmstackError, match=f"the {what} file holds pickled objects.*refused"):
            train(None, again)
        assert not marker.exists()


def test_model_with_auto_map_is_refused_without_trust_remote_code(cfg, tmp_path, tiny_model):
    model = tmp_path / "remote"
    shutil.copytree(tiny_model, model)
    marker = tmp_path / "imported"
    (model / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    config = json.loads((model / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="auto_map.*trust_remote_code: true"):
        train(None, {**cfg, "model_name_or_path": str(model), "output_dir": str(tmp_path / "o")})
    assert not marker.exists()


def test_an_unknown_model_type_without_auto_map_is_refused_before_the_model_loads(cfg, tmp_path, tiny_model):
    model = tmp_path / "unknown"
    shutil.copytree(tiny_model, model)
    config = json.loads((model / "config.json").read_text())
    config["model_type"] = "qwen2x"
    (model / "config.json").write_text(json.dumps(config))
    out = tmp_path / "o"
    with pytest.raises(
        ConfigError,
        match=r"model_type 'qwen2x', which transformers .* does not know \(did you mean 'qwen2'\?\), and no auto_map",
    ):
        train(None, {**cfg, "model_name_or_path": str(model), "output_dir": str(out)})
    assert not out.exists()


def test_a_pickled_adapter_that_is_not_plain_tensors_is_refused_before_the_model_loads(cfg, tmp_path):
    import fractions

    import torch

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    torch.save({"w": torch.zeros(2), "extra": fractions.Fraction(1, 3)}, adapter / "adapter_model.bin")
    out = tmp_path / "o"
    with pytest.raises(ConfigError) as err:
        train(None, {**cfg, "adapter_name_or_path": str(adapter), "output_dir": str(out)})
    message = str(err.value)
    assert f"adapter_name_or_path: {adapter / 'adapter_model.bin'} holds pickled objects" in message
    assert "Weights only load failed" not in message and "safetensors.torch import save_file" in message
    assert not out.exists()


@pytest.mark.parametrize("entry", ["up", "absolute", "link", "prefix"])
def test_dataset_file_name_cannot_escape_dataset_dir(cfg, tmp_path, entry):
    root = tmp_path / "data"
    root.mkdir()
    evil = tmp_path / "data_evil"  # same prefix as dataset_dir: a string check would pass it
    evil.mkdir()
    (evil / "x.json").write_text("[]")
    (root / "link.json").symlink_to(tmp_path / "data_evil" / "x.json")
    (root / "prefix").symlink_to(evil, target_is_directory=True)
    names = {
        "up": "../../etc/passwd",
        "absolute": "/etc/passwd",
        "link": "link.json",
        "prefix": "prefix/x.json",
    }
    (root / "dataset_info.json").write_text(json.dumps({entry: {"file_name": names[entry]}}))
    with pytest.raises(DataError, match=rf"\[{entry}\]: file_name '{names[entry]}'.*(outside|refusing)"):
        train(None, {**cfg, "dataset": entry, "dataset_dir": str(root), "output_dir": str(tmp_path / "o")})


def test_yaml_cannot_construct_python_objects(tmp_path):
    from lmstack.config.load import load_config

    marker = tmp_path / "ran"
    yml = tmp_path / "evil.yaml"
    yml.write_text(f"output_dir: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(yml)
    assert not marker.exists()
