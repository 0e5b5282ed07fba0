"""The shipped rewards (reward_funcs: accuracy | format | length) on fixed strings, and how reward_funcs
names them."""

from __future__ import annotations

import pytest

from lmstack.config.errors import ConfigError
from lmstack.config.load import build_config
from lmstack.train import rewards
from lmstack.train.rewards import accuracy, answers_equal, extract_answer, reference_answer


@pytest.mark.parametrize(
    ("completion", "final"),
    [
        (r"First 2+2=4, so the total is \boxed{12}.", "12"),
        (r"\boxed{\frac{1}{2}} and later \boxed{\dfrac{3}{4}}", r"\dfrac{3}{4}"),
        (r"nested \boxed{\sqrt{x^{2}}} here", r"\sqrt{x^{2}}"),
        ("<think>7 or 8?</think><answer>8</answer>", "8"),
        (r"<answer>so \boxed{5}</answer>", "5"),
        ("Natalia sold 48 clips, then 24. #### 72", "72"),
        ("She has 3 apples and buys 1,250 more.", "1,250"),
        ("no digits at all", None),
        (r"cut off \boxed{12", None),  # unbalanced: the answer did not finish
    ],
)
def test_the_final_result_is_extracted(completion, final):
    assert extract_answer(completion) == final


@pytest.mark.parametrize(
    ("solution", "reference"),
    [
        ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "72"),
        (r"The sum is $\boxed{\frac{7}{2}}$.", r"\frac{7}{2}"),
        ("42", "42"),
        (r"\frac{1}{3}", r"\frac{1}{3}"),
        ("", None),
    ],
)
def test_the_reference_comes_from_the_dataset_answer(solution, reference):
    assert reference_answer(solution) == reference


@pytest.mark.parametrize(
    ("predicted", "reference", "equal"),
    [
        ("72", "72", True),
        ("72.0", "72", True),
        ("1,234", "1234", True),
        ("$18", "18", True),
        ("50%", "50", True),
        (r"\frac{1}{2}", "0.5", True),
        (r"\dfrac{6}{8}", "3/4", True),
        ("-3", "3", False),
        ("0.333", r"\frac{1}{3}", False),  # exact or within 1e-6, not rounded
        (r"2\sqrt{2}", r"\sqrt{8}", True),  # symbolic
        ("x^2+2x+1", "(x+1)^2", True),
        ("x^2+1", "(x+1)^2", False),
        ("(1, 2)", "(1,2)", True),
        ("(2, 1)", "(1, 2)", False),
        (r"\text{yes}", "Yes", True),
        ("9^9^9", "1", False),  # refused before sympy (would never finish)
        ("__import__('os')", "0", False),  # never reaches the parser
        (None, "1", False),
    ],
)
def test_answers_compare_as_numbers_then_expressions_then_text(predicted, reference, equal):
    assert answers_equal(predicted, reference) is equal


def test_accuracy_reward_on_completions_and_solutions():
    completions = [r"so \boxed{72}", "I think 71", "<answer>3/4</answer>", "anything"]
    solutions = ["#### 72", "#### 72", r"\frac{3}{4}", ""]
    got = accuracy(prompts=[""] * 4, completions=completions, completion_ids=[[]] * 4, solution=solutions)
    assert got == [1.0, 0.0, 1.0, None]  # None: no reference, TRL leaves the answer out of this reward
    conversational = [[{"role": "assistant", "content": r"\boxed{72}"}]]
    assert accuracy([""], conversational, [[]], solution=["72"]) == [1.0]


def _cfg(**fields):
    return build_config({"model_name_or_path": "m", "output_dir": "o", "stage": "grpo", **fields})


def test_format_reward_default_pattern_and_custom_pattern():
    fmt = rewards.shipped_reward("format", _cfg())
    assert fmt.__name__ == "format"  # TRL logs rewards/format/mean
    texts = [
        "<think>a</think><answer>b</answer>",
        "  <think>multi\nline</think>\n<answer>42</answer>\n",
        "<answer>b</answer>",
        "<think>a</think><answer>b</answer> trailing",
    ]
    assert fmt([""] * 4, texts, [[]] * 4) == [1.0, 1.0, 0.0, 0.0]
    custom = rewards.shipped_reward("format", _cfg(format_reward_pattern=r"^Answer: \d+$"))
    assert custom([""] * 2, ["Answer: 7", "answer 7"], [[]] * 2) == [1.0, 0.0]


def test_length_reward_scales_with_max_new_tokens():
    length = rewards.shipped_reward("length", _cfg(max_new_tokens=8))
    assert length.__name__ == "length"
    assert length([""] * 3, ["", "", ""], [[], [1, 2], list(range(8))]) == [1.0, 0.75, 0.0]


def test_reward_funcs_names_shipped_rewards_and_refuses_unknown_names():
    from lmstack.train.rlhf import reward_functions

    funcs = reward_functions(_cfg(reward_funcs="accuracy, format,length"))
    assert [f.__name__ for f in funcs] == ["accuracy", "format", "length"]
    with pytest.raises(
        ConfigError, match=r"'acuracy' is neither a shipped reward \(accuracy \| format \| length\)"
    ):
        reward_functions(_cfg(reward_funcs="acuracy"))
