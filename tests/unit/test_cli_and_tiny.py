import hashlib
import subprocess
import sys

from lmstack.cli.main import build_parser, fields_help
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
    assert build_parser().parse_args(["train", "x.yaml", "lora_rank=16"]).overrides == ["lora_rank=16"]


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
