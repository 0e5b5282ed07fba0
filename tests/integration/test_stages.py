"""Every training stage on the tiny model (CPU, offline): it runs, learns its toy task, writes its
outputs, and the outputs load back. Also the stage/field conflict rules and the example YAMLs."""

from __future__ import annotations

import collections
import gc
import json
import logging
from pathlib import Path

import pytest
import torch

from lmstack.config.errors import ConfigError
from lmstack.config.load import build_config
from lmstack.train.run import train

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "data"
FIXTURES = REPO / "tests" / "fixtures" / "stages"


def history(out: Path) -> list[dict]:
    return json.loads((out / "trainer_state.json").read_text())["log_history"]


def series(out: Path, key: str) -> list[float]:
    return [h[key] for h in history(out) if key in h]


@pytest.fixture
def cfg(base_cfg, tmp_path) -> dict:
    return {**base_cfg, "cutoff_len": 64, "logging_steps": 1, "save_steps": 100, "lora_rank": 8}


# ---- pt -----------------------------------------------------------------------------------------
def test_pt_packs_text_and_loss_falls(cfg, caplog):
    run = {
        **cfg,
        "stage": "pt",
        "dataset": "c4_demo",
        "max_steps": 10,
        "learning_rate": 3e-2,
        "per_device_train_batch_size": 8,
        "lr_scheduler_type": "constant",
    }
    with caplog.at_level(logging.INFO, logger="lmstack"):
        train(None, run)
    out = Path(run["output_dir"])
    split = [r.message for r in caplog.records if "pieces of at most cutoff_len=64" in r.message]
    assert split and "none dropped" in split[0]
    packed = [r.message for r in caplog.records if "attention never crosses samples" in r.message]
    assert packed, [r.message for r in caplog.records]
    losses = series(out, "loss")
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.3, losses
    assert (out / "adapter_model.safetensors").is_file()
    from peft import AutoPeftModelForCausalLM

    model = AutoPeftModelForCausalLM.from_pretrained(out)
    assert model(torch.tensor([[1, 2, 3]])).logits.shape[-1] >= 1024


# ---- rm -----------------------------------------------------------------------------------------
def rm_run(tiny_model, out: Path, **over) -> dict:
    """The reward-model LoRA run both rm tests use (10 steps, checkpoints every 5)."""
    return {
        "model_name_or_path": str(tiny_model),
        "template": "qwen",
        "stage": "rm",
        "finetuning_type": "lora",
        "dataset": "dpo_en_demo",
        "dataset_dir": str(DATA),
        "cutoff_len": 64,
        "output_dir": str(out),
        "per_device_train_batch_size": 8,
        "learning_rate": 1e-2,
        "max_steps": 10,
        "save_steps": 5,
        "logging_steps": 1,
        "report_to": "none",
        "disable_tqdm": True,
        "seed": 0,
        **over,
    }


@pytest.fixture(scope="module")
def rm_dir(tiny_model, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("rm") / "out"
    train(None, rm_run(tiny_model, out))
    return out


def pair_rows(tiny_model) -> list[dict]:
    from lmstack.data.pipeline import build_datasets
    from lmstack.models.load import load_tokenizer
    from lmstack.templates import get_template

    c = build_config(
        {
            "model_name_or_path": str(tiny_model),
            "template": "qwen",
            "stage": "rm",
            "dataset": "dpo_en_demo",
            "dataset_dir": str(DATA),
            "cutoff_len": 64,
            "output_dir": "unused",
        }
    )
    tok = load_tokenizer(c)
    template = get_template("qwen", tok)
    template.fix_tokenizer(tok)
    return build_datasets(c, tok, template).train.to_samples()


def test_rm_learns_a_separable_preference_and_reloads(rm_dir, tiny_model):
    from lmstack.models.value_head import load_reward_model

    for d in (rm_dir, rm_dir / "checkpoint-5", rm_dir / "checkpoint-10"):
        assert (d / "value_head.safetensors").is_file(), d
        assert (d / "adapter_model.safetensors").is_file(), d
    rm = load_reward_model(rm_dir)
    rows = pair_rows(tiny_model)
    chosen = rm.score_ids([r["chosen_input_ids"] for r in rows])
    rejected = rm.score_ids([r["rejected_input_ids"] for r in rows])
    accuracy = sum(c > r for c, r in zip(chosen, rejected)) / len(rows)
    assert accuracy >= 0.8, accuracy  # chance is 0.5
    assert series(rm_dir, "accuracy")  # logged by TRL's RewardTrainer


def test_rm_resumes_backbone_and_value_head(rm_dir, tiny_model, tmp_path, caplog):
    import shutil

    from safetensors.torch import load_file

    out = tmp_path / "rm"
    shutil.copytree(rm_dir, out)
    head = load_file(str(out / "checkpoint-10" / "value_head.safetensors"))
    run = rm_run(tiny_model, out, max_steps=12, resume_from_checkpoint=str(out / "checkpoint-10"))
    with caplog.at_level(logging.INFO, logger="lmstack.train.rm"):
        train(None, run)
    assert any("resumed the reward model" in r.message for r in caplog.records)
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 12
    new_head = load_file(str(out / "value_head.safetensors"))
    # two more steps from the resumed head: close to it, not back at a fresh random init
    assert torch.allclose(new_head["v_head.summary.weight"], head["v_head.summary.weight"], atol=0.05)


# ---- dpo ----------------------------------------------------------------------------------------
def _models_alive(cls_name: str) -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o).__name__ == cls_name)


def test_dpo_lora_uses_no_reference_copy_and_raises_the_margin(cfg):
    from lmstack.data.pipeline import build_datasets
    from lmstack.models.adapters import count_parameters, setup_finetuning
    from lmstack.models.load import load_model, load_tokenizer
    from lmstack.templates import get_template
    from lmstack.train import dpo, rlhf

    c = build_config(
        {
            **cfg,
            "stage": "dpo",
            "dataset": "dpo_en_demo",
            "max_steps": 8,
            "learning_rate": 5e-3,
            "per_device_eval_batch_size": 16,
        }
    )
    tok = load_tokenizer(c)
    template = get_template("qwen", tok)
    template.fix_tokenizer(tok)
    data = build_datasets(c, tok, template)
    ds = rlhf.to_dataset(data.train, rlhf.pairwise_columns)
    before = _models_alive("Qwen2ForCausalLM")
    plan = _plan(c)
    model = setup_finetuning(c, load_model(plan.model_spec(), tok))
    _, params = count_parameters(model)
    ref = rlhf.reference_model(plan, tok)
    trainer = dpo.build_trainer(plan, model, ref, tok, ds, ds.select(range(16)))
    assert ref is None and trainer.ref_model is None
    assert "ref" not in trainer.model.peft_config  # TRL's adapter copy is dropped for a fresh adapter
    assert count_parameters(trainer.model)[1] == params  # nothing added
    assert _models_alive("Qwen2ForCausalLM") == before + 1  # the policy only: no second model

    start = trainer.evaluate()["eval_rewards/margins"]
    trainer.train()
    end = trainer.evaluate()["eval_rewards/margins"]
    assert abs(start) < 1e-6  # adapter at zero: policy == reference
    assert end > 0.2, end


def test_dpo_full_loads_a_frozen_reference_copy(cfg, tiny_model):
    from lmstack.models.load import load_tokenizer
    from lmstack.train import rlhf

    c = build_config({**cfg, "stage": "dpo", "dataset": "dpo_en_demo", "finetuning_type": "full"})
    ref = rlhf.reference_model(_plan(c), load_tokenizer(c))
    assert type(ref).__name__ == "Qwen2ForCausalLM"
    assert not any(p.requires_grad for p in ref.parameters()) and not ref.training


@pytest.mark.parametrize(
    ("loss", "beta"),
    [("sigmoid", 0.1), ("orpo", 0.1), ("simpo", 2.0)],
)
def test_dpo_losses_raise_the_logged_margin(cfg, loss, beta):
    run = {
        **cfg,
        "stage": "dpo",
        "dataset": "dpo_en_demo",
        "pref_loss": loss,
        "pref_beta": beta,
        "max_steps": 10,
        "learning_rate": 1e-2,
        "per_device_train_batch_size": 8,
        "plot_loss": True,
    }
    train(None, run)
    out = Path(run["output_dir"])
    margins = series(out, "rewards/margins")
    assert sum(margins[-3:]) / 3 > sum(margins[:3]) / 3, margins
    assert (out / "training_rewards_accuracies.png").read_bytes()[:4] == b"\x89PNG"
    log = [json.loads(x) for x in (out / "trainer_log.jsonl").read_text().splitlines()]
    assert all("reward" in r and "accuracy" in r for r in log if "loss" in r)  # LF's keys
    assert (out / "adapter_model.safetensors").is_file()


def test_dpo_loss_options_map_to_trl(cfg):
    from lmstack.models.load import load_model, load_tokenizer
    from lmstack.train import dpo, rlhf

    c = build_config(
        {**cfg, "stage": "dpo", "dataset": "dpo_en_demo", "dpo_label_smoothing": 0.1, "pref_ftx": 0.5}
    )
    tok = load_tokenizer(c)
    ds = rlhf.to_dataset([{"prompt_ids": [1, 2], "chosen_ids": [3], "rejected_ids": [4]}], dict)
    plan = _plan(c)
    trainer = dpo.build_trainer(plan, load_model(plan.model_spec(), tok), None, tok, ds, None)
    assert trainer.loss_types == ["robust", "sft"] and trainer.loss_weights == [1.0, 0.5]
    assert trainer.label_smoothing == 0.1 and trainer.beta == c.finetuning.pref_beta


# ---- kto ----------------------------------------------------------------------------------------
def test_kto_raises_the_desirable_margin(cfg):
    run = {
        **cfg,
        "stage": "kto",
        "dataset": "kto_en_demo",
        "eval_dataset": "kto_en_demo",
        "do_eval": True,
        "per_device_eval_batch_size": 16,
        "max_steps": 10,
        "learning_rate": 1e-2,
        "plot_loss": True,
    }
    train(None, run)
    out = Path(run["output_dir"])
    results = json.loads((out / "eval_results.json").read_text())
    assert results["eval_rewards/margins"] > 0.2, results  # 0 before training (policy == reference)
    assert (out / "training_rewards_chosen.png").is_file()


def test_kto_with_batch_size_1_trains_like_llama_factory(cfg):
    """LF accepts per_device_train_batch_size: 1 for kto (its KL pairs are built while preprocessing);
    TRL alone refuses it. The KL answers come from other rows, never the row's own answer."""
    from lmstack.train.kto import PretokenizedKTOTrainer

    run = {**cfg, "stage": "kto", "dataset": "kto_en_demo", "per_device_train_batch_size": 1, "max_steps": 3}
    metrics = train(None, run)
    assert metrics["train_loss"] > 0
    rows = {"completion_ids": [[1], [2], [3], [4], [5], [6]], "prompt_ids": [[0]] * 6, "label": [True] * 6}
    from datasets import Dataset

    paired = PretokenizedKTOTrainer._prepare_dataset(
        type("T", (), {"calculate_KL": True, "kl_chunk": 4})(), Dataset.from_dict(rows), None, None, "train"
    )
    assert paired["KL_completion_ids"] == [[4], [3], [2], [1], [6], [5]]  # LF: reversed per chunk


# ---- ppo / grpo ---------------------------------------------------------------------------------
@pytest.fixture
def toy_reward(tiny_model, monkeypatch):
    """Target = the token the untrained tiny model samples most after the fixture prompt; returns its
    base rate. The reward is the fraction of answer tokens equal to it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lmstack.templates import get_template

    monkeypatch.syspath_prepend(str(FIXTURES))
    import stage_rewards

    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    template = get_template("qwen", tok)
    template.fix_tokenizer(tok)
    ids = template.encode_prompt(tok, [{"role": "user", "content": "Hello"}])
    torch.manual_seed(0)
    out = model.generate(
        torch.tensor([ids] * 64),
        do_sample=True,
        max_new_tokens=8,
        top_p=1.0,
        top_k=0,
        temperature=0.3,
        pad_token_id=tok.pad_token_id,
    )
    counts = collections.Counter(out[:, len(ids) :].flatten().tolist())
    target, n = counts.most_common(1)[0]
    monkeypatch.setattr(stage_rewards, "TARGET_IDS", {target})
    return n / out[:, len(ids) :].numel()


def rl_cfg(cfg: dict, stage: str) -> dict:
    return {
        **cfg,
        "stage": stage,
        "dataset": "rl_prompts",
        "dataset_dir": str(FIXTURES),
        "reward_funcs": "stage_rewards:target_tokens",
        "max_new_tokens": 8,
        "temperature": 0.3,
        "top_p": 1.0,
        "top_k": 0,
        "per_device_train_batch_size": 16,
        "learning_rate": 1e-2,
        "save_strategy": "no",
    }


def test_ppo_raises_the_toy_reward(cfg, toy_reward):
    run = {**rl_cfg(cfg, "ppo"), "max_steps": 10, "ppo_epochs": 4, "ppo_score_norm": True, "plot_loss": True}
    train(None, run)
    out = Path(run["output_dir"])
    rewards = series(out, "reward")
    assert len(rewards) == 10
    assert sum(rewards[5:]) / 5 > 1.8 * toy_reward, (toy_reward, rewards)
    for name in (
        "adapter_model.safetensors",
        "value_head.safetensors",
        "trainer_log.jsonl",
        "training_reward.png",
    ):
        assert (out / name).is_file(), name
    from lmstack.models.value_head import load_value_head_model

    critic = load_value_head_model(out)  # the policy adapter + the critic's value head reload
    assert critic(torch.tensor([[1, 2, 3]])).logits.shape == (1, 1)


def test_grpo_raises_the_toy_reward(cfg, toy_reward):
    run = {**rl_cfg(cfg, "grpo"), "max_steps": 6, "num_generations": 4}
    train(None, run)
    out = Path(run["output_dir"])
    rewards = series(out, "reward")
    assert rewards[-1] > 3 * toy_reward and rewards[-1] > rewards[0], (toy_reward, rewards)
    assert (out / "adapter_model.safetensors").is_file()


def test_rloo_raises_the_toy_reward(cfg, toy_reward):
    run = {**rl_cfg(cfg, "rloo"), "max_steps": 6, "num_generations": 4, "pref_beta": 0.001}
    train(None, run)
    rewards = series(Path(run["output_dir"]), "reward")
    assert rewards[-1] > 3 * toy_reward and rewards[-1] > rewards[0], (toy_reward, rewards)


@pytest.mark.parametrize("stage", ["ppo", "grpo"])
def test_rl_stages_run_with_an_rm_stage_reward_model(cfg, rm_dir, stage):
    run = {
        **rl_cfg(cfg, stage),
        "reward_funcs": None,
        "reward_model": str(rm_dir),
        "max_steps": 2,
        "per_device_train_batch_size": 4,
        "num_generations": 2,
        "ppo_epochs": 1,
    }
    train(None, run)
    rewards = series(Path(run["output_dir"]), "reward")
    assert rewards and all(isinstance(r, float) for r in rewards)


# ---- conflicts that need an rm run (the others: test_stage_rules.py) ---------------------------
def test_reward_model_type_must_match_the_directory(cfg, rm_dir):
    with pytest.raises(ConfigError, match="reward_model_type: full, but .* holds a LoRA adapter"):
        train(None, {**rl_cfg(cfg, "ppo"), "reward_model": str(rm_dir), "reward_model_type": "full"})
    with pytest.raises(ConfigError, match="reward_model_type: api is not supported"):
        train(None, {**rl_cfg(cfg, "ppo"), "reward_model": str(rm_dir), "reward_model_type": "api"})


def _plan(c):
    from lmstack.launch.context import LaunchContext
    from lmstack.plan.runplan import RunPlan

    return RunPlan.resolve(c, LaunchContext())
