"""The YAML's `template` and `thinking_style` reach the template a run encodes with; every
LLaMA-Factory template name loads through the config; unknown names are refused with a suggestion."""

from __future__ import annotations

import pytest

from lmstack.config.errors import ConfigError
from lmstack.config.load import load_config
from lmstack.templates import list_templates
from lmstack.train.common import tokenizer_and_template

LF_SINCE_2024 = [  # the families the issue lists, by LLaMA-Factory's names
    "qwen3_5", "qwen3_5_nothink", "qwen3_6", "qwen3", "qwen3_nothink", "qwen3_vl", "qwen3_vl_nothink", "llama4",
    "gemma2", "gemma3", "gemma3n", "gemma4", "phi4", "phi4_mini", "mistral_small", "ministral3", "deepseek",
    "deepseek3", "deepseekr1", "glm4", "glm4_moe", "glm4_7", "minimax1", "minimax2", "kimi_vl", "moonlight",
    "hunyuan", "hunyuan_small", "hy3", "ernie", "ernie_nothink", "seed_oss", "seed_coder", "gpt_oss", "intern2",
    "intern_s1", "olmo", "cohere", "granite3", "granite4", "yi", "exaone", "bailing", "bailing_v2", "falcon_h1",
    "smollm", "smollm2", "mimo", "mimo_v2", "lfm2", "youtu", "aeva",
]  # fmt: skip


def test_every_listed_family_is_shipped():
    assert set(LF_SINCE_2024) <= set(list_templates())


@pytest.mark.parametrize("name", list_templates())
def test_template_name_loads_from_the_config(base_cfg, name):
    cfg = load_config(None, {**base_cfg, "template": name})
    _, template = tokenizer_and_template(cfg)
    assert template.name == name


@pytest.mark.parametrize("style", ["llamafactory", "inference"])
def test_thinking_style_reaches_the_template(base_cfg, style):
    cfg = load_config(None, {**base_cfg, "template": "qwen3", "thinking_style": style})
    tokenizer, template = tokenizer_and_template(cfg)
    assert template.thinking_style == style
    cot = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4."},
        {"role": "user", "content": "3+3?"},
        {"role": "assistant", "content": "6."},
    ]
    kept = "<think>\nadd\n</think>" in template.render(cot, None, tokenizer)
    assert kept == (style == "llamafactory")  # LF keeps history thoughts in training rows


def test_unknown_template_and_style_are_refused(base_cfg):
    with pytest.raises(ConfigError, match=r"template: got 'qwen35'.*did you mean"):
        tokenizer_and_template(load_config(None, {**base_cfg, "template": "qwen35"}))
    with pytest.raises(ConfigError, match="thinking_style"):
        load_config(None, {**base_cfg, "thinking_style": "lmstack"})
