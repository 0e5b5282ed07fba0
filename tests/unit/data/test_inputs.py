"""Hostile inputs (issue 18, "Inputs"): links out of dataset_dir, files that are not UTF-8, ragged CSV
rows, JSON nested past the reader's limit and registry entries of the wrong type are refused naming
the file / record / entry; preference pairs with two identical answers are counted and dropped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _data_helpers import DATA_DIR

from lmstack.config.errors import DataError
from lmstack.data.formats import RecordError, convert
from lmstack.data.loader import read_records
from lmstack.data.pipeline import load_split
from lmstack.data.registry import TAG_DEFAULTS, DatasetAttr, get_dataset_attrs
from lmstack.data.validate import check_data

RECORDS = [{"instruction": "hi", "output": "hello"}, {"instruction": "bye", "output": "see you"}]


def registry(root: Path, **entries) -> Path:
    (root / "dataset_info.json").write_text(json.dumps(entries))
    return root


def read(name: str, root: Path) -> list:
    (attr,) = get_dataset_attrs(name, root)
    return read_records(attr)


# ---- links out of dataset_dir ------------------------------------------------------------------
@pytest.fixture
def outside(tmp_path) -> Path:
    """A folder next to dataset_dir holding data that must never be read through a link."""
    out = tmp_path / "outside"
    out.mkdir()
    (out / "secret.json").write_text(json.dumps(RECORDS))
    return out


@pytest.fixture
def ddir(tmp_path) -> Path:
    d = tmp_path / "ddir"
    d.mkdir()
    return d


@pytest.mark.parametrize("hidden", [False, True])
def test_a_file_link_inside_a_dataset_folder_that_leaves_dataset_dir_is_refused(hidden, ddir, outside):
    """Before, the folder's files were read through the link (and hashed for the cache)."""
    (ddir / "parts").mkdir()
    (ddir / "parts" / "0.json").write_text(json.dumps(RECORDS))
    link = ddir / "parts" / (".1.json" if hidden else "1.json")
    link.symlink_to(outside / "secret.json")
    registry(ddir, p={"file_name": "parts"})
    with pytest.raises(DataError) as err:
        get_dataset_attrs("p", ddir)
    msg = str(err.value)
    assert msg.startswith(f"{ddir / 'dataset_info.json'} [p]: file_name 'parts': {link} is a link to ")
    assert f"{(outside / 'secret.json').resolve()}, outside dataset_dir {ddir.resolve()}" in msg


def test_a_folder_link_inside_a_dataset_folder_that_leaves_dataset_dir_is_refused(ddir, outside):
    (ddir / "parts" / "deeper").mkdir(parents=True)
    (ddir / "parts" / "0.json").write_text(json.dumps(RECORDS))
    (ddir / "parts" / "deeper" / "elsewhere").symlink_to(outside, target_is_directory=True)
    registry(ddir, p={"file_name": "parts"})
    with pytest.raises(
        DataError, match=r"\[p\]: file_name 'parts': .*deeper/elsewhere is a link to .*outside"
    ):
        get_dataset_attrs("p", ddir)


def test_a_link_on_the_way_to_file_name_is_named(ddir, outside):
    (ddir / "sub").symlink_to(outside, target_is_directory=True)
    registry(ddir, x={"file_name": "sub/secret.json"})
    with pytest.raises(DataError) as err:
        get_dataset_attrs("x", ddir)
    assert f"[x]: file_name 'sub/secret.json': {ddir / 'sub'} is a link to {outside.resolve()}" in str(
        err.value
    )


def test_links_that_stay_inside_dataset_dir_are_read(ddir, make_cfg, tiny_tokenizer, qwen):
    (ddir / "store").mkdir()
    (ddir / "store" / "a.json").write_text(json.dumps(RECORDS))
    (ddir / "parts").mkdir()
    (ddir / "parts" / "a.json").symlink_to(ddir / "store" / "a.json")
    (ddir / "alias.json").symlink_to("store/a.json")
    registry(ddir, p={"file_name": "parts"}, a={"file_name": "alias.json"})
    for name in ("p", "a"):
        assert [r.data for r in read(name, ddir)] == RECORDS
    report = check_data(make_cfg(dataset="p,a", dataset_dir=str(ddir)), tiny_tokenizer, qwen)
    assert report["totals"]["kept"] == 4


# ---- files that are not UTF-8 ------------------------------------------------------------------
@pytest.mark.parametrize("suffix", ["json", "jsonl", "txt", "csv"])
def test_a_latin1_file_names_the_file_and_the_byte_offset(suffix, ddir):
    body = {
        "json": '[{"instruction": "café", "output": "x"}]',
        "jsonl": '{"instruction": "a", "output": "b"}\n{"instruction": "café", "output": "x"}\n',
        "txt": "first line\nun café\n",
        "csv": "instruction,output\ncafé,x\n",
    }[suffix]
    path = ddir / f"d.{suffix}"
    path.write_bytes(body.encode("latin-1"))
    offset = body.encode("latin-1").index(b"\xe9")
    line = body[:offset].count("\n") + 1
    registry(ddir, d={"file_name": path.name})
    with pytest.raises(DataError) as err:
        read("d", ddir)
    msg = str(err.value)
    assert msg.startswith(f"{path}: not UTF-8 text: byte 0xe9 at byte offset {offset} (line {line})")
    assert "save the file as UTF-8" in msg


def test_a_latin1_dataset_info_json_names_the_offset(ddir):
    (ddir / "dataset_info.json").write_bytes('{"café": {"file_name": "a.json"}}'.encode("latin-1"))
    with pytest.raises(DataError, match=r"dataset_info.json: not UTF-8 text: byte 0xe9 at byte offset 5 "):
        get_dataset_attrs("café", ddir)


# ---- ragged CSV rows ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "rows,match",
    [
        ("a,b\n\nc,d,e\n", r"row 1 \(line 4\): 3 fields, the header has 2 \(instruction, output\)"),
        ("a,b\nc,d\nlonely\n", r"row 2 \(line 4\): 1 field, the header has 2"),
        ('a,b\n"c\nd",e\nf,g,h\n', r"row 2 \(line 5\): 3 fields"),  # a quoted newline is one row
    ],
)
def test_a_ragged_csv_row_is_named(rows, match, ddir):
    (ddir / "t.csv").write_text("instruction,output\n" + rows)
    registry(ddir, t={"file_name": "t.csv"})
    with pytest.raises(DataError, match=rf"^{ddir / 't.csv'} {match}.*; quote values that hold a comma"):
        read("t", ddir)


def test_a_table_the_reader_rejects_names_the_file(ddir):
    (ddir / "t.parquet").write_bytes(b"not a parquet file at all")
    registry(ddir, t={"file_name": "t.parquet"})
    with pytest.raises(DataError, match=rf"^{ddir / 't.parquet'}: could not be read as parquet: "):
        read("t", ddir)


# ---- JSON nested past the reader's limit -------------------------------------------------------
DEEP = "[" * 100_000 + "]" * 100_000


def test_a_too_deep_record_of_a_json_array_is_named(ddir):
    text = json.dumps(RECORDS)[:-1] + f', {{"instruction": {DEEP}, "output": "x"}}]'
    (ddir / "d.json").write_text(text)
    registry(ddir, d={"file_name": "d.json"})
    with pytest.raises(DataError, match=rf"^{ddir / 'd.json'} record 2: nested deeper than the JSON reader"):
        read("d", ddir)


def test_a_too_deep_json_line_is_a_counted_bad_line(ddir, make_cfg, tiny_tokenizer, qwen):
    lines = [json.dumps(RECORDS[0]), f'{{"instruction": {DEEP}}}', json.dumps(RECORDS[1])]
    (ddir / "d.jsonl").write_text("\n".join(lines) + "\n")
    registry(ddir, d={"file_name": "d.jsonl"})
    report = check_data(make_cfg(dataset="d", dataset_dir=str(ddir)), tiny_tokenizer, qwen)
    (entry,) = report["datasets"]
    assert entry["kept"] == 2 and entry["dropped"] == {"bad JSON line": 1}
    (problem,) = entry["problems"]
    assert problem["position"] == "line 2"
    assert problem["reason"].startswith("bad JSON line: nested deeper than the JSON reader allows")


def test_a_record_too_deep_to_serialize_is_a_named_problem():
    """A tools value is JSON-dumped for the template; nested past the limit it is the record's
    problem, not a traceback (a table reader may hand over values deeper than the JSON reader)."""
    nested: list = []
    for _ in range(100_000):
        nested = [nested]
    record = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    record["tools"] = [{"name": "f", "parameters": nested}]
    attr = DatasetAttr(
        "d", "file", "d.json", formatting="sharegpt", columns={"tools": "tools"}, tags=dict(TAG_DEFAULTS)
    )
    with pytest.raises(RecordError) as err:
        convert(record, attr)
    assert (err.value.field, err.value.kind) == ("<record>", "nested too deeply")


@pytest.mark.parametrize(
    "tools,detail",
    [
        ('{"name": "f"', "not valid JSON"),
        ('{"name": "f"}', "must be a JSON list of function schemas (objects)"),
        ([["f"]], "must be a JSON list of function schemas (objects)"),
    ],
)
def test_a_tools_value_that_is_no_list_of_schemas_is_a_named_problem(tools, detail):
    """Before, the template met it while tokenizing: a ValueError / AttributeError traceback."""
    record = {
        "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}],
        "tools": tools,
    }
    attr = DatasetAttr(
        "d", "file", "d.json", formatting="sharegpt", columns={"tools": "tools"}, tags=dict(TAG_DEFAULTS)
    )
    with pytest.raises(RecordError) as err:
        convert(record, attr)
    assert (err.value.field, err.value.kind) == ("tools", "wrong type") and detail in err.value.reason


# ---- registry entries of the wrong type --------------------------------------------------------
@pytest.mark.parametrize(
    "entry,match",
    [
        (None, r"\[x\]: the entry is null, not an object"),
        ([1, 2], r"\[x\]: the entry is \[1, 2\], not an object"),
        ("a.json", r'\[x\]: the entry is "a.json", not an object'),
        ({"file_name": 5}, r"\[x\]: file_name: got 5; expected a non-empty string"),
        ({"file_name": ["a.json"]}, r'\[x\]: file_name: got \["a.json"\]; expected a non-empty string'),
        ({"file_name": None}, r"\[x\]: file_name: got null; expected a non-empty string"),
        ({"file_name": ""}, r'\[x\]: file_name: got ""; expected a non-empty string'),
        ({"hf_hub_url": {"id": "org/x"}}, r"\[x\]: hf_hub_url: got \{.*expected a non-empty string"),
    ],
)
def test_an_entry_of_the_wrong_type_is_named(entry, match, ddir):
    (ddir / "a.json").write_text("[]")
    registry(ddir, x=entry)
    with pytest.raises(DataError, match=match):
        get_dataset_attrs("x", ddir)


# ---- preference pairs with two identical answers -----------------------------------------------
def test_identical_chosen_and_rejected_are_counted_and_dropped(ddir, make_cfg, tiny_tokenizer, qwen):
    """Before, such a pair was trained on: its two rows are the same, so its DPO margin is always 0."""
    alpaca = [
        {"instruction": f"q{i}", "chosen": f"good {i}", "worse": f"bad {i}" if i != 1 else "good 1"}
        for i in range(3)
    ]
    sharegpt = json.loads((DATA_DIR / "dpo_zh_demo.json").read_text())[:3]
    sharegpt[2]["rejected"] = dict(sharegpt[2]["chosen"])
    (ddir / "a.json").write_text(json.dumps(alpaca))
    (ddir / "s.json").write_text(json.dumps(sharegpt))
    info = json.loads((DATA_DIR / "dataset_info.json").read_text())
    registry(
        ddir,
        a={"file_name": "a.json", "ranking": True, "columns": {"chosen": "chosen", "rejected": "worse"}},
        s=dict(info["dpo_zh_demo"], file_name="s.json"),
    )
    cfg = make_cfg(dataset="a,s", dataset_dir=str(ddir), stage="dpo")
    data, (a, s) = load_split(cfg, "a,s", "dataset", tiny_tokenizer, qwen)
    assert len(data) == 4
    for stats, position, field in ((a, "record 1", "worse"), (s, "record 2", "rejected.value")):
        assert stats.records == 3 and stats.kept == 2
        assert stats.dropped == {"chosen and rejected are identical": 1}
        (p,) = stats.problems
        assert (p["position"], p["field"]) == (position, field)
        assert (
            p["reason"] == "chosen and rejected are identical: a preference pair needs two different answers"
        )


def test_answers_that_differ_only_past_cutoff_len_are_dropped(ddir, make_cfg, tiny_tokenizer, qwen):
    same = "The capital of France is Paris, a city on the Seine with many museums and bridges. " * 4
    pairs = [
        {"instruction": "Capital of France?", "chosen": same + "Yes.", "rejected": same + "No."},
        {"instruction": "Capital of Italy?", "chosen": "Rome.", "rejected": "Milan."},
    ]
    (ddir / "p.json").write_text(json.dumps(pairs))
    registry(
        ddir,
        p={"file_name": "p.json", "ranking": True, "columns": {"chosen": "chosen", "rejected": "rejected"}},
    )
    cfg = make_cfg(dataset="p", dataset_dir=str(ddir), stage="rm", cutoff_len=48)
    report = check_data(cfg, tiny_tokenizer, qwen)
    (entry,) = report["datasets"]
    assert entry["kept"] == 1 and entry["dropped"] == {"chosen and rejected are identical": 1}
    reason = entry["problems"][0]["reason"]
    assert reason.startswith("chosen and rejected are identical after truncation to cutoff_len=48")
    assert "raise cutoff_len" in reason
    wide = check_data(
        make_cfg(dataset="p", dataset_dir=str(ddir), stage="rm", cutoff_len=1024), tiny_tokenizer, qwen
    )
    assert wide["datasets"][0]["kept"] == 2
