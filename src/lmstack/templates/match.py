"""Which built-in template a tokenizer's own chat template is, and whether a configured template fits.

A template that adds its end-of-turn or stop words to the tokenizer as new tokens (llama3's <|eot_id|>
on a Qwen tokenizer) is another model family's: those tokens would be trained from random embeddings
(LF only warns, and resize_vocab "fixes" it by training them). The fix is the model's own template, so
`mismatch` names it: the built-in templates whose rendering of a probe conversation equals the
tokenizer's `apply_chat_template` rendering of it (with a system prompt, and without one so the default
system prompt counts too).
"""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

from lmstack.templates.builtin import builtin_template, list_templates
from lmstack.templates.template import Template

PROBES = (
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "2+2?"},
    ],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "2+2?"},
    ],
)


def new_tokens(tokenizer: Any, template: Template) -> list[str]:
    """The tokens `template.fix_tokenizer` would add to `tokenizer`'s vocabulary (its EOS replacement and
    stop words the tokenizer lacks), without changing the tokenizer."""
    vocab = tokenizer.get_vocab()
    return [w for w in dict.fromkeys(template.stop_words) if w not in vocab]


def _tokenizer_text(tokenizer: Any, messages: list[dict]) -> str | None:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception:  # a chat template that refuses the probe (no system role, ...): no comparison
        return None


def _template_text(tokenizer: Any, template: Template, messages: list[dict]) -> str | None:
    eos = template.stop_words[0] if template.replace_eos and template.stop_words else tokenizer.eos_token
    specials = SimpleNamespace(bos_token=tokenizer.bos_token, eos_token=eos)  # as after fix_tokenizer
    system = messages[0]["content"] if messages[0]["role"] == "system" else None
    try:
        return template.render(messages[1:] if system else messages, system, specials)
    except Exception:  # a template that cannot render the probe (e.g. no system slot): no match
        return None


def _multimodal(template: Template) -> bool:
    text = template.description.lower()
    return bool(template.mm_plugin) or any(w in text for w in ("image", "video", "audio", "vision"))


def matching_templates(tokenizer: Any, family: str = "") -> list[str]:
    """Built-in templates that render the probe with a system prompt as the tokenizer's own chat template
    does; [] when the tokenizer has no chat template or none matches. Best first: a name of the model's
    `family` (its model_type or path: qwen2 -> qwen...), text-only, matching the probe without a system
    prompt too (the same default system prompt), then by name."""
    if not isinstance(getattr(tokenizer, "chat_template", None), str):
        return []
    wanted = [_tokenizer_text(tokenizer, p) for p in PROBES]
    if wanted[0] is None:
        return []
    hint = f"{family} {getattr(tokenizer, 'name_or_path', '')}".lower()
    ranked = []
    for name in list_templates():
        template = builtin_template(name)
        texts = [_template_text(tokenizer, template, p) for p in PROBES]
        if texts[0] != wanted[0]:
            continue
        stem = re.match(r"[a-z]+", name)
        ranked.append(
            (not (stem and stem.group(0) in hint), _multimodal(template), texts[1] != wanted[1], name)
        )
    return [key[-1] for key in sorted(ranked)]


def mismatch(tokenizer: Any, template: Template, where: str, family: str = "") -> str | None:
    """Why `template` does not fit `tokenizer` (of model folder/id `where`), naming the template that
    does; None when it adds no token, or when it is the tokenizer's own (a newer stop word the model's
    vocabulary lacks, e.g. <|eom_id|> on Llama 3.0, is added as LF adds it)."""
    added = new_tokens(tokenizer, template)
    if not added:
        return None
    matches = matching_templates(tokenizer, family)
    if template.name in matches:
        return None
    head = (
        f"template: {template.name} does not fit the tokenizer of {where}: it would add "
        f"{', '.join(added)} as new tokens, which the model has never seen (their embeddings would start "
        "random); "
    )
    if matches:
        also = f" (also matching: {', '.join(matches[1:4])})" if len(matches) > 1 else ""
        return (
            head
            + f"the tokenizer's own chat template is template {matches[0]}{also}: set template: {matches[0]}"
        )
    if isinstance(getattr(tokenizer, "chat_template", None), str):
        return head + (
            "its own chat template matches no built-in template: leave template unset to train with the "
            "tokenizer's own chat template, or set the template of the model's family (lmstack train --help "
            "lists them)"
        )
    return head + (
        "the tokenizer has no chat template to compare with: set the template of the model's family, one "
        "whose special tokens this tokenizer has (lmstack train --help lists them)"
    )
