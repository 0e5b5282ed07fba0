"""report_to trackers, each offline, through a real tiny `lmstack train` (one subprocess per run: the
trackers read their environment at import). Each run's own files hold the logged losses (equal to
trainer_log.jsonl's), the resolved config as `lmstack/<field>` parameters, and never the config's
secret. A tracker whose package cannot be imported is refused before the model loads, naming the extra."""

from __future__ import annotations

import glob
import json
import os
import sqlite3
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "data"
SECRET = "hf_trackerCANARY0123456789abcdef"  # hf_hub_token in the YAML: must never reach a tracker


def run_train(tmp_path: Path, tiny_model: Path, report_to: str, extra_env: dict | None = None, **fields):
    out = tmp_path / "out"
    cfg = {
        "model_name_or_path": str(tiny_model),
        "template": "qwen",
        "stage": "sft",
        "finetuning_type": "lora",
        "lora_target": "all",
        "dataset": "alpaca_en_demo",
        "dataset_dir": str(DATA),
        "cutoff_len": 64,
        "max_samples": 24,
        "output_dir": str(out),
        "per_device_train_batch_size": 4,
        "learning_rate": 1e-2,
        "max_steps": 3,
        "logging_steps": 1,
        "save_steps": 100,
        "report_to": report_to,
        "run_name": "tiny-tracked",
        "hf_hub_token": SECRET,
        "disable_tqdm": True,
        **fields,
    }
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **(extra_env or {})}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-m", "lmstack.cli.main", "train", str(path)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return done, out


def trainer_losses(out: Path) -> list[float]:
    rows = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def assert_no_secret(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path


def test_tensorboard_writes_to_logging_dir_with_loss_and_params(tmp_path, tiny_model):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logs = tmp_path / "tb_logs"
    done, out = run_train(tmp_path, tiny_model, "tensorboard", logging_dir=str(logs))
    assert done.returncode == 0, done.stderr[-3000:]
    events = list(logs.glob("events.out.tfevents.*"))
    assert len(events) == 1 and not list(
        out.rglob("events.out.tfevents.*")
    )  # logging_dir, not output_dir/runs
    acc = EventAccumulator(str(events[0]), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    assert [e.value for e in acc.Scalars("train/loss")] == pytest.approx(trainer_losses(out), rel=1e-4)
    text = acc.Tensors("lmstack_config/text_summary")[0].tensor_proto.string_val[0].decode()
    params = yaml.safe_load(text.strip("`\n"))
    assert params["lmstack/learning_rate"] == 0.01 and params["lmstack/logging_dir"] == str(logs)
    assert params["lmstack/hf_hub_token"] == "***"
    assert_no_secret(logs)


def _wandb_records(path: Path):
    """Records of a .wandb file (LevelDB log format: 32 KiB blocks, 7-byte record headers)."""
    from wandb.proto import wandb_internal_pb2

    raw, pos, pending = path.read_bytes(), 7, b""  # 7: the ':W&B' file header
    while pos + 7 <= len(raw):
        if 32768 - pos % 32768 < 7:  # block trailer
            pos += 32768 - pos % 32768
            continue
        _crc, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        data, pos = raw[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # FULL / LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending + data)
            pending = b""
            yield record
        elif kind in (2, 3):  # FIRST / MIDDLE
            pending += data


def test_wandb_offline_run_in_output_dir(tmp_path, tiny_model):
    pytest.importorskip("wandb")
    env = {"WANDB_MODE": "offline", "WANDB_PROJECT": "lmstack-test"}
    env = {**env, "WANDB_DIR": ""} if "WANDB_DIR" in os.environ else env
    done, out = run_train(tmp_path, tiny_model, "wandb", extra_env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 1, list((out).iterdir())  # under output_dir, not the current folder
    assert not (tmp_path / "wandb").exists()
    config, losses, run = {}, [], None
    for record in _wandb_records(Path(runs[0])):
        kind = record.WhichOneof("record_type")
        if kind == "config":
            config.update({i.key: json.loads(i.value_json) for i in record.config.update})
        elif kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            if "train/loss" in items:
                losses.append(items["train/loss"])
        elif kind == "run":
            run = record.run
    assert run.project == "lmstack-test" and run.display_name == "tiny-tracked"
    assert losses == pytest.approx(trainer_losses(out), rel=1e-5)
    assert config["lmstack/learning_rate"] == 0.01 and config["lmstack/stage"] == "sft"
    assert config["lmstack/hf_hub_token"] == "***"
    assert_no_secret(out / "wandb")


def test_mlflow_local_file_store(tmp_path, tiny_model):
    pytest.importorskip("mlflow")
    store = tmp_path / "mlruns"
    env = {"MLFLOW_TRACKING_URI": store.as_uri(), "MLFLOW_ALLOW_FILE_STORE": "true"}
    done, out = run_train(tmp_path, tiny_model, "mlflow", extra_env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = [p for p in store.glob("*/*") if (p / "params").is_dir()]
    assert len(runs) == 1
    run = runs[0]
    logged = [float(line.split()[1]) for line in (run / "metrics" / "loss").read_text().splitlines()]
    assert logged == pytest.approx(trainer_losses(out), rel=1e-6)
    assert (run / "params" / "lmstack" / "learning_rate").read_text() == "0.01"
    assert (run / "params" / "lmstack" / "hf_hub_token").read_text() == "***"
    assert (run / "params" / "learning_rate").read_text() == "0.01"  # the Trainer's own arguments too
    assert_no_secret(store)


def test_mlflow_store_that_cannot_open_is_refused_before_the_model_loads(tmp_path, tiny_model):
    pytest.importorskip("mlflow")
    env = {"MLFLOW_TRACKING_URI": (tmp_path / "mlruns").as_uri(), "MLFLOW_ALLOW_FILE_STORE": "false"}
    done, out = run_train(tmp_path, tiny_model, "mlflow", extra_env=env)
    assert done.returncode == 2, done.stderr[-3000:]
    assert (
        "report_to: mlflow: the tracking store" in done.stderr
        and "MLFLOW_ALLOW_FILE_STORE=true" in done.stderr
    )
    assert "Traceback" not in done.stderr and not out.exists()


def test_trackio_local_database(tmp_path, tiny_model):
    pytest.importorskip("trackio")
    done, out = run_train(
        tmp_path, tiny_model, "trackio", {"TRACKIO_DIR": str(tmp_path / "trackio")}, project="lm"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    db = sqlite3.connect(tmp_path / "trackio" / "lm.db")  # `project` names the database
    rows = db.execute("select step, metrics from metrics order by step").fetchall()
    losses = [json.loads(m)["train/loss"] for _, m in rows if "train/loss" in json.loads(m)]
    assert losses == pytest.approx(trainer_losses(out), rel=1e-6)
    (config,) = [json.loads(c) for (c,) in db.execute("select config from configs")]
    assert config["lmstack/learning_rate"] == 0.01 and config["lmstack/hf_hub_token"] == "***"
    assert_no_secret(tmp_path / "trackio")


def _swanlab_scalars(run_file: Path) -> dict[str, list[float]]:
    from google.protobuf.json_format import MessageToDict
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    reader = DataStoreReader()
    reader.open(run_file)
    scalars: dict[str, list[float]] = {}
    for data in reader:
        record = Record()
        record.ParseFromString(data)
        scalar = MessageToDict(record).get("scalar")
        if scalar:
            scalars.setdefault(scalar["key"], []).append(scalar["value"]["number"])
    reader.close()
    return scalars


@pytest.mark.parametrize("how", ["report_to", "use_swanlab"])
def test_swanlab_offline_run_in_output_dir(tmp_path, tiny_model, how):
    pytest.importorskip("swanlab")
    if how == "report_to":
        done, out = run_train(tmp_path, tiny_model, "swanlab", {"SWANLAB_MODE": "offline"})
    else:  # LF's fields
        done, out = run_train(tmp_path, tiny_model, "none", use_swanlab=True, swanlab_mode="local")
    assert done.returncode == 0, done.stderr[-3000:]
    (run,) = (out / "swanlog").glob("run-*")
    (run_file,) = run.glob("run-*.swanlab")
    assert _swanlab_scalars(run_file)["train/loss"] == pytest.approx(trainer_losses(out), rel=1e-6)
    config = yaml.safe_load((run / "files" / "config.yaml").read_text())
    assert config["lmstack/learning_rate"]["value"] == 0.01
    assert config["lmstack/hf_hub_token"]["value"] == "***"
    assert_no_secret(out / "swanlog")


SHIM = (
    "import sys\nfor name in {names!r}:\n    sys.modules[name] = None  # `import name` raises ImportError\n"
)


@pytest.mark.parametrize(
    "report_to,module,extra",
    [
        ("wandb", "wandb", "wandb"),
        ("tensorboard,mlflow", "mlflow", "mlflow"),
        ("trackio", "trackio", "trackio"),
    ],
)
def test_missing_tracker_is_refused_before_the_model_loads(tmp_path, tiny_model, report_to, module, extra):
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(SHIM.format(names=[module]))
    env = {"PYTHONPATH": os.pathsep.join([str(shim), os.environ.get("PYTHONPATH", "")])}
    done, out = run_train(tmp_path, tiny_model, report_to, extra_env=env)
    assert done.returncode == 2, done.stderr[-3000:]
    assert (
        f"report_to: {module} needs `{module}`, which is not installed; pip install 'lmstack[{extra}]'"
        in (done.stderr)
    )
    assert "Traceback" not in done.stderr and not out.exists()  # nothing loaded, nothing written


def test_use_swanlab_without_swanlab_names_the_field(tmp_path, tiny_model):
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(SHIM.format(names=["swanlab"]))
    env = {"PYTHONPATH": os.pathsep.join([str(shim), os.environ.get("PYTHONPATH", "")])}
    done, out = run_train(tmp_path, tiny_model, "none", extra_env=env, use_swanlab=True)
    assert done.returncode == 2
    assert (
        "use_swanlab: true needs `swanlab`, which is not installed; pip install 'lmstack[swanlab]'"
        in done.stderr
    )
