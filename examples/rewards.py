"""Example reward functions for `stage: grpo` / `stage: ppo` (`reward_funcs: examples/rewards.py:polite`).

A reward function gets the rendered prompts, the decoded answers and their token ids, and returns one
float per answer: f(prompts=[...], completions=[...], completion_ids=[...], **kwargs) -> list[float].
"""


def polite(prompts, completions, completion_ids, **kwargs):
    """+1 for an answer that ends with a period and has no shouting (ALL CAPS words), else 0."""
    scores = []
    for text in completions:
        words = [w for w in text.split() if len(w) > 2]
        shouting = any(w.isupper() for w in words)
        scores.append(float(text.strip().endswith(".") and not shouting))
    return scores


def short(prompts, completions, completion_ids, **kwargs):
    """Shorter answers score higher: 1 / (1 + tokens)."""
    return [1.0 / (1.0 + len(ids)) for ids in completion_ids]
