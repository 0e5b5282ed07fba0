"""`check_data` for stage pt trained packed: long texts are split into cutoff_len pieces exactly as
train/pt.py splits them (same counts, same trainable tokens), and nothing is reported as truncated."""

from __future__ import annotations

import pytest

from lmstack.data.pipeline import build_datasets
from lmstack.data.validate import check_data, format_report

CUTOFF = 64


def test_pt_split_report_matches_what_pt_training_trains(make_cfg, tiny_tokenizer, qwen):
    from lmstack.launch.context import LaunchContext
    from lmstack.plan.runplan import RunPlan
    from lmstack.train.stage_data import encode_config, split_long_texts

    cfg = make_cfg(stage="pt", dataset="c4_demo", eval_dataset="wiki_zh_demo", cutoff_len=CUTOFF)
    plan = RunPlan.resolve(cfg, LaunchContext())
    assert plan.split_long_texts  # what `lmstack check` passes as pt_split
    report = check_data(cfg, tiny_tokenizer, qwen, pt_split=plan.split_long_texts)
    train_entry, eval_entry = report["datasets"]

    bundle = build_datasets(encode_config(plan), tiny_tokenizer, qwen)  # what pt training encodes
    for entry, whole in ((train_entry, bundle.train), (eval_entry, bundle.eval)):
        pieces = split_long_texts(whole, CUTOFF, entry["split"])
        assert entry["truncated"] == 0
        assert entry["pieces"] == len(pieces) > entry["kept"] == len(whole)
        assert entry["split_texts"] == int((whole.lengths() > CUTOFF).sum()) > 0
        assert entry["trainable_tokens"] == pieces.trainable_tokens() == whole.trainable_tokens()
        assert entry["lengths"]["total"]["max"] == int(whole.lengths().max()) > CUTOFF
    totals = report["totals"]
    assert totals["truncated"] == 0
    assert totals["pieces"] == train_entry["pieces"] + eval_entry["pieces"]
    assert totals["split_texts"] == train_entry["split_texts"] + eval_entry["split_texts"]
    first_piece = bundle.train[0]["input_ids"][:CUTOFF]  # the example is one piece, all of it trained
    assert len(bundle.train[0]["input_ids"]) > CUTOFF
    assert [seg["trained"] for seg in report["example"]] == [True]
    assert report["example"][0]["text"] == tiny_tokenizer.decode(first_piece, skip_special_tokens=False)

    text = format_report(report)
    assert "not truncated" in text.splitlines()[0]
    assert (
        f"c4_demo (dataset): {train_entry['records']} records, {train_entry['kept']} kept, 0 dropped, "
        f"0 truncated, {train_entry['split_texts']} split ({train_entry['kept']} texts -> "
        f"{train_entry['pieces']} pieces), {train_entry['trainable_tokens']} trainable tokens"
    ) in text
    assert f"{totals['pieces']} pieces), {totals['trainable_tokens']} trainable tokens" in text

    # without pt_split (pt with packing: false) the same texts are cut to cutoff_len
    plain = check_data(cfg, tiny_tokenizer, qwen)
    assert plain["totals"]["truncated"] == totals["split_texts"]
    assert plain["totals"]["trainable_tokens"] < totals["trainable_tokens"]
    assert "pieces" not in plain["totals"] and "pieces" not in plain["datasets"][0]


def test_pt_split_is_refused_for_other_stages(make_cfg, tiny_tokenizer, qwen):
    with pytest.raises(ValueError, match="pt_split is for stage pt, not sft"):
        check_data(make_cfg(), tiny_tokenizer, qwen, pt_split=True)
