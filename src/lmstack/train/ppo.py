"""Stage ppo: RLHF with PPO against a reward model trained by our `stage: rm`.

TRL 1.16 ships no PPOTrainer (LLaMA-Factory's PPO needs TRL <= 0.9), so this
is a compact PPO of our own, following Ziegler et al. 2019 / TRL 0.9's PPOTrainer:
  rollout: sample answers (generation settings), score prompt+answer with the reward model
           (optionally normalised: ppo_score_norm); per-token reward = -kl_coef * (logp - ref_logp),
           plus the score on the last answer token (optionally whitened: ppo_whiten_rewards);
  GAE (gamma 1, lambda 0.95) with the critic = a value head on the policy's backbone;
  update: ppo_epochs passes of clipped policy loss (eps 0.2) + 0.1 x clipped value loss;
  adaptive KL controller: kl_coef follows ppo_target (the KL to the reference per sequence).
One rollout batch = per_device_train_batch_size x gradient_accumulation_steps x ppo_buffer_size
prompts; one optimizer step per mini-batch of per_device_train_batch_size. The reference is the base
with the adapter disabled (LoRA) or a frozen copy (full/freeze), or `ref_model`.
Outputs: the policy (adapter or weights), value_head.safetensors (the critic), trainer_log.jsonl,
trainer_state.json (log_history), train_results.json, training_reward.png with plot_loss.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from lmstack.config.schema import Config
from lmstack.data.pipeline import build_datasets
from lmstack.models.adapters import setup_finetuning
from lmstack.models.load import apply_speedups, load_model
from lmstack.models.value_head import ValueHeadModel, last_token, load_value_head_model
from lmstack.plan.runplan import RunPlan
from lmstack.train import common, rlhf

logger = logging.getLogger(__name__)
CLIP, VF_COEF, GAMMA, LAM, INIT_KL, KL_HORIZON = 0.2, 0.1, 1.0, 0.95, 0.2, 10000


def run(plan: RunPlan) -> dict:
    cfg, device = plan.cfg, plan.device
    resume = common.start_run(plan)
    if resume is not None:
        logger.warning("resume_from_checkpoint: ppo does not resume yet; starting a fresh run")
    Path(cfg.training.output_dir).mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.training.seed)
    rng = random.Random(cfg.training.seed)

    tokenizer, template = common.tokenizer_and_template(cfg)
    prompts = [row["input_ids"] for row in build_datasets(cfg, tokenizer, template).train.to_samples()]

    policy = _policy(plan, tokenizer)
    ref_model = rlhf.reference_model(plan, tokenizer)
    ft = cfg.finetuning
    reward_model = load_value_head_model(ft.reward_model, device=device).eval() if ft.reward_model else None
    reward_funcs = rlhf.reward_functions(cfg)
    stop_ids = template.stop_token_ids(tokenizer)

    t = cfg.training
    rollout = t.per_device_train_batch_size * t.gradient_accumulation_steps * cfg.finetuning.ppo_buffer_size
    steps = t.max_steps if t.max_steps > 0 else math.ceil(t.num_train_epochs * len(prompts) / rollout)
    optimizer, scheduler = _optimizer(
        cfg,
        plan.optimizer,
        policy,
        steps * cfg.finetuning.ppo_epochs * (rollout // t.per_device_train_batch_size),
    )
    kl_coef, score_stats, history, start = INIT_KL, RunningMoments(), [], time.time()
    for step in range(1, steps + 1):
        batch = [prompts[rng.randrange(len(prompts))] for _ in range(rollout)]
        exp = make_experience(
            cfg,
            policy,
            ref_model,
            reward_model,
            reward_funcs,
            batch,
            tokenizer,
            stop_ids,
            kl_coef,
            score_stats,
        )
        stats = ppo_update(cfg, policy, optimizer, scheduler, exp)
        kl_coef = adapt_kl(kl_coef, exp["kl"], cfg.finetuning.ppo_target, rollout)
        record = {
            "step": step,
            "loss": stats["loss"],
            "reward": exp["score"].mean().item(),
            "kl": exp["kl"],
            "kl_coef": kl_coef,
            "value_loss": stats["value_loss"],
            "policy_loss": stats["policy_loss"],
            "response_length": exp["mask"].sum(1).float().mean().item(),
            "learning_rate": scheduler.get_last_lr()[0],
        }
        history.append(record)
        if step % t.logging_steps == 0 or step == steps:
            _log(cfg, record, steps, start)
    return _save(cfg, policy, tokenizer, history, steps, start)


def _policy(plan: RunPlan, tokenizer: Any) -> ValueHeadModel:
    """The trained model with its adapter and the critic's value head."""
    backbone = load_model(plan.model_spec(), tokenizer)
    # the PPO updates run in train mode (checkpointed); rollouts generate in eval mode, which never
    # recomputes, so sampling keeps its KV cache
    common.enable_gradient_checkpointing(plan, backbone)
    backbone = setup_finetuning(plan.cfg, backbone, lora_kernel=plan.lora_kernel)
    backbone = apply_speedups(plan.speedup_spec(), backbone)  # FP8 GEMMs (plan.fp8)
    return ValueHeadModel(backbone).to(plan.device)


# ---- rollout ------------------------------------------------------------------------------------
def _positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def _logprobs_values(model: Any, ids: torch.Tensor, mask: torch.Tensor, width: int, with_values: bool):
    """Log-probs of the answer tokens (positions >= width) and, for the policy, the critic's values."""
    backbone = model.backbone if isinstance(model, ValueHeadModel) else model
    out = backbone(
        input_ids=ids,
        attention_mask=mask,
        position_ids=_positions(mask),
        output_hidden_states=with_values,
        use_cache=False,
    )
    logits = out.logits[:, width - 1 : -1].float()
    logp = torch.gather(F.log_softmax(logits, -1), 2, ids[:, width:].unsqueeze(-1)).squeeze(-1)
    values = None
    if with_values:
        hidden = out.hidden_states[-1][:, width - 1 : -1]
        values = model.v_head(hidden.to(model.v_head.weight.dtype)).squeeze(-1)
    return logp, values


@torch.no_grad()
def generate(
    cfg: Config, policy: ValueHeadModel, prompts: list[list[int]], tokenizer: Any, stop_ids: list[int]
):
    """Left-padded prompts + sampled answers; the answer mask covers tokens up to the first stop token."""
    device = next(policy.parameters()).device
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id
    ids = torch.full((len(prompts), width), pad, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, device=device)
        mask[i, width - len(p) :] = 1
    g = cfg.generating
    policy.eval()
    out = policy.backbone.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=True,
        temperature=g.temperature,
        top_p=g.top_p,
        top_k=g.top_k,
        max_new_tokens=g.max_new_tokens,
        eos_token_id=stop_ids,
        pad_token_id=pad,
        use_cache=True,
    )
    answer = out[:, width:]
    is_stop = torch.isin(answer, torch.tensor(stop_ids, device=device))
    after_stop = (is_stop.long().cumsum(1) - is_stop.long()) > 0  # strictly after the first stop token
    answer_mask = (~after_stop).long()
    answer = answer.masked_fill(after_stop, pad)
    return torch.cat([ids, answer], 1), torch.cat([mask, answer_mask], 1), width, answer_mask


@torch.no_grad()
def make_experience(
    cfg, policy, ref_model, reward_model, reward_funcs, prompts, tokenizer, stop_ids, kl_coef, score_stats
):
    ids, mask, width, answer_mask = generate(cfg, policy, prompts, tokenizer, stop_ids)
    logp, values = _logprobs_values(policy, ids, mask, width, with_values=True)
    with _reference(policy, ref_model) as ref:
        ref_logp, _ = _logprobs_values(ref, ids, mask, width, with_values=False)
    scores = torch.zeros(len(prompts), device=ids.device)
    if reward_model is not None:  # the value-head score of prompt + answer
        scores += last_token(reward_model.values(ids, mask), mask).float()
    answers = [row[m.bool()].tolist() for row, m in zip(ids[:, width:], answer_mask)]
    texts = [tokenizer.decode(a, skip_special_tokens=True) for a in answers]
    prompt_texts = [tokenizer.decode(p, skip_special_tokens=False) for p in prompts]
    for func in reward_funcs:
        got = func(prompts=prompt_texts, completions=texts, completion_ids=answers)
        scores += torch.tensor([float(v) for v in got], device=ids.device)
    raw_scores = scores.clone()
    if cfg.finetuning.ppo_score_norm:
        score_stats.update(scores)
        scores = (scores - score_stats.mean) / (score_stats.std + 1e-8)
    kl = (logp - ref_logp) * answer_mask
    rewards = -kl_coef * kl
    last = (answer_mask.sum(1) - 1).clamp(min=0)
    rewards[torch.arange(len(prompts)), last] += scores
    if cfg.finetuning.ppo_whiten_rewards:
        rewards = whiten(rewards, answer_mask, shift_mean=False)
    advantages, returns = gae(rewards, values, answer_mask)
    return {
        "ids": ids,
        "attn": mask,
        "width": width,
        "mask": answer_mask,
        "logp": logp,
        "values": values,
        "advantages": advantages,
        "returns": returns,
        "score": raw_scores,
        "kl": kl.sum(1).mean().item(),
    }


@contextlib.contextmanager
def _reference(policy: ValueHeadModel, ref_model: Any):
    if ref_model is not None:
        yield ref_model
    else:  # LoRA: the base model is the policy with its adapter disabled
        with policy.backbone.disable_adapter():
            yield policy.backbone


# ---- PPO maths ----------------------------------------------------------------------------------
def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    out = (x - mean) * torch.rsqrt(var + 1e-8)
    return (out if shift_mean else out + mean) * mask


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the answer tokens; advantages whitened."""
    values = values * mask
    advantages = torch.zeros_like(rewards)
    last = torch.zeros(rewards.shape[0], device=rewards.device)
    for t in reversed(range(rewards.shape[1])):
        next_value = values[:, t + 1] if t + 1 < rewards.shape[1] else torch.zeros_like(last)
        delta = rewards[:, t] + GAMMA * next_value - values[:, t]
        last = delta + GAMMA * LAM * last
        advantages[:, t] = last
    returns = advantages + values
    return whiten(advantages, mask), returns


def ppo_losses(exp: dict, idx: torch.Tensor, logp: torch.Tensor, values: torch.Tensor) -> tuple:
    mask = exp["mask"][idx].float()
    adv, old_logp, old_values, returns = (exp[k][idx] for k in ("advantages", "logp", "values", "returns"))
    ratio = torch.exp(logp - old_logp)
    policy_loss = masked_mean(torch.max(-adv * ratio, -adv * ratio.clamp(1 - CLIP, 1 + CLIP)), mask)
    clipped = old_values + (values - old_values).clamp(-CLIP, CLIP)
    value_loss = 0.5 * masked_mean(torch.max((values - returns) ** 2, (clipped - returns) ** 2), mask)
    return policy_loss, value_loss


def ppo_update(cfg: Config, policy: ValueHeadModel, optimizer: Any, scheduler: Any, exp: dict) -> dict:
    t = cfg.training
    policy.train()
    n = exp["ids"].shape[0]
    totals = {"loss": 0.0, "policy_loss": 0.0, "value_loss": 0.0}
    count = 0
    for _ in range(cfg.finetuning.ppo_epochs):
        order = torch.randperm(n)
        for start in range(0, n, t.per_device_train_batch_size):
            idx = order[start : start + t.per_device_train_batch_size]
            logp, values = _logprobs_values(policy, exp["ids"][idx], exp["attn"][idx], exp["width"], True)
            policy_loss, value_loss = ppo_losses(exp, idx, logp, values)
            loss = policy_loss + VF_COEF * value_loss
            loss.backward()
            if t.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(
                    [p for p in policy.parameters() if p.requires_grad], t.max_grad_norm
                )
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            for key, value in (("loss", loss), ("policy_loss", policy_loss), ("value_loss", value_loss)):
                totals[key] += value.item()
            count += 1
    return {k: v / max(count, 1) for k, v in totals.items()}


def adapt_kl(kl_coef: float, kl: float, target: float, n_steps: int) -> float:
    """Adaptive KL controller (Ziegler et al. 2019): move kl_coef so the KL tracks `target`."""
    error = max(min(kl / target - 1, 0.2), -0.2)
    return kl_coef * (1 + error * n_steps / KL_HORIZON)


class RunningMoments:
    """Running mean/std of the reward-model scores (ppo_score_norm)."""

    def __init__(self) -> None:
        self.mean, self.var, self.count = 0.0, 1.0, 1e-8

    def update(self, x: torch.Tensor) -> None:
        n, mean, var = x.numel(), x.mean().item(), x.var(unbiased=False).item()
        total = self.count + n
        delta = mean - self.mean
        self.var = (self.var * self.count + var * n + delta**2 * self.count * n / total) / total
        self.mean += delta * n / total
        self.count = total

    @property
    def std(self) -> float:
        return math.sqrt(self.var)


# ---- optimiser, logs, outputs -------------------------------------------------------------------
def _optimizer(cfg: Config, optim: str, policy: ValueHeadModel, total: int) -> tuple[Any, Any]:
    """`optim`: the plan's AdamW implementation (plan.optimizer: fused or multi-tensor)."""
    from transformers import get_scheduler

    t = cfg.training
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(  # optim: adamw_torch (multi-tensor) or adamw_torch_fused (plan/rules.py)
        params,
        lr=t.learning_rate,
        betas=(t.adam_beta1, t.adam_beta2),
        eps=t.adam_epsilon,
        weight_decay=t.weight_decay,
        fused=True if optim == "adamw_torch_fused" else None,
    )
    warmup = t.warmup_steps if t.warmup_steps > 0 else int(t.warmup_ratio * total)
    return optimizer, get_scheduler(
        t.lr_scheduler_type,
        optimizer,
        num_warmup_steps=warmup,
        num_training_steps=total,
        scheduler_specific_kwargs=t.lr_scheduler_kwargs,
    )


def _log(cfg: Config, record: dict, steps: int, start: float) -> None:
    line = {
        "current_steps": record["step"],
        "total_steps": steps,
        "loss": round(record["loss"], 4),
        "reward": round(record["reward"], 4),
        "kl": round(record["kl"], 4),
        "lr": record["learning_rate"],
        "percentage": round(100 * record["step"] / steps, 2),
        "elapsed_time": common._hms(time.time() - start),
    }
    logger.info("ppo %s", line)
    with (Path(cfg.training.output_dir) / common.LOG_FILE).open("a") as fh:
        fh.write(json.dumps(line) + "\n")


def _save(
    cfg: Config, policy: ValueHeadModel, tokenizer: Any, history: list, steps: int, start: float
) -> dict:
    out = Path(cfg.training.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    from lmstack.models.adapter_save import follow_umask
    from lmstack.reliability.outputs_record import output_files, record_outputs

    before = output_files(out)  # what the save writes is recorded against this (overwrite removes it)
    policy.save_pretrained(out)  # adapter or weights + value_head.safetensors (the critic)
    follow_umask(out)
    tokenizer.save_pretrained(out)
    runtime = time.time() - start
    metrics = {
        "train_runtime": round(runtime, 4),
        "train_steps_per_second": round(steps / runtime, 3),
        "train_loss": sum(h["loss"] for h in history) / max(len(history), 1),
        "train_reward": history[-1]["reward"] if history else None,
    }
    state = {"global_step": steps, "max_steps": steps, "log_history": history}
    (out / "trainer_state.json").write_text(json.dumps(state, indent=2))
    for name in ("train_results.json", "all_results.json"):
        (out / name).write_text(json.dumps(metrics, indent=2))
    from lmstack.config.load import save_config

    save_config(cfg, out / common.CONFIG_FILE)
    rlhf.plot(cfg, ["loss", "reward", "kl"])
    record_outputs(out, before)
    logger.info("outputs written to %s", out)
    return metrics
