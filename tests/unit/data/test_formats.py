"""Every format against the shipped demo data, and the malformed fixture set: each bad record
produces exactly its named problem (kind + field path + file position)."""

from __future__ import annotations

import json

import pytest
from _data_helpers import BAD_DIR, DATA_DIR, expected_problems

from lmstack.config.errors import ConfigError, DataError
from lmstack.data.encode import IGNORE_INDEX
from lmstack.data.formats import RecordError, convert
from lmstack.data.loader import read_records
from lmstack.data.pipeline import build_datasets, load_split
from lmstack.data.registry import get_dataset_attrs
from lmstack.data.validate import check_data


def converted(name: str, dataset_dir=DATA_DIR) -> list[dict]:
    (attr,) = get_dataset_attrs(name, dataset_dir)
    return [convert(r.data, attr) for r in read_records(attr)]


def trained_text(tokenizer, sample) -> str:
    return tokenizer.decode([t for t in sample["labels"] if t != IGNORE_INDEX])


# ---- shipped data: every dataset in data/dataset_info.json is used here ----------------------
@pytest.mark.parametrize(
    "name,stage",
    [
        ("alpaca_en_demo", "sft"),
        ("alpaca_zh_demo", "sft"),
        ("identity", "sft"),
        ("sharegpt_demo", "sft"),
        ("openai_demo", "sft"),
        ("c4_demo", "pt"),
        ("wiki_zh_demo", "pt"),
    ],
)
def test_shipped_dataset_loads_without_a_problem(name, stage, make_cfg, tiny_tokenizer, qwen):
    cfg = make_cfg(dataset=name, stage=stage, cutoff_len=4096)
    data, (stats,) = load_split(cfg, name, "dataset", tiny_tokenizer, qwen)
    assert stats.problems == [] and stats.kept == stats.records == len(data) > 0
    assert stats.truncated == 0
    if stage == "pt":  # plain text: every token trained, ends with EOS
        assert data[0]["labels"] == data[0]["input_ids"]
        assert data[0]["input_ids"][-1] == tiny_tokenizer.eos_token_id


def test_alpaca_history_and_system(tiny_tokenizer, qwen, make_cfg):
    examples = converted("alpaca_en_demo")
    with_history = [e for e in examples if len(e["prompt"]) > 1]
    with_system = [e for e in examples if e["system"]]
    assert with_history and with_system
    ex = with_history[0]
    assert [m["role"] for m in ex["prompt"]] == ["user", "assistant"] * (len(ex["prompt"]) // 2) + ["user"]
    # the history answers are trained too (every assistant turn)
    cfg = make_cfg(cutoff_len=4096)
    from lmstack.data.encode import encode_supervised
    from lmstack.data.pipeline import encode_options

    sample, _ = encode_supervised(ex, tiny_tokenizer, qwen, encode_options(cfg))
    trained = trained_text(tiny_tokenizer, sample)
    for hist_answer in ex["prompt"][1::2]:
        assert hist_answer["content"] in trained
    sample, _ = encode_supervised(with_system[0], tiny_tokenizer, qwen, encode_options(cfg))
    assert with_system[0]["system"] in tiny_tokenizer.decode(sample["input_ids"])


def test_sharegpt_tools_observation_function(tiny_tokenizer, qwen):
    examples = converted("sharegpt_demo")
    tool_use = [e for e in examples if any(m["role"] == "function" for m in e["prompt"])]
    assert tool_use, "the demo has tool-use conversations"
    ex = tool_use[0]
    roles = [m["role"] for m in ex["prompt"]]
    assert roles[:3] == ["user", "function", "observation"] and ex["tools"]
    assert json.loads(ex["prompt"][1]["content"])["name"]
    assert any(e["system"] for e in examples)


def test_sharegpt_leading_system_message_overrides_system_column():
    (attr,) = get_dataset_attrs("bad_sharegpt", BAD_DIR)
    first = read_records(attr)[0]  # the fixture's good line: system_tag turn, then human/gpt
    ex = convert({**first.data, "system": "column system"}, attr)
    assert ex["system"] == "You are terse." and [m["role"] for m in ex["prompt"]] == ["user"]
    assert ex["response"] == [{"role": "assistant", "content": "Hello."}]


def test_openai_tool_calls_and_consecutive_tool_messages():
    shipped = [e for e in converted("openai_demo") if any(m["role"] == "function" for m in e["prompt"])]
    assert shipped
    call = json.loads(shipped[0]["prompt"][1]["content"])
    assert set(call) == {"name", "arguments"} and isinstance(call["arguments"], dict)
    (attr,) = get_dataset_attrs("bad_openai", BAD_DIR)
    ex = convert(read_records(attr)[0].data, attr)  # the good record: two tool results in a row
    assert [m["role"] for m in ex["prompt"]] == ["user", "function", "observation"]
    assert ex["prompt"][2]["content"] == '{"temp": 21}\n{"temp": 25}'
    assert ex["system"] == "Use tools." and json.loads(ex["tools"])[0]["function"]["name"] == "get_weather"


@pytest.mark.parametrize("name", ["dpo_en_demo", "dpo_zh_demo"])
def test_pairwise_records_have_chosen_and_rejected(name):
    examples = converted(name)
    assert examples
    for ex in examples:
        assert len(ex["prompt"]) % 2 == 1 and ex["prompt"][-1]["role"] == "user"
        chosen, rejected = ex["response"]
        assert chosen["role"] == rejected["role"] == "assistant"
        assert chosen["content"] and rejected["content"] and chosen["content"] != rejected["content"]


def test_kto_tag_is_read_as_a_bool():
    examples = converted("kto_en_demo")
    tags = [e["kto_tag"] for e in examples]
    assert set(tags) == {True, False} and tags.count(True) == 20
    (attr,) = get_dataset_attrs("kto_en_demo", DATA_DIR)
    record = dict(read_records(attr)[0].data, label="yes")
    with pytest.raises(RecordError) as err:
        convert(record, attr)
    assert (err.value.field, err.value.kind) == ("label", "wrong type")


def test_ranking_dataset_refused_for_sft(make_cfg, tiny_tokenizer, qwen):
    with pytest.raises(DataError, match="dpo_en_demo: a ranking .* cannot be used with stage sft"):
        build_datasets(make_cfg(dataset="dpo_en_demo"), tiny_tokenizer, qwen)


# ---- the malformed fixture set --------------------------------------------------------------
@pytest.mark.parametrize(
    "name,file_name,stage",
    [
        ("bad_alpaca", "bad_alpaca.json", "sft"),
        ("bad_sharegpt", "bad_sharegpt.jsonl", "sft"),
        ("bad_openai", "bad_openai.json", "sft"),
        ("bad_pt", "bad_pt.jsonl", "pt"),
        ("all_bad", "all_bad.json", "sft"),
    ],
)
def test_each_bad_record_gives_exactly_its_named_problem(
    name, file_name, stage, make_cfg, tiny_tokenizer, qwen
):
    cfg = make_cfg(dataset=name, dataset_dir=str(BAD_DIR), stage=stage)
    report = check_data(cfg, tiny_tokenizer, qwen)
    (entry,) = report["datasets"]
    expected = expected_problems(file_name)
    got = {p["position"]: (p["kind"], p["field"]) for p in entry["problems"]}
    assert got == expected
    assert len(entry["problems"]) == len(expected)  # one problem per bad record, none for good ones
    assert all(p["file"].endswith(file_name) for p in entry["problems"])
    assert entry["kept"] == entry["records"] - len(expected)
    assert sum(entry["dropped"].values()) == len(expected)
    for p in entry["problems"]:
        assert p["reason"].startswith(p["kind"])


def test_jsonl_positions_are_line_numbers(make_cfg, tiny_tokenizer, qwen):
    cfg = make_cfg(dataset="bad_sharegpt", dataset_dir=str(BAD_DIR))
    problems = check_data(cfg, tiny_tokenizer, qwen)["datasets"][0]["problems"]
    bad_json = [p for p in problems if p["kind"] == "bad JSON line"]
    assert [p["position"] for p in bad_json] == ["line 2"]
    unknown = next(p for p in problems if p["kind"] == "unknown role")
    assert "'bot'" in unknown["reason"] and "human" in unknown["reason"]


def test_all_bad_training_data_fails_before_the_model_with_the_breakdown(make_cfg, tiny_tokenizer, qwen):
    cfg = make_cfg(dataset="all_bad", dataset_dir=str(BAD_DIR))
    with pytest.raises(DataError) as err:
        build_datasets(cfg, tiny_tokenizer, qwen)
    msg = str(err.value)
    assert "all_bad: 3 records, 0 kept" in msg
    assert "1 x missing field" in msg and "1 x empty response" in msg and "1 x wrong type" in msg
    assert "all_bad.json record 0, field instruction: missing field" in msg
    assert "all_bad.json record 1, field output: empty response" in msg
    assert "Cannot find valid samples" not in msg


def test_streaming_without_max_steps_names_the_field(make_cfg, tiny_tokenizer, qwen):
    with pytest.raises(ConfigError, match="max_steps: streaming: true needs max_steps > 0"):
        build_datasets(make_cfg(streaming=True, max_steps=-1), tiny_tokenizer, qwen)


@pytest.mark.parametrize(
    "name,stage", [("dpo_en_demo", "dpo"), ("dpo_zh_demo", "rm"), ("kto_en_demo", "kto")]
)
def test_check_pairwise_and_kto_data(name, stage, make_cfg, tiny_tokenizer, qwen):
    report = check_data(make_cfg(dataset=name, stage=stage, cutoff_len=1024), tiny_tokenizer, qwen)
    (entry,) = report["datasets"]
    assert entry["problems"] == [] and entry["kept"] == entry["records"] > 0
    assert entry["trainable_tokens"] > 0 and entry["lengths"]["response"]["max"] > 0
    assert any(seg["trained"] for seg in report["example"]) and any(
        not seg["trained"] for seg in report["example"]
    )


def test_ranking_record_with_an_empty_answer_names_the_column():
    (attr,) = get_dataset_attrs("dpo_en_demo", DATA_DIR)
    record = dict(read_records(attr)[0].data, rejected=" ")
    with pytest.raises(RecordError) as err:
        convert(record, attr)
    assert (err.value.field, err.value.kind) == ("rejected", "empty response")
    (attr,) = get_dataset_attrs("dpo_zh_demo", DATA_DIR)
    record = dict(read_records(attr)[0].data)
    record.pop("chosen")
    with pytest.raises(RecordError) as err:
        convert(record, attr)
    assert (err.value.field, err.value.kind) == ("chosen", "missing field")


@pytest.mark.parametrize(
    "entry,match",
    [
        (
            {"file_name": "a.json", "num_samples": 0},
            r"\[x\]: num_samples: got 0; expected a positive whole number",
        ),
        ({"file_name": "a.json", "num_samples": "5"}, r"num_samples: got '5'"),
        (
            {"file_name": "a.json", "tags": {"role_tg": "r"}},
            r"tags: unknown key 'role_tg' \(did you mean 'role_tag'\?\)",
        ),
        ({"file_name": "a.json", "colums": {}}, r"unknown key 'colums' \(did you mean 'columns'\?\)"),
        ({"file_name": "a.json", "ranking": "yes"}, r"ranking: got 'yes'; expected true or false"),
        ({"file_name": "a.json", "formatting": "sharegtp"}, r"formatting: got 'sharegtp'; allowed: alpaca"),
        ({"file_name": "../a.json"}, r"points outside dataset_dir"),
        ({"file_name": "missing.json"}, r"no such file"),
    ],
)
def test_registry_entry_errors_name_the_key(entry, match, tmp_path):
    (tmp_path / "a.json").write_text("[]")
    (tmp_path / "dataset_info.json").write_text(json.dumps({"x": entry}))
    with pytest.raises(DataError, match=match):
        get_dataset_attrs("x", tmp_path)


def test_unknown_dataset_name_suggests_the_closest(tmp_path):
    with pytest.raises(
        DataError, match=r"dataset: 'alpaca_en_dem' is not in .*did you mean 'alpaca_en_demo'"
    ):
        get_dataset_attrs("alpaca_en_dem", DATA_DIR)


@pytest.mark.parametrize("suffix,kind", [("csv", "missing field"), ("parquet", "empty response")])
def test_table_files_report_row_positions(suffix, kind, tmp_path, make_cfg, tiny_tokenizer, qwen):
    """(an empty csv cell reads back as no value: missing field)"""
    import datasets

    rows = {"instruction": ["a", "b", "c"], "output": ["x", "", "z"]}
    table = datasets.Dataset.from_dict(rows)
    getattr(table, f"to_{suffix}")(str(tmp_path / f"t.{suffix}"))
    (tmp_path / "dataset_info.json").write_text(json.dumps({"t": {"file_name": f"t.{suffix}"}}))
    report = check_data(make_cfg(dataset="t", dataset_dir=str(tmp_path)), tiny_tokenizer, qwen)
    (entry,) = report["datasets"]
    assert entry["kept"] == 2
    assert [(p["position"], p["field"], p["kind"]) for p in entry["problems"]] == [("row 1", "output", kind)]


def test_folder_of_jsonl_files(tmp_path, make_cfg, tiny_tokenizer, qwen):
    (tmp_path / "parts").mkdir()
    for i in range(2):
        (tmp_path / "parts" / f"{i}.jsonl").write_text(
            json.dumps({"instruction": f"q{i}", "output": "a"}) + "\n"
        )
    (tmp_path / "dataset_info.json").write_text(json.dumps({"p": {"file_name": "parts"}}))
    data, (stats,) = load_split(
        make_cfg(dataset="p", dataset_dir=str(tmp_path)), "p", "dataset", tiny_tokenizer, qwen
    )
    assert stats.records == stats.kept == len(data) == 2
