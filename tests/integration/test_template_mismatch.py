"""Another family's template on a model's tokenizer (llama3 on the tiny Qwen-style tokenizer) would add
its turn tokens as new, untrained tokens: `train` and `check` refuse it before the model loads and name
the template the tokenizer's own chat template matches, never resize_vocab; the named template trains."""

from __future__ import annotations

from pathlib import Path

import yaml

from cli_run import lmstack

REPO = Path(__file__).resolve().parents[2]




def test_another_familys_template_is_refused_naming_the_tokenizers_own(base_cfg, tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({**base_cfg, "template": "llama3", "max_steps": 1}))
    for command in ("train", "check"):
        done = lmstack(command, str(cfg), cwd=tmp_path)
        assert done.returncode == 2, done.stderr[-3000:]
        assert "template: llama3 does not fit the tokenizer of" in done.stderr
        assert "<|eot_id|>" in done.stderr
        assert "the tokenizer's own chat template is template qwen" in done.stderr
        assert "set template: qwen" in done.stderr
        assert "resize_vocab" not in done.stderr  # it would train random embeddings for llama3's tokens
        assert "Loading weights" not in done.stderr and "Traceback" not in done.stderr
    assert not Path(base_cfg["output_dir"]).exists()
    fixed = lmstack("train", str(cfg), "template=qwen", cwd=tmp_path)  # the advice, followed
    assert fixed.returncode == 0, fixed.stderr[-3000:]


def test_the_match_follows_the_tokenizers_chat_template(tiny_tokenizer):
    """The same tokenizer with a Llama 3 chat template matches llama3 (and llama3 then fits it once the
    tokens exist), so the name comes from the rendering, not from the vocabulary."""
    import copy

    from lmstack.templates import get_template
    from lmstack.templates.match import matching_templates, mismatch

    assert matching_templates(tiny_tokenizer, "qwen2")[0] == "qwen"
    llama = copy.deepcopy(tiny_tokenizer)
    llama.add_special_tokens(
        {"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]},
        replace_extra_special_tokens=False,
    )
    llama.chat_template = (
        "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
        "{{ m['content'] }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    )
    assert "llama3" in matching_templates(llama, "llama")
    # <|eom_id|> is missing, but llama3 is this tokenizer's own template: added as LF adds it
    assert mismatch(llama, get_template("llama3"), "m", "llama") is None
    # a template whose tokens the tokenizer has is not refused: only new, untrained tokens are
    assert mismatch(llama, get_template("qwen"), "m", "llama") is None
