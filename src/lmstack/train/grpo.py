"""Stages grpo / rloo: online RL of the REINFORCE family with TRL's GRPOTrainer / RLOOTrainer (RLOO: the
baseline of each answer is the mean reward of the other answers to its prompt). For each prompt it samples
`num_generations` answers (max_new_tokens, temperature, top_p, top_k), scores them with the rewards,
and pushes up the answers that beat their group's mean; `pref_beta` weighs a KL penalty to the
starting model (LoRA: the adapter disabled, no copy).

Rewards: `reward_model` (an lmstack `stage: rm` output dir, scoring prompt + answer with its value
head) and/or `reward_funcs`, comma-separated `pkg.module:function` or `path/to/file.py:function`;
each is called as f(prompts=[...], completions=[...], completion_ids=[...], **kwargs) -> list[float].
Prompts come from any instruction dataset rendered by our template (answers are not used).
tokenizer -> template -> data -> model -> adapter -> rewards -> trainer -> train -> save.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

from lmstack.data.pipeline import build_datasets
from lmstack.models.adapters import setup_finetuning
from lmstack.models.load import apply_speedups, load_model
from lmstack.plan.runplan import RunPlan
from lmstack.train import common, rlhf


def run(plan: RunPlan) -> dict:
    cfg, device = plan.cfg, plan.device
    resume = common.start_run(plan)
    reward_funcs = rlhf.reward_functions(cfg)

    tokenizer, template = common.tokenizer_and_template(cfg)
    data = build_datasets(cfg, tokenizer, template)  # fails here, before the model loads, on bad data

    def prompt_text(row: dict) -> dict:
        return {"prompt": tokenizer.decode(row["input_ids"], skip_special_tokens=False)}

    train_ds = rlhf.to_dataset(data.train, prompt_text)
    eval_ds = rlhf.to_dataset(data.eval, prompt_text) if data.eval is not None else None
    if cfg.finetuning.reward_model:
        reward_funcs.append(reward_model_func(cfg.finetuning.reward_model, tokenizer, device))

    model = load_model(plan.model_spec(), tokenizer)
    common.enable_gradient_checkpointing(plan, model)
    model = setup_finetuning(cfg, model, lora_kernel=plan.lora_kernel)
    model = apply_speedups(plan.speedup_spec(), model)  # FP8 GEMMs (plan.fp8)

    g = cfg.generating
    config_cls, trainer_cls = TRAINERS[cfg.finetuning.stage]
    # rloo only: GRPOConfig has no such field (GRPO always scales by the group std)
    rloo_kwargs = {"normalize_advantages": cfg.finetuning.ppo_score_norm} if config_cls is RLOOConfig else {}
    args = rlhf.trl_config(
        plan,
        config_cls,
        num_generations=cfg.finetuning.num_generations,
        max_completion_length=g.max_new_tokens,
        temperature=g.temperature,
        top_p=g.top_p,
        top_k=g.top_k,
        repetition_penalty=g.repetition_penalty,
        beta=cfg.finetuning.pref_beta,
        log_completions=False,
        **rloo_kwargs,
    )
    trainer = trainer_cls(
        model=model,
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        processing_class=tokenizer,
        callbacks=common.make_callbacks(cfg),
    )
    return common.train_and_save(plan, trainer, resume, ("reward",))


class _TemplatePrompts:
    """Prompts are our template's rendering (special tokens included): tokenized as they are."""

    def _tokenize_prompts(self, prompts: list):
        return self.processing_class(text=prompts, add_special_tokens=False)["input_ids"], None, {}


class TemplatePromptGRPOTrainer(_TemplatePrompts, GRPOTrainer):
    pass


class TemplatePromptRLOOTrainer(_TemplatePrompts, RLOOTrainer):
    pass


TRAINERS = {
    "grpo": (GRPOConfig, TemplatePromptGRPOTrainer),
    "rloo": (RLOOConfig, TemplatePromptRLOOTrainer),
}


def reward_model_func(path: str, tokenizer: Any, device: str) -> Callable:
    """An rm-stage output dir as a TRL reward function: the value-head score of prompt + answer ids."""
    from lmstack.models.value_head import RewardModel, load_value_head_model

    scorer = RewardModel(load_value_head_model(path, device=device), tokenizer)
    for p in scorer.model.parameters():
        p.requires_grad_(False)

    def reward_model(prompts: list, completion_ids: list, **_: Any) -> list[float]:
        prompt_ids = tokenizer(text=list(prompts), add_special_tokens=False)["input_ids"]
        return scorer.score_ids([list(p) + list(c) for p, c in zip(prompt_ids, completion_ids)])

    return reward_model
