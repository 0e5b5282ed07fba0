"""A tokenizer file for the config-only model folders of the planner tests."""

from __future__ import annotations


def write_chatml_tokenizer(folder) -> None:
    """A loadable word-level tokenizer.json carrying Qwen's ChatML special tokens: `lmstack check` loads
    the tokenizer to test the template against it, so the config-only model folders need a real one."""
    from tokenizers import AddedToken, Tokenizer
    from tokenizers.models import WordLevel

    tokenizer = Tokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>"))
    specials = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in specials])
    tokenizer.save(str(folder / "tokenizer.json"))
