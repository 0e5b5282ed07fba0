"""The web UI's parts that need no browser: the form generated from the schema and its YAML round trip,
the run keeper and registry, progress read from trainer_log.jsonl, and `lmstack webui`'s checks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from pydantic import Field

from lmstack.config import schema
from lmstack.config.errors import ConfigError
from lmstack.config.load import build_config
from lmstack.webui import fields
from lmstack.webui.fields import UNSET, field_specs, flat_to_form, form_to_flat, to_value, to_widget
from lmstack.webui.runs import RunRegistry, read_trainer_log, tokens_per_second

LF_YAML = """\
model_name_or_path: Qwen/Qwen2.5-0.5B
trust_remote_code: true
stage: sft
do_train: true
finetuning_type: lora
lora_rank: 8
lora_target: all
dataset: identity,alpaca_en_demo
template: qwen
cutoff_len: 2048
max_samples: 1000
overwrite_cache: true
preprocessing_num_workers: 16
output_dir: saves/qwen/lora/sft
logging_steps: 10
save_steps: 500
plot_loss: true
overwrite_output_dir: true
report_to: none
per_device_train_batch_size: 1
gradient_accumulation_steps: 8
learning_rate: 1.0e-4
num_train_epochs: 3.0
lr_scheduler_type: cosine
warmup_ratio: 0.1
bf16: true
ddp_timeout: 180000000
resume_from_checkpoint: null
save_strategy: no
packing: false
quantization_bit: 4
fsdp_config: {version: 2}
interleave_probs: 0.7,0.3
hf_hub_token: hf_secret_value_for_the_test
"""


def defaults() -> list:
    return [to_widget(s, s.default) for s in field_specs()]


def test_every_schema_field_is_a_form_field_with_its_kind_and_choices():
    specs = {s.name: s for s in field_specs()}
    assert set(specs) == {n for cls in schema.SECTIONS.values() for n in cls.model_fields}
    assert specs["stage"].kind == "choice" and specs["stage"].choices[:2] == ("pt", "sft")
    assert specs["gradient_checkpointing"].choices == (True, False, "auto")
    assert specs["quantization_bit"].choices == (4, 8, None) and specs["quantization_bit"].nullable
    assert specs["per_device_train_batch_size"].kind == "yaml"  # int | auto
    assert specs["hf_hub_token"].kind == "secret" and specs["dataset"].kind == "datasets"
    assert specs["learning_rate"].kind == "float" and specs["learning_rate"].default == 5e-5
    assert specs["model_name_or_path"].required and "required" in specs["model_name_or_path"].description


def test_a_field_added_to_the_schema_appears_in_the_form(monkeypatch):
    class Data(schema.DataArgs):
        new_knob: int = Field(3, description="A knob added later.")

    monkeypatch.setitem(fields.SECTIONS, "data", Data)
    spec = next(s for s in field_specs() if s.name == "new_knob")
    assert (spec.section, spec.kind, spec.default, spec.description) == (
        "data",
        "int",
        3,
        "A knob added later.",
    )


def test_an_untouched_form_writes_only_what_the_user_set():
    assert form_to_flat(field_specs(), defaults()) == {}  # required fields left empty are not written
    raw = defaults()
    names = [s.name for s in field_specs()]
    raw[names.index("lora_rank")] = 16
    raw[names.index("learning_rate")] = "1e-4"
    raw[names.index("dataset")] = ["identity", "alpaca_en_demo"]
    raw[names.index("save_strategy")] = "no"
    flat = form_to_flat(field_specs(), raw)
    assert flat == {
        "dataset": "identity,alpaca_en_demo",
        "lora_rank": 16,
        "learning_rate": 1e-4,
        "save_strategy": "no",
    }


def test_lf_yaml_round_trips_through_the_form_equal_in_meaning_and_order():
    original = yaml.safe_load(LF_YAML)
    values, keep = flat_to_form(field_specs(), original)
    names = [s.name for s in field_specs()]
    assert values[names.index("save_strategy")] == "no"  # YAML's `no` (a bool) shown as the word
    assert values[names.index("learning_rate")] == "0.0001" and values[names.index("template")] == "qwen"
    again = yaml.safe_load(fields.to_yaml(form_to_flat(field_specs(), values, keep)))
    assert build_config(original) == build_config(again)
    assert list(again) == list(original)  # every key the file set, in its order, and nothing else


def test_widget_values_that_cannot_be_a_field_value_name_the_field():
    specs = {s.name: s for s in field_specs()}
    with pytest.raises(ConfigError, match="max_steps: got '1.5'; expected a whole number"):
        to_value(specs["max_steps"], "1.5")
    with pytest.raises(ConfigError, match="learning_rate: got 'fast'; expected a number"):
        to_value(specs["learning_rate"], "fast")
    with pytest.raises(ConfigError, match=r"stage: got 'sf'; allowed: pt \| sft"):
        to_value(specs["stage"], "sf")
    assert to_value(specs["template"], UNSET) is None and to_value(specs["max_samples"], "") is None
    assert to_value(specs["per_device_train_batch_size"], "auto") == "auto"


def test_unknown_fields_in_a_loaded_yaml_are_refused_with_trains_error():
    with pytest.raises(ConfigError, match="lora_rnk: unknown field.*lora_rank"):
        flat_to_form(field_specs(), {**yaml.safe_load(LF_YAML), "lora_rnk": 4})


def test_keeper_forwards_sigterm_once_and_records_the_exit_code(tmp_path):
    script = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))\n"
        "open(sys.argv[1], 'w').write('up')\n"
        "time.sleep(60)\n"
    )
    flag = tmp_path / "up"
    keeper = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "lmstack.webui.child",
            str(tmp_path),
            "--",
            sys.executable,
            "-c",
            script,
            str(flag),
        ]
    )
    deadline = time.time() + 30
    while not flag.exists() and time.time() < deadline:
        time.sleep(0.05)
    keeper.send_signal(signal.SIGTERM)
    assert keeper.wait(timeout=30) == 143
    assert (tmp_path / "exit_code").read_text() == "143"
    child = int((tmp_path / "child.pid").read_text())
    assert child != keeper.pid


def test_registry_tells_finished_stopped_and_lost_runs_apart(tmp_path):
    registry = RunRegistry(tmp_path / "share")
    for name, code in (("done", "0"), ("stopped", "143"), ("broken", "2"), ("lost", None)):
        run = registry.run_dir(str(tmp_path / name))
        run.mkdir(parents=True)
        meta = {
            "output_dir": str(tmp_path / name),
            "started": time.time(),
            "pid": 2**22 + 17,
            "pid_start": "1",
        }
        (run / "run.json").write_text(json.dumps(meta))
        if code is not None:
            (run / "exit_code").write_text(code)
    states = {Path(r["output_dir"]).name: r["state"] for r in registry.list_runs()}
    assert states == {"done": "finished", "stopped": "stopped", "broken": "failed", "lost": "lost"}
    assert registry.state(str(tmp_path / "never")) == ("none", None)
    assert not registry.stop(str(tmp_path / "stopped"))


def test_progress_from_trainer_log_survives_a_partial_line_and_a_resume(tmp_path):
    records = [
        {"current_steps": 1, "total_steps": 10, "loss": 3.0, "elapsed_time": "0:00:01", "total_tokens": 100},
        {"current_steps": 2, "total_steps": 10, "loss": 2.5, "elapsed_time": "0:00:03", "total_tokens": 300},
        # resumed: elapsed restarts, tokens keep counting from the checkpoint
        {"current_steps": 3, "total_steps": 10, "loss": 2.0, "elapsed_time": "0:00:01", "total_tokens": 400},
        {"current_steps": 4, "total_steps": 10, "loss": 1.5, "elapsed_time": "0:00:05", "total_tokens": 1200},
    ]
    text = "".join(json.dumps(r) + "\n" for r in records) + '{"current_steps": 5, "los'
    (tmp_path / "trainer_log.jsonl").write_text(text)
    got = read_trainer_log(tmp_path)
    assert [r["current_steps"] for r in got] == [1, 2, 3, 4]
    assert tokens_per_second(got) == 200.0  # (1200 - 400) tokens in 4 s of the latest start
    view = RunRegistry(tmp_path / "share").view(str(tmp_path))
    assert (view.state, view.step, view.total, view.loss[-1]) == ("none", 4, 10, (4, 1.5))


def test_webui_refuses_an_open_address_without_a_login_and_names_the_extra(monkeypatch, tmp_path):
    from lmstack.cli import webui
    from lmstack.cli.main import build_parser

    args = build_parser().parse_args(["webui", "--host", "0.0.0.0"])
    with pytest.raises(ConfigError, match="--host 0.0.0.0: not a loopback address.*--auth user:password"):
        args.func(args)
    users = tmp_path / "users"
    users.write_text("# logins\n\nalice:pa:ss\n")
    assert webui.parse_auth(None, str(users)) == [("alice", "pa:ss")]
    with pytest.raises(ConfigError, match="--auth: the password of 'alice' has 5 characters; on 0.0.0.0"):
        webui.check_bind("0.0.0.0", [("alice", "pa:ss")])
    webui.check_bind("0.0.0.0", [("alice", "pa:ss-long-enough")])
    webui.check_bind("127.0.0.2", [])
    webui.check_bind("127.0.0.1", [("alice", "short")])  # loopback: any login
    users.write_text("alice\n")
    with pytest.raises(ConfigError, match="line 1: expected user:password"):
        webui.parse_auth(None, str(users))
    monkeypatch.setitem(sys.modules, "gradio", None)  # as if the extra were not installed
    args = build_parser().parse_args(["webui"])
    with pytest.raises(
        ConfigError, match=r"needs Gradio, which is not installed: pip install 'lmstack\[webui\]'"
    ):
        args.func(args)


def test_load_and_save_yaml_are_confined_to_the_working_and_allowed_folders(tmp_path):
    """Load/Save YAML refuse paths outside the cwd-at-launch and --allow-dir folders (symlinks and `..`
    resolved), and a file that is not YAML is named, never echoed."""
    from types import SimpleNamespace

    from lmstack.webui import train_tab
    from lmstack.webui.paths import roots

    work, extra, outside = tmp_path / "work", tmp_path / "extra", tmp_path / "outside"
    for d in (work, extra, outside):
        d.mkdir()
    secret = outside / "shadow"
    secret.write_text("root:$6$SECRETHASH:19000:0:99999:7:::\n")
    (work / "link.yaml").symlink_to(secret)
    (work / "notyaml.yaml").write_text("key: [unclosed SECRET_LINE\n")
    specs = field_specs()
    ui = SimpleNamespace(
        specs=specs,
        allowed=roots([str(extra)], cwd=str(work)),
        flat=lambda keep, raw: form_to_flat(specs, list(raw), keep or []),
    )
    load = train_tab._load(ui)
    for path in (
        str(secret),
        str(work / ".." / "outside" / "shadow"),
        str(work / "link.yaml"),
        "/etc/passwd",
    ):
        out = load("English", path)
        assert "outside the folders" in out[0] and "SECRET" not in out[0] and "root:" not in out[0], out[0]
    out = load("English", str(work / "notyaml.yaml"))
    assert "not a YAML mapping" in out[0] and "SECRET_LINE" not in out[0], out[0]
    (extra / "ok.yaml").write_text("model_name_or_path: m\noutput_dir: o\nlora_rank: 8\n")
    assert "fields set" in load("English", str(extra / "ok.yaml"))[0]

    save = train_tab._save(ui)
    raw = [to_widget(s, s.default) for s in ui.specs]
    names = [s.name for s in ui.specs]
    raw[names.index("model_name_or_path")], raw[names.index("output_dir")] = "m", "o"
    for path in (str(outside / "x.yaml"), str(work / ".." / "outside" / "y.yaml")):
        assert "outside the folders" in save("English", path, [], *raw)[0]
    assert not list(outside.glob("*.yaml"))
    assert "Saved" in save("English", "sub/z.yaml", [], *raw)[0] and (work / "sub" / "z.yaml").is_file()

    # a YAML that holds a token is readable by its owner only; others keep the umask's mode
    old = os.umask(0o022)
    try:
        assert "Saved" in save("English", "plain.yaml", [], *raw)[0]
        raw[names.index("hf_hub_token")] = "hf_" + "a" * 30
        (work / "token.yaml").write_text("old\n")
        (work / "token.yaml").chmod(0o644)  # an existing file is narrowed too
        assert "Saved" in save("English", "token.yaml", [], *raw)[0]
    finally:
        os.umask(old)
    assert (work / "plain.yaml").stat().st_mode & 0o777 == 0o644
    assert (work / "token.yaml").stat().st_mode & 0o777 == 0o600
    assert "hf_hub_token" in (work / "token.yaml").read_text()


def test_secrets_write_text_is_private_exactly_when_asked(tmp_path):
    from lmstack.config.secrets import holds_secret, write_text

    assert holds_secret({"hf_hub_token": "x" * 8}) and holds_secret({"default_system": "hf_" + "b" * 20})
    assert not holds_secret({"hf_hub_token": None, "default_system": "be brief", "lora_rank": 8})
    old = os.umask(0o022)
    try:
        write_text(tmp_path / "a", "x", private=True)
        write_text(tmp_path / "b", "x", private=False)
    finally:
        os.umask(old)
    assert [(tmp_path / n).stat().st_mode & 0o777 for n in "ab"] == [0o600, 0o644]


def _finished_run(registry: RunRegistry, output_dir: Path, log: str, code: str | None = "0") -> None:
    run = registry.run_dir(str(output_dir))
    run.mkdir(parents=True)
    meta = {"output_dir": str(output_dir), "started": 0, "pid": 2**22 + 17, "pid_start": "1"}
    (run / "run.json").write_text(json.dumps(meta))
    (run / "train.log").write_text(log)
    if code is not None:
        (run / "exit_code").write_text(code)


def test_the_log_tail_shows_each_progress_bars_last_frame_without_escape_codes(tmp_path):
    registry = RunRegistry(tmp_path / "share")
    bars = "\r  0%|          | 0/3\r 33%|###       | 1/3\r100%|##########| 3/3\n"
    _finished_run(registry, tmp_path / "out", f"start\n{bars}\x1b[A\x1b[2Kdone \x1b[32mok\x1b[0m\n")
    shown = registry.view(str(tmp_path / "out")).log_tail
    assert shown == "start\n100%|##########| 3/3\ndone ok"


def test_stop_is_offered_only_while_the_run_is_running(tmp_path):
    from types import SimpleNamespace

    from lmstack.webui.runs_tab import _refresh

    registry = RunRegistry(tmp_path / "share")
    _finished_run(registry, tmp_path / "done", "finished\n")
    refresh = _refresh(SimpleNamespace(registry=registry))
    assert refresh("English", str(tmp_path / "done"))[3]["interactive"] is False
    assert refresh("English", None)[3]["interactive"] is False
    keeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # a live pid
    try:
        from lmstack.webui.runs import process_start

        _finished_run(registry, tmp_path / "live", "step 1\n", code=None)
        meta_path = registry.run_dir(str(tmp_path / "live")) / "run.json"
        meta = {
            **json.loads(meta_path.read_text()),
            "pid": keeper.pid,
            "pid_start": process_start(keeper.pid),
        }
        meta_path.write_text(json.dumps(meta))
        assert refresh("English", str(tmp_path / "live"))[3]["interactive"] is True
    finally:
        keeper.kill()
        keeper.wait()


def test_saving_over_a_yaml_keeps_its_comments_and_order():
    from lmstack.webui.fields import to_yaml

    previous = (
        "### model\n"
        "model_name_or_path: m  # the base\n"
        "\n"
        "### train\n"
        "learning_rate: 1.0e-4\n"
        "lora_target:\n"
        "- q_proj\n"
        "- v_proj\n"
        "report_to: none\n"
    )
    flat = {"model_name_or_path": "m", "learning_rate": 5.0e-5, "lora_target": "all", "output_dir": "o"}
    text = to_yaml(flat, previous)
    assert yaml.safe_load(text) == flat  # removed keys gone, new ones added, values as the form has them
    assert text.splitlines()[:5] == [
        "### model",
        "model_name_or_path: m",
        "",
        "### train",
        "learning_rate: 5.0e-05",
    ]
    assert text.splitlines()[5:] == ["lora_target: all", "output_dir: o"]
    assert to_yaml(flat) == yaml.safe_dump(flat, sort_keys=False)  # a new file: plain YAML
