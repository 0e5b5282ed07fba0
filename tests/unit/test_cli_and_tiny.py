import hashlib
import subprocess
import sys

import pytest

from lmstack.cli.main import build_parser, fields_help, split_train_args
from lmstack.tiny import build_tiny_model

SUBCOMMANDS = ("train", "check", "plan", "export", "chat", "api", "env", "tiny-model", "version")


def test_help_lists_subcommands_and_fields():
    top = subprocess.run([sys.executable, "-m", "lmstack.cli.main", "--help"], capture_output=True, text=True)
    assert top.returncode == 0
    for name in SUBCOMMANDS:
        assert name in top.stdout, name
    train = subprocess.run(
        [sys.executable, "-m", "lmstack.cli.main", "train", "--help"], capture_output=True, text=True
    )
    assert train.returncode == 0
    for line in (
        "model_name_or_path",
        "Local directory or hub id of the base model",
        "lora_target",
        "cutoff_len",
        "(required)",
        "(default 'lora')",
    ):
        assert line in train.stdout, line
    assert fields_help().count("\n    ") > 80  # every field, one line each
    assert build_parser().parse_args(["train", "x.yaml", "lora_rank=16"]).args == ["x.yaml", "lora_rank=16"]


@pytest.mark.parametrize("argv", [["--version"], ["version"]])
def test_version_both_ways(argv):
    from lmstack import __version__

    proc = subprocess.run([sys.executable, "-m", "lmstack.cli.main", *argv], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == f"lmstack {__version__}"


def test_train_takes_lf_flags_after_or_instead_of_a_config_file():
    args = build_parser().parse_args(["train", "--model_name_or_path", "M", "--do_train", "--bf16"])
    assert args.args == ["--model_name_or_path", "M", "--do_train", "--bf16"]
    assert split_train_args(args.args) == (None, ["--model_name_or_path", "M", "--do_train", "--bf16"])
    assert split_train_args(["c.yaml", "--lora_rank", "16", "seed=1"]) == (
        "c.yaml",
        ["--lora_rank", "16", "seed=1"],
    )
    assert split_train_args(["lora_rank=16"]) == (None, ["lora_rank=16"])
    assert split_train_args([]) == (None, [])


def test_train_flags_only_reports_every_problem_without_a_yaml():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "lmstack.cli.main",
            "train",
            "--stage",
            "sft",
            "--use_kt",
            "--lora_rank",
            "true",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    err = proc.stderr[proc.stderr.index("error: ") :]
    assert "use_kt: LLaMA-Factory's `use_kt: true`" in err
    assert "lora_rank: got True; a boolean is not a number" in err
    assert "model_name_or_path: required field is missing" in err and "output_dir: required" in err


def test_cli_error_is_one_line_naming_the_field(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model_name_or_path: m\noutput_dir: o\nfinetuning_type: lroa\n")
    proc = subprocess.run(
        [sys.executable, "-m", "lmstack.cli.main", "train", str(cfg)], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: finetuning_type: got 'lroa'; allowed: lora | oft | freeze | full (did you mean 'lora'?)"
    )
    assert "Traceback" not in proc.stderr


def _digest(path):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def test_tiny_model_is_deterministic(tmp_path):
    a = build_tiny_model(tmp_path / "a", data_dir=None)
    b = build_tiny_model(tmp_path / "b", data_dir=None)
    assert _digest(a) == _digest(b)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(_digest(a))


def test_train_help_says_required_once(capsys):
    from lmstack.cli.main import main as cli_main

    assert cli_main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "(required)" in out and "(required). (required)" not in out


def test_plan_takes_overrides_after_options(monkeypatch):
    from lmstack.cli import main as cli
    from lmstack.cli import plan as plan_cli

    seen = {}
    monkeypatch.setattr(plan_cli, "cmd_plan", lambda args: seen.update(overrides=args.overrides) or 0)
    assert cli.main(["plan", "cfg.yaml", "a=1", "--gpus", "8", "cutoff_len=64"]) == 0
    assert seen["overrides"] == ["a=1", "cutoff_len=64"]
    with pytest.raises(SystemExit):
        cli.main(["plan", "cfg.yaml", "--gpus", "8", "--bogus"])
