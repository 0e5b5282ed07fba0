"""Stages grpo / rloo: online RL of the REINFORCE family with TRL's GRPOTrainer / RLOOTrainer (RLOO: the
baseline of each answer is the mean reward of the other answers to its prompt). For each prompt it samples
`num_generations` answers (max_new_tokens, temperature, top_p, top_k), scores them with the rewards,
and pushes up the answers that beat their group's mean; `pref_beta` weighs a KL penalty to the
starting model (LoRA: the adapter disabled, no copy).

Rewards: `reward_model` (an lmstack `stage: rm` output dir, scoring prompt + answer with its value
head) and/or `reward_funcs`, comma-separated shipped names (accuracy | format | length, train/rewards.py)
or `pkg.module:function` / `path/to/file.py:function`; each is called as f(prompts=[...],
completions=[...], completion_ids=[...], solution=[...], **kwargs) -> list[float], `reward_weights`
weighs them. Prompts come from any instruction dataset rendered by our template; its answers are
never trained on, only handed to the rewards as the `solution` column (the reference of `accuracy`).
The loss, the clip range, the advantage scaling, the KL reference and the rewards are the run plan's
(plan.rl, plan/decide_rl.py).
tokenizer -> template -> data -> model -> adapter -> rewards -> trainer -> train -> save.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

from lmstack.config.errors import ConfigError
from lmstack.data.mm import media_spec
from lmstack.data.pipeline import build_datasets
from lmstack.models.adapters import setup_finetuning
from lmstack.models.load import apply_speedups, load_model
from lmstack.models.vision import save_processor_files
from lmstack.plan.runplan import RunPlan
from lmstack.train import common, grpo_media, rlhf
from lmstack.train.rewards import SOLUTION_COLUMN
from lmstack.train.rollout_engine import FastRollouts, cb_settings


def run(plan: RunPlan) -> dict:
    cfg, device = plan.cfg, plan.device
    resume = common.start_run(plan)
    reward_funcs = rlhf.reward_functions(cfg)

    tokenizer, template = common.tokenizer_and_template(cfg)
    data = build_datasets(cfg, tokenizer, template)  # fails here, before the model loads, on bad data

    media = media_spec(cfg)  # image prompts: TRL's vision path (train/grpo_media.py)

    def prompt_text(row: dict) -> dict:
        text = tokenizer.decode(row["input_ids"], skip_special_tokens=False)
        prompt = {"prompt": text} if media is None else grpo_media.row_columns(row, text, media)
        solution = tokenizer.decode(row.get("solution_ids") or [], skip_special_tokens=True)
        return {**prompt, SOLUTION_COLUMN: solution}

    train_ds = rlhf.to_dataset(data.train, prompt_text)
    eval_ds = rlhf.to_dataset(data.eval, prompt_text) if data.eval is not None else None
    check_references(plan, train_ds)
    if cfg.finetuning.reward_model:
        reward_funcs.append(reward_model_func(cfg.finetuning.reward_model, tokenizer, device))

    model = load_model(plan.model_spec(), tokenizer)
    common.enable_gradient_checkpointing(plan, model)
    model = setup_finetuning(cfg, model, lora_kernel=plan.lora_kernel)
    model = apply_speedups(plan.speedup_spec(), model)  # FP8 GEMMs (plan.fp8)

    g = cfg.generating
    config_cls, trainer_cls = TRAINERS[cfg.finetuning.stage]
    args = rlhf.trl_config(
        plan,
        config_cls,
        num_generations=cfg.finetuning.num_generations,
        max_completion_length=g.max_new_tokens,
        temperature=g.temperature,
        top_p=g.top_p,
        top_k=g.top_k,
        repetition_penalty=g.repetition_penalty,
        log_completions=False,
        **rl_kwargs(plan),
    )
    rollout = tool_rollout(plan, template, tokenizer, train_ds)
    trainer = trainer_cls(
        model=model,
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        processing_class=tokenizer if media is None else grpo_media.rollout_processor(cfg, media, tokenizer),
        callbacks=common.make_callbacks(cfg),
        **({"rollout_func": rollout} if rollout is not None else {}),
    )
    rlhf.drop_trl_ref_adapter(cfg, trainer.model)  # a fresh adapter: the adapter-off base is the reference
    per_reward = tuple(f"rewards/{name}/mean" for name in trainer.reward_func_names)
    metrics = common.train_and_save(plan, trainer, resume, ("reward", *per_reward))
    if media is not None and trainer.is_world_process_zero():  # the processor loads next to the model
        save_processor_files(cfg.model.model_name_or_path, cfg.training.output_dir)
    return metrics


def rl_kwargs(plan: RunPlan) -> dict[str, Any]:
    """The run plan's RL decisions as TRL config fields (GRPOConfig's names; RLOOConfig has a subset)."""
    rl = plan.rl
    kwargs: dict[str, Any] = {
        "beta": rl.beta,
        "epsilon": rl.epsilon,
        "epsilon_high": rl.epsilon_high,
        "mask_truncated_completions": rl.mask_truncated_completions,
        "num_iterations": rl.num_iterations,
        "steps_per_generation": rl.steps_per_generation,
        "reward_weights": list(rl.reward_weights),
    }
    if rl.rollout_engine == "continuous_batching":
        t = plan.cfg.training
        kwargs |= cb_settings(plan, t.per_device_train_batch_size * rl.steps_per_generation)
    if plan.stage.name == "rloo":
        kwargs["normalize_advantages"] = rl.scale_rewards == "ppo_score_norm"
    else:
        kwargs |= {
            "loss_type": rl.loss_type,
            "scale_rewards": rl.scale_rewards,
            "importance_sampling_level": rl.importance_sampling_level,
        }
    return kwargs


def tool_rollout(plan: RunPlan, template: Any, tokenizer: Any, train_ds: Any) -> Any | None:
    """tool_funcs -> the multi-turn rollout calling them (None without tools). Each tool must be described
    to the model: its name in the prompts (the dataset's tools column), else refused before the load."""
    specs = rlhf.split_specs(plan.cfg.finetuning.tool_funcs)
    if not specs:
        return None
    if media_spec(plan.cfg) is not None:
        raise ConfigError(
            "tool_funcs: tool rollouts take text prompts; with image prompts (dataset "
            f"{plan.cfg.data.dataset}) remove tool_funcs"
        )
    from lmstack.train.tool_rollout import ToolRollout

    funcs = [rlhf.import_reward_func(spec, "tool_funcs") for spec in specs]
    tools = {f.__name__: f for f in funcs}
    prompts = train_ds["prompt"]
    for name in tools:
        if not any(name in p for p in prompts):
            raise ConfigError(
                f"tool_funcs: no prompt describes the tool {name!r}, so the model cannot know to call it; give "
                "the dataset a tools column (LLaMA-Factory's format: the tools' JSON schemas) that lists it"
            )
    g = plan.cfg.generating
    return ToolRollout(template, tokenizer, tools, plan.rl.max_tool_calls, g.max_new_tokens)


def check_references(plan: RunPlan, train_ds: Any) -> None:
    """`accuracy` compares with the dataset's answers: a dataset without any is refused before the load."""
    if "accuracy" in rlhf.split_specs(plan.cfg.finetuning.reward_funcs) and not any(
        train_ds[SOLUTION_COLUMN]
    ):
        raise ConfigError(
            f"reward_funcs: accuracy compares each answer with the dataset's reference answer, and "
            f"{plan.cfg.data.dataset} has none; map its answer column as the response (alpaca: output) in "
            "dataset_info.json"
        )


class _TemplatePrompts:
    """Prompts are our template's rendering (special tokens included): tokenized as they are."""

    def _tokenize_prompts(self, prompts: list):
        if prompts and isinstance(prompts[0], list):  # image prompts: TRL's vision path (train/grpo_media.py)
            return super()._tokenize_prompts(prompts)
        return self.processing_class(text=prompts, add_special_tokens=False)["input_ids"], None, {}


class TemplatePromptGRPOTrainer(_TemplatePrompts, FastRollouts, GRPOTrainer):
    _returns_logprobs = True  # GRPOTrainer._generate_single_turn -> (completion_ids, logprobs)


class TemplatePromptRLOOTrainer(_TemplatePrompts, FastRollouts, RLOOTrainer):
    _returns_logprobs = False  # RLOOTrainer._generate_single_turn -> completion_ids


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
