"""num_samples, mix_strategy / interleave_probs, val_size, streaming, TokenizedDataset select/concat."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from _data_helpers import BAD_DIR, DATA_DIR

from lmstack.config.errors import ConfigError, DataError
from lmstack.data.mix import interleave_order, parse_probs
from lmstack.data.pipeline import build_datasets, load_split
from lmstack.data.tokenized import TokenizedDataset


def numbered_dir(tmp_path, sizes: dict[str, int], **entry_extra) -> str:
    """A dataset_dir with alpaca datasets whose answers say which dataset/record they are."""
    info = {}
    for name, n in sizes.items():
        records = [{"instruction": f"{name} {i}", "output": f"{name}-{i}"} for i in range(n)]
        (tmp_path / f"{name}.json").write_text(json.dumps(records))
        info[name] = {"file_name": f"{name}.json", **entry_extra.get(name, {})}
    (tmp_path / "dataset_info.json").write_text(json.dumps(info))
    return str(tmp_path)


def answers(tokenizer, data) -> list[str]:
    return [
        tokenizer.decode([t for t in data[i]["labels"] if t != -100]).split("<")[0] for i in range(len(data))
    ]


def test_num_samples_draws_and_oversamples_seeded(tmp_path, make_cfg, tiny_tokenizer, qwen):
    d = numbered_dir(tmp_path, {"a": 5, "b": 4}, a={"num_samples": 3}, b={"num_samples": 10})
    cfg = make_cfg(dataset="a", dataset_dir=d)
    got = answers(tiny_tokenizer, load_split(cfg, "a", "dataset", tiny_tokenizer, qwen)[0])
    assert len(got) == 3 and len(set(got)) == 3  # without replacement when smaller
    again = answers(tiny_tokenizer, load_split(cfg, "a", "dataset", tiny_tokenizer, qwen)[0])
    assert again == got  # seeded
    other_seed = make_cfg(dataset="a", dataset_dir=d, seed=7)
    draws = {
        tuple(
            answers(
                tiny_tokenizer,
                load_split(
                    make_cfg(dataset="a", dataset_dir=d, seed=s), "a", "dataset", tiny_tokenizer, qwen
                )[0],
            )
        )
        for s in range(6)
    }
    assert len(draws) > 1 and other_seed.training.seed == 7
    got = answers(
        tiny_tokenizer,
        load_split(make_cfg(dataset="b", dataset_dir=d), "b", "dataset", tiny_tokenizer, qwen)[0],
    )
    assert len(got) == 10 and set(got) == {f"b-{i}" for i in range(4)}  # every record, then repeats


@pytest.mark.parametrize(
    "strategy,expected",
    [
        ("concat", ["a-0", "a-1", "b-0", "b-1", "b-2", "b-3", "b-4"]),
        ("interleave_under", ["a-0", "b-0", "a-1", "b-1"]),
        ("interleave_over", ["a-0", "b-0", "a-1", "b-1", "a-0", "b-2", "a-1", "b-3", "a-0", "b-4"]),
    ],
)
def test_mix_strategies(strategy, expected, tmp_path, make_cfg, tiny_tokenizer, qwen):
    d = numbered_dir(tmp_path, {"a": 2, "b": 5})
    cfg = make_cfg(dataset="a,b", dataset_dir=d, mix_strategy=strategy)
    data, _ = load_split(cfg, "a,b", "dataset", tiny_tokenizer, qwen)
    assert answers(tiny_tokenizer, data) == expected


def test_interleave_probs_are_followed_and_seeded():
    order = interleave_order([1000, 1000], "interleave_under", [0.8, 0.2], seed=0)
    share = np.mean([d == 0 for d, _ in order])
    assert 0.75 < share < 0.85
    assert order == interleave_order([1000, 1000], "interleave_under", [0.8, 0.2], seed=0)
    assert order != interleave_order([1000, 1000], "interleave_under", [0.8, 0.2], seed=1)
    over = interleave_order([3, 50], "interleave_over", [0.5, 0.5], seed=0)
    assert {i for d, i in over if d == 1} == set(range(50)) and {i for d, i in over if d == 0} == {0, 1, 2}


@pytest.mark.parametrize(
    "raw,strategy,match",
    [
        ("0.5", "interleave_under", "got 1 probabilities for 2 datasets"),
        ("0.5,0.6", "interleave_under", "must be >= 0 and sum to 1"),
        ("a,b", "interleave_over", "expected numbers"),
        ("1,0", "interleave_over", "never uses that dataset up"),
    ],
)
def test_interleave_probs_errors_name_the_field(raw, strategy, match):
    with pytest.raises(ConfigError, match=f"interleave_probs: .*{match}"):
        parse_probs(raw, 2, strategy)
    assert parse_probs("0.25,0.75", 2, "interleave_under") == [0.25, 0.75]
    assert parse_probs([0.5, 0.5], 2, "concat") is None


def test_mix_strategy_typo_is_a_config_error(make_cfg):
    with pytest.raises(ConfigError, match="mix_strategy: got 'interleave'; allowed: concat"):
        make_cfg(mix_strategy="interleave")


def test_val_size_fraction_and_count(make_cfg, tiny_tokenizer, qwen):
    bundle = build_datasets(make_cfg(dataset="identity", val_size=0.25), tiny_tokenizer, qwen)
    assert (len(bundle.train), len(bundle.eval)) == (15, 5)
    bundle = build_datasets(make_cfg(dataset="identity", val_size=3), tiny_tokenizer, qwen)
    assert (len(bundle.train), len(bundle.eval)) == (17, 3)
    with pytest.raises(DataError, match="val_size: 20.0 leaves no training record"):
        build_datasets(make_cfg(dataset="identity", val_size=20), tiny_tokenizer, qwen)


def test_eval_dataset_is_loaded_separately(make_cfg, tiny_tokenizer, qwen):
    bundle = build_datasets(make_cfg(dataset="identity", eval_dataset="alpaca_en_demo"), tiny_tokenizer, qwen)
    assert (len(bundle.train), len(bundle.eval)) == (20, 60)
    with pytest.raises(ConfigError, match="val_size and eval_dataset: set only one"):
        build_datasets(
            make_cfg(dataset="identity", eval_dataset="identity", val_size=0.1), tiny_tokenizer, qwen
        )


def test_max_samples_keeps_the_first_records(tmp_path, make_cfg, tiny_tokenizer, qwen):
    d = numbered_dir(tmp_path, {"a": 6})
    data, (stats,) = load_split(
        make_cfg(dataset="a", dataset_dir=d, max_samples=2), "a", "dataset", tiny_tokenizer, qwen
    )
    assert answers(tiny_tokenizer, data) == ["a-0", "a-1"] and stats.records == 2


def test_streaming_tokenizes_lazily_and_counts_drops(tmp_path, make_cfg, tiny_tokenizer, qwen):
    shutil.copytree(DATA_DIR, tmp_path / "d")
    bad = json.loads((tmp_path / "d" / "identity.json").read_text())
    bad[3] = {"instruction": "no answer"}
    (tmp_path / "d" / "identity.json").write_text(json.dumps(bad))
    cfg = make_cfg(
        dataset="identity,alpaca_en_demo", dataset_dir=str(tmp_path / "d"), streaming=True, buffer_size=8
    )
    bundle = build_datasets(cfg, tiny_tokenizer, qwen)
    stream = bundle.train
    assert not hasattr(stream, "__len__")
    first = list(stream)
    assert len(first) == 79
    assert stream.stats[0].dropped == {"missing field": 1}
    assert stream.stats[0].problems[0]["position"] == "record 3"
    second = list(stream)
    assert sorted(map(str, first)) == sorted(map(str, second)) and first != second  # reshuffled per pass
    import torch.utils.data

    loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=2)
    assert sorted(map(str, loader)) == sorted(map(str, first))  # workers split the stream, no duplicates
    with pytest.raises(ConfigError, match="max_samples: not available with streaming"):
        build_datasets(make_cfg(streaming=True, max_samples=4), tiny_tokenizer, qwen)


def test_tokenized_dataset_select_concat_and_generic_columns():
    samples = [
        {"input_ids": [1, 2, 3], "labels": [-100, 2, 3], "kto_tag": True},
        {"input_ids": [4], "labels": [4], "kto_tag": False},
        {"input_ids": [5, 6], "labels": [-100, -100], "kto_tag": True},
    ]
    ds = TokenizedDataset.from_samples(samples)
    assert [ds[i] for i in range(3)] == samples and ds.trainable_tokens() == 3
    assert ds.select([2, 0, 0]).to_samples() == [samples[2], samples[0], samples[0]]
    both = TokenizedDataset.concat([ds, ds.select([1])])
    assert both.to_samples() == samples + [samples[1]] and list(both.lengths()) == [3, 1, 2, 1]
    pairs = TokenizedDataset.from_samples([{"chosen_input_ids": [1, 2], "chosen_labels": [-100, 2]}])
    assert (
        pairs[0] == {"chosen_input_ids": [1, 2], "chosen_labels": [-100, 2]} and pairs.trainable_tokens() == 1
    )


def test_worker_pool_gives_the_same_samples_and_problem_positions(make_cfg, tiny_tokenizer, qwen):
    from lmstack.data.pipeline import encode_options, encode_records, read_limited
    from lmstack.data.registry import get_dataset_attrs

    cfg = make_cfg(dataset="bad_sharegpt", dataset_dir=str(BAD_DIR))
    (attr,) = get_dataset_attrs("bad_sharegpt", BAD_DIR)
    records = read_limited(attr, None) * 5  # 60 records, 10 problems repeated
    one, s1 = encode_records(records, attr, tiny_tokenizer, qwen, encode_options(cfg), workers=1)
    two, s2 = encode_records(
        records, attr, tiny_tokenizer, qwen, encode_options(cfg), workers=2, batch_size=7
    )
    assert one.to_samples() == two.to_samples() and len(one) == 10
    assert s1.to_dict() == s2.to_dict() and sum(s2.dropped.values()) == 50


def test_tokenized_path_saves_then_loads_only_for_the_same_inputs(
    tmp_path, make_cfg, tiny_tokenizer, qwen, caplog
):
    import logging

    path = tmp_path / "tok"
    same = make_cfg(dataset="identity", val_size=4, tokenized_path=str(path))
    first = build_datasets(same, tiny_tokenizer, qwen)
    assert (path / "COMPLETE").is_file() and not list(tmp_path.glob(".tok.tmp-*"))
    with caplog.at_level(logging.INFO, logger="lmstack.data"):
        again = build_datasets(same, tiny_tokenizer, qwen)
    assert again.train.to_samples() == first.train.to_samples() and len(again.eval) == 4
    assert f"loaded {len(first.train)} training samples and 4 eval samples from {path}" in caplog.text
    with pytest.raises(DataError, match=r"from other inputs .*datasets: 'identity' -> 'alpaca_en_demo'"):
        build_datasets(make_cfg(dataset="alpaca_en_demo", tokenized_path=str(path)), tiny_tokenizer, qwen)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "train").mkdir()
    with pytest.raises(DataError, match=r"tokenized_path: .* \(no COMPLETE marker\)"):
        build_datasets(make_cfg(dataset="identity", tokenized_path=str(broken)), tiny_tokenizer, qwen)
