"""`lmstack check` end to end (CLI, report file, --strict/--json, no model weights) and `train`
on malformed data: check and train report the same problems the same way."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import yaml

from lmstack.cli.main import main
from lmstack.config.errors import DataError
from lmstack.data.validate import format_report
from lmstack.train.run import train

REPO = Path(__file__).resolve().parents[2]
BAD_DIR = REPO / "tests" / "fixtures" / "bad_data"
MM_DIR = REPO / "tests" / "fixtures" / "multimodal"
MM_REFUSED = "dataset mllm_demo has images, but model_name_or_path "
MM_SUPPORTED = "without a supported vision tower; image fine-tuning works with model types qwen2_vl"
MIX = "good_alpaca,bad_alpaca,bad_sharegpt,bad_openai"


def write_cfg(tmp_path: Path, cfg: dict) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture
def weightless_model(tiny_model, tmp_path) -> Path:
    """The tiny model's tokenizer files only: check must never need the weights."""
    dst = tmp_path / "tokenizer_only"
    shutil.copytree(tiny_model, dst)
    for weights in dst.glob("*.safetensors"):
        weights.unlink()
    return dst


def test_check_lists_every_problem_and_writes_the_report(base_cfg, weightless_model, tmp_path, capsys):
    cfg = {
        **base_cfg,
        "model_name_or_path": str(weightless_model),
        "dataset": MIX,
        "dataset_dir": str(BAD_DIR),
    }
    path = write_cfg(tmp_path, cfg)
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "bad_alpaca (dataset): 11 records, 2 kept, 9 dropped" in out
    assert "9 dropped (6 x wrong type, 2 x missing field, 1 x empty response)" in out
    assert "bad_sharegpt.jsonl line 2: bad JSON line" in out
    assert "bad_sharegpt.jsonl line 3, field conversations[1].from: unknown role: 'bot'" in out
    assert "bad_openai.json record 6, field messages[4]: wrong role order" in out
    assert "bad_alpaca.json record 6, field input: wrong type: must be a string, got list" in out
    for part in ("prompt tokens", "response tokens", "total tokens"):
        assert part in out
    assert "p50" in out and "p95" in out and "max" in out
    assert "«" in out and "\033[" not in out  # not a tty: brackets, no colour codes
    report_path = Path(cfg["output_dir"]) / "data_report.json"
    assert f"report written to {report_path}" in out
    report = json.loads(report_path.read_text())
    assert report["totals"]["problems"] == 9 + 10 + 8
    assert main(["check", str(path), "--strict"]) == 1
    capsys.readouterr()
    assert main(["check", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["totals"] == report["totals"]


def test_check_clean_data_strict_passes_and_shows_the_trained_tokens(base_cfg, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = {k: v for k, v in base_cfg.items() if k != "output_dir"}  # no output_dir: report in cwd
    cfg.update(dataset="identity", cutoff_len=1024)
    path = write_cfg(tmp_path, cfg)
    assert main(["check", str(path), "--strict"]) == 0
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "data_report.json").read_text())
    (entry,) = report["datasets"]
    assert entry["kept"] == entry["records"] == 20 and entry["problems"] == [] and entry["truncated"] == 0
    assert entry["trainable_tokens"] > 0
    lengths = entry["lengths"]
    assert 0 < lengths["response"]["p50"] <= lengths["response"]["p95"] <= lengths["response"]["max"]
    assert lengths["total"]["max"] <= lengths["prompt"]["max"] + lengths["response"]["max"]
    trained = [s["text"] for s in report["example"] if s["trained"]]
    first_answer = json.loads((REPO / "data" / "identity.json").read_text())[0]["output"]
    assert trained == [first_answer + "<|im_end|>\n"]
    assert f"«{first_answer}<|im_end|>\n»" in out
    assert "<|im_start|>assistant\n«" in out  # the prompt (with its template markup) is not trained
    coloured = format_report(report, color=True)
    assert f"\033[1;32m{first_answer}<|im_end|>\n\033[0m" in coloured and "«" not in coloured


def test_check_without_output_dir_runs_from_the_folder_holding_the_data(
    base_cfg, tmp_path, capsys, monkeypatch
):
    """LF users run from their repo root, where data/ lives: with no output_dir the report goes to the
    current folder, and no training output is guarded there (the overlap check refused this)."""
    data = tmp_path / "data"
    shutil.copytree(REPO / "data", data)
    monkeypatch.chdir(tmp_path)
    cfg = {k: v for k, v in base_cfg.items() if k != "output_dir"}
    cfg.update(dataset="identity", dataset_dir="data")
    assert main(["check", str(write_cfg(tmp_path, cfg))]) == 0
    assert json.loads((tmp_path / "data_report.json").read_text())["datasets"][0]["kept"] == 20
    assert not (tmp_path / "unused-by-inference").exists()  # the placeholder is never created


def test_check_refuses_multimodal_columns_naming_the_column(base_cfg, weightless_model, tmp_path, capsys):
    """LF's mllm_demo entry: before, `<image>` was trained as text and check reported 0 problems."""
    cfg = {**base_cfg, "model_name_or_path": str(weightless_model), "dataset": "mllm_demo"}
    path = write_cfg(tmp_path, {**cfg, "dataset_dir": str(MM_DIR)})
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert MM_REFUSED in err and MM_SUPPORTED in err
    assert not (Path(cfg["output_dir"]) / "data_report.json").exists()


def test_train_refuses_multimodal_columns_before_the_tokenizer_and_the_model(base_cfg, monkeypatch):
    import lmstack.train.common as common
    import lmstack.train.sft as sft

    def not_here(*args, **kwargs):
        raise AssertionError("nothing may be loaded or tokenized for a refused dataset")

    monkeypatch.setattr(common, "tokenizer_and_template", not_here)
    monkeypatch.setattr(sft, "load_model", not_here)
    with pytest.raises(DataError) as err:
        train(None, {**base_cfg, "dataset": "mllm_demo", "dataset_dir": str(MM_DIR)})
    assert str(err.value).startswith(MM_REFUSED)
    assert not Path(base_cfg["output_dir"]).exists()


def test_check_reports_truncation(base_cfg, tmp_path):
    from lmstack.cli.check import run_check

    report, _ = run_check(None, {**base_cfg, "dataset": "alpaca_en_demo", "cutoff_len": 32})
    (entry,) = report["datasets"]
    assert entry["truncated"] > 0 and entry["lengths"]["total"]["max"] > 32


def expected_problems(file_name: str) -> set[str]:
    """`<file> <position>[, field <path>]: <kind>` for each bad record (the fixtures' `_expect` keys)."""
    path, out = BAD_DIR / file_name, set()
    if path.suffix == ".jsonl":
        items = []
        for n, line in enumerate(path.read_text().splitlines(), start=1):
            try:
                items.append((f"line {n}", json.loads(line)))
            except json.JSONDecodeError:
                out.add(f"{path} line {n}: bad JSON line")
    else:
        items = [(f"record {i}", r) for i, r in enumerate(json.loads(path.read_text()))]
    for pos, rec in items:
        if not isinstance(rec, dict):
            out.add(f"{path} {pos}, field <record>: wrong type")
        elif "_expect" in rec:
            field = f", field {rec['_expect']['field']}" if rec["_expect"]["field"] else ""
            out.add(f"{path} {pos}{field}: {rec['_expect']['kind']}")
    return out


def test_train_drops_bad_records_and_logs_the_same_reasons_as_check(base_cfg, tmp_path, caplog):
    cfg = {**base_cfg, "dataset": MIX, "dataset_dir": str(BAD_DIR), "max_steps": 2}
    with caplog.at_level(logging.INFO):
        train(None, cfg)
    log = "\n".join(r.getMessage() for r in caplog.records)
    assert "dataset good_alpaca: 6 records, 6 kept, 0 dropped (none)" in log
    assert "dataset bad_alpaca: 11 records, 2 kept, 9 dropped (" in log
    assert "dataset bad_sharegpt: 12 records, 2 kept, 10 dropped (" in log
    assert "dataset bad_openai: 9 records, 1 kept, 8 dropped (" in log
    assert "1 x bad JSON line" in log and "2 x unknown role" not in log
    assert "bad_openai.json record 6, field messages[4]: wrong role order" in log
    assert (Path(cfg["output_dir"]) / "adapter_model.safetensors").is_file()
    logged = {  # every problem line of the log, cut after its kind
        r.getMessage().strip().split(": ")[0] + ": " + r.getMessage().strip().split(": ")[1]
        for r in caplog.records
        if r.levelname == "WARNING" and str(BAD_DIR) in r.getMessage()
    }
    expected = set().union(
        *(expected_problems(f) for f in ("bad_alpaca.json", "bad_sharegpt.jsonl", "bad_openai.json"))
    )
    assert logged == expected


def test_train_on_all_bad_data_fails_before_the_model_loads(base_cfg, monkeypatch):
    import lmstack.train.sft as sft

    def no_model(*args, **kwargs):
        raise AssertionError("the model must not load when no record is valid")

    monkeypatch.setattr(sft, "load_model", no_model)
    with pytest.raises(DataError) as err:
        train(None, {**base_cfg, "dataset": "all_bad", "dataset_dir": str(BAD_DIR)})
    msg = str(err.value)
    assert "all_bad: 3 records, 0 kept, dropped: 1 x missing field, 1 x empty response, 1 x wrong type" in msg
    assert "all_bad.json record 2, field output: wrong type: must be a string, got int" in msg


def test_streaming_train_runs(base_cfg, caplog):
    cfg = {
        **base_cfg,
        "dataset": "identity,alpaca_en_demo",
        "streaming": True,
        "max_steps": 3,
        "buffer_size": 16,
    }
    with caplog.at_level(logging.INFO):
        metrics = train(None, cfg)
    assert metrics["train_loss"] > 0
    assert any("tokenized while training" in r.getMessage() for r in caplog.records)


# ---- hostile inputs (issue 18): exit 2 naming the file / record / entry, never a traceback ------
def _hostile_dir(root: Path) -> Path:
    root.mkdir()
    (root / "latin.json").write_bytes('[{"instruction": "café", "output": "x"}]'.encode("latin-1"))
    (root / "ragged.csv").write_text("instruction,output\na,b\nc,d,e\n")
    deep = "[" * 100_000 + "]" * 100_000
    (root / "deep.json").write_text(f'[{{"instruction": "a", "output": "b"}}, {{"instruction": {deep}}}]')
    (root / "ok.json").write_text('[{"instruction": "a", "output": "b"}]')
    (root / "outside.json").write_text('[{"instruction": "secret", "output": "b"}]')
    (root / "parts").mkdir()
    (root / "parts" / "0.json").write_text('[{"instruction": "a", "output": "b"}]')
    info = {
        "latin": {"file_name": "latin.json"},
        "ragged": {"file_name": "ragged.csv"},
        "deep": {"file_name": "deep.json"},
        "nothing": None,
        "number": {"file_name": 7},
        "linked": {"file_name": "parts"},
    }
    (root / "dataset_info.json").write_text(json.dumps(info))
    return root


HOSTILE = {
    "latin": "latin.json: not UTF-8 text: byte 0xe9 at byte offset 21 (line 1) cannot be decoded",
    "ragged": "ragged.csv row 1 (line 3): 3 fields, the header has 2 (instruction, output)",
    "deep": "deep.json record 1: nested deeper than the JSON reader allows",
    "nothing": "dataset_info.json [nothing]: the entry is null, not an object",
    "number": "dataset_info.json [number]: file_name: got 7; expected a non-empty string",
    "linked": "dataset_info.json [linked]: file_name 'parts': ",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_check_exits_2_naming_the_place_of_a_hostile_input(
    name, base_cfg, weightless_model, tmp_path, capsys
):
    root = _hostile_dir(tmp_path / "data")
    outside = tmp_path / "elsewhere.json"
    outside.write_text('[{"instruction": "secret", "output": "b"}]')
    (root / "parts" / "1.json").symlink_to(outside)
    cfg = {**base_cfg, "model_name_or_path": str(weightless_model), "dataset": name, "dataset_dir": str(root)}
    assert main(["check", str(write_cfg(tmp_path, cfg))]) == 2
    err = capsys.readouterr().err
    assert HOSTILE[name] in err and "Traceback" not in err
    if name == "linked":
        assert f"{root / 'parts' / '1.json'} is a link to {outside.resolve()}, outside dataset_dir" in err


@pytest.mark.parametrize("name", ["latin", "ragged", "nothing"])
def test_train_on_a_hostile_input_fails_before_the_model_loads(name, base_cfg, tmp_path, monkeypatch):
    import lmstack.train.sft as sft

    def no_model(*args, **kwargs):
        raise AssertionError("the model must not load for unreadable data")

    monkeypatch.setattr(sft, "load_model", no_model)
    root = _hostile_dir(tmp_path / "data")
    with pytest.raises(DataError) as err:
        train(None, {**base_cfg, "dataset": name, "dataset_dir": str(root)})
    assert HOSTILE[name] in str(err.value)


def test_check_reports_fields_cut_before_tokenizing(base_cfg, weightless_model, tmp_path, capsys):
    """A 2 MB answer is cut to 32 x cutoff_len characters before tokenizing; check says so, and its
    lengths (tokens before truncation) are those of the kept part: bounded too."""
    root = tmp_path / "data"
    root.mkdir()
    records = [
        {"instruction": "hi", "output": "many words here " * 125_000},
        {"instruction": "q", "output": "a"},
    ]
    (root / "big.json").write_text(json.dumps(records))
    (root / "dataset_info.json").write_text(json.dumps({"big": {"file_name": "big.json"}}))
    cfg = {
        **base_cfg,
        "model_name_or_path": str(weightless_model),
        "dataset": "big",
        "dataset_dir": str(root),
    }
    assert main(["check", str(write_cfg(tmp_path, cfg))]) == 0
    out = capsys.readouterr().out
    assert (
        "big (dataset): 2 records, 2 kept, 0 dropped, 1 truncated, "
        "1 fields cut to 4096 characters before tokenizing" in out
    )
    assert "1 truncated, 1 fields cut before tokenizing" in out
    report = json.loads((Path(cfg["output_dir"]) / "data_report.json").read_text())
    (entry,) = report["datasets"]
    assert (entry["fields_cut"], entry["field_chars"], report["totals"]["fields_cut"]) == (1, 4096, 1)
    assert 128 < entry["lengths"]["total"]["max"] < 4096  # before: the whole 2 MB answer, 500k tokens


def test_check_of_packed_pt_cuts_nothing(base_cfg, weightless_model, tmp_path):
    """Packed pt splits long texts into cutoff_len pieces: no field is cut, every token is kept."""
    from lmstack.cli.check import run_check

    root = tmp_path / "data"
    root.mkdir()
    (root / "t.jsonl").write_text(json.dumps({"text": "many words here " * 20_000}) + "\n")
    (root / "dataset_info.json").write_text(
        json.dumps({"t": {"file_name": "t.jsonl", "columns": {"prompt": "text"}}})
    )
    cfg = {**base_cfg, "model_name_or_path": str(weightless_model), "stage": "pt", "dataset": "t"}
    report, _ = run_check(None, {**cfg, "dataset_dir": str(root)})
    assert report["pt_split"] is True
    (entry,) = report["datasets"]
    assert entry["fields_cut"] == 0 and entry["split_texts"] == 1
    assert entry["lengths"]["total"]["max"] > 32 * 128 and entry["pieces"] == -(
        -entry["lengths"]["total"]["max"] // 128
    )
