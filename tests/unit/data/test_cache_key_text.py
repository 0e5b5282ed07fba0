"""key.json, the text of a tokenized-cache entry's inputs, masks token-like values as every file
lmstack writes does; the entry's digest still tells two such values apart."""

from __future__ import annotations

from pathlib import Path

from lmstack.data.cache import cache_root
from lmstack.data.pipeline import load_split

DATA = Path(__file__).resolve().parents[3] / "data"


def test_a_token_in_default_system_is_masked_in_key_json_and_still_keys_the_entry(
    make_cfg, tiny_tokenizer, qwen
):
    tokens = ["hf_AbCdEf0123456789xyz", "hf_ZyXwVu9876543210abc"]
    before = set(cache_root().glob("*/key.json"))
    for token in tokens:
        cfg = make_cfg(
            dataset="alpaca_en_demo", dataset_dir=str(DATA), max_samples=4, default_system=f"key {token}"
        )
        load_split(cfg, "alpaca_en_demo", "dataset", tiny_tokenizer, qwen)
    written = set(cache_root().glob("*/key.json")) - before
    assert len(written) == 2  # one entry each: the digest is over the real values
    for key_file in written:
        text = key_file.read_text()
        assert "key ***" in text and not any(t in text for t in tokens)
