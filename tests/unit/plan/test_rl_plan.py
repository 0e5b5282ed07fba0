"""The online-RL decisions of the run plan (plan.rl, plan/decide_rl.py) and their rules (plan/rules.py
rl_fields): recorded and printed, bad values and combinations refused naming the fix, fields a stage has
no use for noted."""

from __future__ import annotations

import pytest

from lmstack.config.errors import ConfigError
from lmstack.config.load import build_config
from lmstack.launch.context import LaunchContext
from lmstack.plan.rules import check_rules
from lmstack.plan.runplan import RunPlan


def plan(**fields) -> RunPlan:
    flat = {"model_name_or_path": "m", "output_dir": "o", "stage": "grpo", "reward_funcs": "format", **fields}
    return RunPlan.resolve(build_config(flat), LaunchContext())


def rules(p: RunPlan) -> tuple[list[str], list[str]]:
    return check_rules(p, launch=False)


def test_defaults_are_trls_and_are_recorded_and_printed():
    p = plan()
    rl = p.rl
    assert (rl.loss_type, rl.epsilon, rl.epsilon_high, rl.scale_rewards) == ("dapo", 0.2, 0.2, "group")
    assert (rl.importance_sampling_level, rl.mask_truncated_completions, rl.beta) == ("token", False, 0.1)
    assert rl.rewards == ("format",) and rl.reward_weights == (1.0,) and not rl.stale
    assert "the base model with the adapter disabled" in p.reasons["rl"] and "on-policy" in p.reasons["rl"]
    assert p.decisions()["rl"].startswith("dapo, clip 0.2, scale group, token ratio, beta 0.1")
    assert "rl " in p.describe() and p.to_dict()["decisions"]["rl"] == p.decisions()["rl"]
    assert "rl" not in plan(stage="sft", reward_funcs=None).decisions()  # only the RL stages have one


def test_every_knob_reaches_the_plan():
    p = plan(
        loss_type="dr_grpo",
        epsilon=0.1,
        epsilon_high=0.28,
        scale_rewards=False,  # TRL's boolean form: false = none
        mask_truncated_completions=True,
        importance_sampling_level="sequence",
        reward_funcs="accuracy,format,length",
        reward_weights="1, 0.5,0.25",
    )
    rl = p.rl
    assert (rl.loss_type, rl.epsilon, rl.epsilon_high, rl.scale_rewards) == ("dr_grpo", 0.1, 0.28, "none")
    assert rl.importance_sampling_level == "sequence" and rl.mask_truncated_completions
    assert rl.rewards == ("accuracy", "format", "length") and rl.reward_weights == (1.0, 0.5, 0.25)
    assert "clip 0.1/0.28" in p.decisions()["rl"] and "masks truncated" in p.decisions()["rl"]
    notes, problems = rules(p)
    assert not problems and any("GSPO's per-answer objective is loss_type: grpo" in n for n in notes)
    assert plan(reward_weights=[2]).rl.reward_weights == (2.0,)  # a YAML list
    assert plan(reward_weights=0.5).rl.reward_weights == (0.5,)  # one number for one reward


def test_kl_reference_follows_pref_beta_and_the_method():
    assert "pref_beta: 0, no KL term: no reference forward" in plan(pref_beta=0).reasons["rl"]
    assert plan(pref_beta=0).rl.reference == "none"
    assert plan(finetuning_type="full").rl.reference == "a frozen copy of m"
    assert "resumed adapter" in plan(adapter_name_or_path="a").rl.reference


@pytest.mark.parametrize(
    ("fields", "stale"),
    [
        ({}, False),
        ({"num_iterations": 2}, True),  # each rollout batch trained on twice: the second pass is off-policy
        ({"steps_per_generation": 2}, True),  # one rollout batch over two optimizer steps
        ({"steps_per_generation": 2, "gradient_accumulation_steps": 2}, False),  # both within one step
        ({"steps_per_generation": 1, "gradient_accumulation_steps": 2, "num_iterations": 2}, False),
    ],
)
def test_stale_rollouts_are_corrected_by_the_ratio(fields, stale):
    p = plan(**fields)
    assert p.rl.stale is stale
    assert ("the ratio to the sampling-time log-probs" in p.reasons["rl"]) is stale


def test_reward_weights_must_match_the_rewards():
    with pytest.raises(
        ConfigError, match=r"reward_weights: 1 weights for 2 rewards \(format, reward_model\)"
    ):
        plan(reward_model="rm_out", reward_weights="1")
    assert plan(reward_model="rm_out", reward_weights="1,2").rl.rewards == ("format", "reward_model")
    with pytest.raises(ConfigError, match="reward_weights.*'x' is not a number"):
        plan(reward_weights="1,x")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"loss_type": "ppo"}, "loss_type"),
        ({"epsilon": 0}, "epsilon"),
        ({"epsilon_high": -0.1}, "epsilon_high"),
        ({"scale_rewards": "std"}, "scale_rewards"),
        ({"importance_sampling_level": "answer"}, "importance_sampling_level"),
        ({"num_iterations": 0}, "num_iterations"),
        ({"pref_beta": -1}, "pref_beta"),
    ],
)
def test_bad_values_are_refused_by_name(fields, message):
    with pytest.raises(ConfigError, match=message):
        plan(**fields)


def test_rloo_refuses_grpo_only_knobs_and_records_its_own_loss():
    p = plan(stage="rloo", ppo_score_norm=True, epsilon_high=0.3)
    assert (p.rl.loss_type, p.rl.importance_sampling_level, p.rl.scale_rewards) == (
        "rloo",
        "sequence",
        "ppo_score_norm",
    )
    assert rules(p) == ([], [])
    notes, problems = rules(plan(stage="rloo", loss_type="dr_grpo"))
    assert problems == [
        "loss_type: dr_grpo is a stage grpo setting; RLOO's loss is its own (sequence-level ratio, averaged "
        "over answers; ppo_score_norm normalises its advantages): remove loss_type or use stage: grpo"
    ]


def test_other_stages_note_the_rl_knobs_and_dpo_refuses_beta_zero():
    notes, problems = rules(plan(stage="sft", reward_funcs=None, epsilon_high=0.28, num_iterations=2))
    assert not problems
    assert (
        "epsilon_high, num_iterations: no effect for stage sft (online-RL settings of stage grpo / rloo)"
        in notes
    )
    _, problems = rules(plan(stage="dpo", reward_funcs=None, pref_beta=0))
    assert problems and problems[0].startswith("pref_beta: 0 leaves stage dpo without a loss")


def test_format_reward_pattern_is_checked():
    _, problems = rules(plan(format_reward_pattern="(<think>"))
    assert problems and "format_reward_pattern: '(<think>' is not a regular expression" in problems[0]
    notes, _ = rules(plan(reward_funcs="length", format_reward_pattern="^x$"))
    assert "format_reward_pattern: no effect without `format` in reward_funcs" in notes


def test_pref_beta_on_ppo_is_a_note_not_a_silent_drop(base_cfg):
    from lmstack.config.load import build_config
    from lmstack.launch.context import LaunchContext
    from lmstack.plan.rules import rl_fields
    from lmstack.plan.runplan import RunPlan

    flat = {**base_cfg, "stage": "ppo", "reward_model": "rm_out", "pref_beta": 0.0}
    note = rl_fields(RunPlan.resolve(build_config(flat), LaunchContext(), resolve_auto=False))
    assert note and "pref_beta: 0.0 has no effect for stage ppo" in note
