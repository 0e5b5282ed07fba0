"""GRPO on the tiny model with the shipped rewards, several at once with weights, a reward model next to
reward functions: each reward's mean is logged (trainer_log.jsonl, trainer_state.json) and plotted, the
weighted sum is the reward the advantages use, and the dataset's answers reach the rewards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmstack.config.errors import ConfigError
from lmstack.train.run import train

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "stages"
ANSWERS = ["5", "3", "6 x 7 = \\boxed{42}", "48 + 24 = 72\n#### 72", "\\frac{5}{2}", "18", "2", "99"]


@pytest.fixture
def rewards_module(monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))
    import stage_rewards

    stage_rewards.SOLUTIONS_SEEN.clear()
    return stage_rewards


def grpo_run(base_cfg: dict, **over) -> dict:
    return {
        **base_cfg,
        "stage": "grpo",
        "dataset": "rl_math",
        "dataset_dir": str(FIXTURES),
        "cutoff_len": 64,
        "max_new_tokens": 8,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "per_device_train_batch_size": 8,
        "num_generations": 4,
        "max_steps": 3,
        "logging_steps": 1,
        "save_strategy": "no",
        "learning_rate": 1e-3,
        **over,
    }


def log_lines(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines() if line.strip()]


def test_weighted_shipped_rewards_are_logged_plotted_and_see_the_answers(base_cfg, rewards_module):
    run = grpo_run(
        base_cfg,
        reward_funcs="accuracy,length,stage_rewards:records_solutions",
        reward_weights="1,0.5,0",
        loss_type="dr_grpo",
        epsilon_high=0.28,
        pref_beta=0,
        plot_loss=True,
    )
    train(None, run)
    out = Path(run["output_dir"])
    lines = log_lines(out)
    steps = [ln for ln in lines if "loss" in ln]
    assert len(steps) == 3
    for ln in steps:
        acc, length = ln["rewards/accuracy/mean"], ln["rewards/length/mean"]
        assert 0 <= acc <= 1 and 0 <= length <= 1
        assert ln["rewards/records_solutions/mean"] == 0
        assert ln["reward"] == pytest.approx(acc + 0.5 * length, abs=1e-5)  # the weights apply
    for key in ("reward", "rewards_accuracy_mean", "rewards_length_mean", "loss"):
        assert (out / f"training_{key}.png").is_file(), key
    # every reference the rewards saw is a dataset answer, decoded back exactly
    assert rewards_module.SOLUTIONS_SEEN and set(rewards_module.SOLUTIONS_SEEN) <= set(ANSWERS)
    manifest = json.loads((out / "run_manifest.json").read_text())
    assert manifest["plan"]["decisions"]["rl"].startswith("dr_grpo, clip 0.2/0.28, scale group, token ratio")
    assert "no reference forward" in manifest["plan"]["reasons"]["rl"]


def test_accuracy_needs_answers_in_the_dataset(base_cfg):
    run = grpo_run(base_cfg, dataset="rl_prompts", reward_funcs="accuracy")
    with pytest.raises(ConfigError, match="reward_funcs: accuracy compares each answer with the dataset's"):
        train(None, run)
    with pytest.raises(ConfigError, match="stage ppo does not hand to its rewards"):
        train(None, {**run, "stage": "ppo"})


@pytest.fixture(scope="module")
def rm_dir(tiny_model, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("rm") / "out"
    train(
        None,
        {
            "model_name_or_path": str(tiny_model),
            "template": "qwen",
            "stage": "rm",
            "dataset": "dpo_en_demo",
            "dataset_dir": str(REPO / "data"),
            "cutoff_len": 64,
            "output_dir": str(out),
            "per_device_train_batch_size": 8,
            "max_steps": 2,
            "save_strategy": "no",
            "report_to": "none",
            "disable_tqdm": True,
        },
    )
    return out


def test_a_reward_model_and_functions_together(base_cfg, rm_dir):
    run = grpo_run(
        base_cfg, reward_funcs="length", reward_model=str(rm_dir), reward_weights="2,0.5", max_steps=2
    )
    train(None, run)
    steps = [ln for ln in log_lines(Path(run["output_dir"])) if "loss" in ln]
    assert len(steps) == 2
    for ln in steps:
        expected = 2 * ln["rewards/length/mean"] + 0.5 * ln["rewards/reward_model/mean"]
        assert ln["reward"] == pytest.approx(expected, abs=1e-4)


def test_grpo_trains_with_continuous_batching_rollouts(base_cfg):
    """The continuous-batching rollout engine (transformers' paged engine on the LoRA policy in place)
    samples every rollout of a real run: the loss stays finite, the rewards and the rollout speed are
    logged, and the run manifest records the engine and why."""
    run = grpo_run(base_cfg, reward_funcs="accuracy,length", max_steps=2, rollout_engine="continuous_batching")
    train(None, run)
    out = Path(run["output_dir"])
    steps = [ln for ln in log_lines(out) if "loss" in ln]
    assert len(steps) == 2
    for ln in steps:
        assert ln["loss"] == ln["loss"] and abs(ln["loss"]) < 1e6  # finite
        assert 0 <= ln["rewards/length/mean"] <= 1 and ln["rollout/tokens_per_sec"] > 0
    manifest = json.loads((out / "run_manifest.json").read_text())
    assert manifest["plan"]["decisions"]["rl"].endswith("rollouts continuous_batching")
    assert "paged KV cache" in manifest["plan"]["reasons"]["rl"]
