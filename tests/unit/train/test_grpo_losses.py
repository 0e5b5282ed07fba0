"""Each GRPO loss type, as lmstack's YAML fields configure TRL's GRPOTrainer, equals the objective written
out here from the papers on a fixed batch: the trainer's own loss computation runs on the tiny model, the
reference formula on the same model's logits (a plain forward, log-softmax at the sampling temperature).

Token objective (PPO-clip, as GRPO / DAPO write it): l_t = -min(r_t A, clip(r_t, 1 - eps, 1 + eps_high) A)
with r_t = pi(o_t) / pi_old(o_t); GSPO's sequence level replaces r_t by exp(mean_t log r_t). KL to the
reference: the k3 estimator exp(ref - logp) - (ref - logp) - 1 (DeepSeekMath), weighted by the ratio
(DeepSeek-V3.2's unbiased reverse KL, TRL's default), added as beta x KL. Aggregation:
grpo   mean over answers of (sum_t l_t / |o|)                     (DeepSeekMath)
bnpo   sum of l_t / number of answer tokens in the micro-batch
dr_grpo sum of l_t / (answers x max_new_tokens)                   (Dr. GRPO)
dapo   sum of l_t / answer tokens of the whole generation batch   (DAPO)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmstack.config.load import build_config
from lmstack.launch.context import LaunchContext
from lmstack.plan.runplan import RunPlan

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "stages"
EPS, EPS_HIGH, TEMPERATURE, MAX_NEW = 0.2, 0.28, 0.7, 6


def _plan(tiny_model, tmp_path, **fields) -> RunPlan:
    flat = {
        "model_name_or_path": str(tiny_model),
        "template": "qwen",
        "stage": "grpo",
        "finetuning_type": "full",
        "dataset": "rl_prompts",
        "dataset_dir": str(FIXTURES),
        "output_dir": str(tmp_path / "out"),
        "reward_funcs": "length",
        "per_device_train_batch_size": 4,
        "num_generations": 2,
        "max_new_tokens": MAX_NEW,
        "temperature": TEMPERATURE,
        "epsilon": EPS,
        "epsilon_high": EPS_HIGH,
        "report_to": "none",
        **fields,
    }
    return RunPlan.resolve(build_config(flat), LaunchContext())


def _trainer(plan: RunPlan):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    from lmstack.train import grpo, rlhf
    from lmstack.train.rewards import length_reward

    torch.manual_seed(0)
    cfg = plan.cfg
    tok = AutoTokenizer.from_pretrained(cfg.model.model_name_or_path)
    model = AutoModelForCausalLM.from_pretrained(cfg.model.model_name_or_path, dtype=torch.float32)
    g = cfg.generating
    args = rlhf.trl_config(
        plan,
        GRPOConfig,
        num_generations=cfg.finetuning.num_generations,
        max_completion_length=g.max_new_tokens,
        temperature=g.temperature,
        **grpo.rl_kwargs(plan),
    )
    return grpo.TemplatePromptGRPOTrainer(
        model=model,
        reward_funcs=[length_reward(MAX_NEW)],
        args=args,
        train_dataset=Dataset.from_list([{"prompt": "Hello"}] * 4),
        processing_class=tok,
    )


def _batch(vocab: int) -> dict:
    """4 answers of up to 6 tokens after 3-token prompts (left-padded prompt, right-padded answers),
    mixed-sign advantages, sampling-time and reference log-probs off the current ones so that the clip
    binds on both sides."""
    g = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(0, vocab, (4, 3), generator=g)
    prompt_mask = torch.tensor([[1, 1, 1], [0, 1, 1], [1, 1, 1], [0, 0, 1]])
    completion_ids = torch.randint(0, vocab, (4, MAX_NEW), generator=g)
    completion_mask = torch.tensor(
        [[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0]]
    )
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.tensor([1.3, -0.7, 0.4, -1.1]),
        "num_items_in_batch": completion_mask.sum(),
        "_old_shift": 0.35 * torch.randn(4, MAX_NEW, generator=g),
        "_ref_shift": 0.5 * torch.randn(4, MAX_NEW, generator=g),
    }


def _logps(model, batch) -> torch.Tensor:
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    logits = model(input_ids=ids, attention_mask=mask).logits  # the model's own forward, all positions
    n = batch["completion_ids"].size(1)
    logp = torch.log_softmax(logits[:, -n - 1 : -1].float() / TEMPERATURE, dim=-1)
    return logp.gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1)


def reference_loss(logp, batch, loss_type: str, level: str, beta: float, accumulation: int) -> torch.Tensor:
    m = batch["completion_mask"].float()
    old = (logp.detach() + batch["_old_shift"]) * m
    adv = batch["advantages"].unsqueeze(1)
    log_ratio = logp - old
    if level == "sequence":
        log_ratio = ((log_ratio * m).sum(1) / m.sum(1)).unsqueeze(1)
    ratio = torch.exp(log_ratio)
    token = -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - EPS, 1 + EPS_HIGH) * adv)
    if beta:
        ref = (logp.detach() + batch["_ref_shift"]) * m
        token = token + beta * ratio * (torch.exp(ref - logp) - (ref - logp) - 1)
    token = token * m
    if loss_type == "grpo":
        return (token.sum(1) / m.sum(1)).mean() / accumulation
    if loss_type == "bnpo":
        return token.sum() / m.sum() / accumulation
    if loss_type == "dr_grpo":
        return token.sum() / (token.size(0) * MAX_NEW) / accumulation
    assert loss_type == "dapo"  # one generation batch per optimizer step: its tokens are the normaliser
    return token.sum() / batch["num_items_in_batch"]


@pytest.mark.parametrize(
    ("loss_type", "level", "beta"),
    [
        ("grpo", "token", 0.04),
        ("bnpo", "token", 0.0),
        ("dr_grpo", "token", 0.04),
        ("dapo", "token", 0.04),
        ("dapo", "token", 0.0),
        ("grpo", "sequence", 0.04),
    ],
)
def test_loss_type_equals_the_papers_objective(tiny_model, tmp_path, loss_type, level, beta):
    plan = _plan(tiny_model, tmp_path, loss_type=loss_type, importance_sampling_level=level, pref_beta=beta)
    assert plan.rl.loss_type == loss_type and plan.rl.beta == beta
    trainer = _trainer(plan)
    assert (trainer.loss_type, trainer.epsilon_low, trainer.epsilon_high) == (loss_type, EPS, EPS_HIGH)
    assert trainer.importance_sampling_level == level and trainer.beta == beta
    assert (trainer.ref_model is None) == (beta == 0)  # beta 0: TRL loads no reference at all
    model = trainer.model
    model.train()
    trainer.current_gradient_accumulation_steps = 1
    batch = _batch(model.config.vocab_size)

    with torch.no_grad():
        current = _logps(model, batch)
    m = batch["completion_mask"].float()
    inputs = {k: v for k, v in batch.items() if not k.startswith("_")}
    inputs["old_per_token_logps"] = (current + batch["_old_shift"]) * m
    if beta:
        inputs["ref_per_token_logps"] = (current + batch["_ref_shift"]) * m

    theirs = trainer._compute_loss(model, inputs)
    theirs.backward()
    their_grad = model.lm_head.weight.grad.clone()
    model.zero_grad()

    ours = reference_loss(_logps(model, batch), batch, loss_type, level, beta, accumulation=1)
    ours.backward()
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-6)
    # TRL scores the head in tiles, the reference over the full logits: the same gradient to float rounding
    grad = model.lm_head.weight.grad
    torch.testing.assert_close(their_grad, grad, rtol=1e-4, atol=1e-5 * grad.abs().max().item())
    # the clip binds on both sides of this batch (the test exercises clip-higher, not just the ratio)
    ratio = torch.exp(-batch["_old_shift"])[m.bool()]
    assert (ratio < 1 - EPS).any() and (ratio > 1 + EPS_HIGH).any()


def test_every_rl_knob_reaches_trl(tiny_model, tmp_path):
    plan = _plan(
        tiny_model,
        tmp_path,
        loss_type="bnpo",
        scale_rewards="batch",
        mask_truncated_completions=True,
        num_iterations=2,
        steps_per_generation=2,
        pref_beta=0,
        reward_weights="0.5",
    )
    trainer = _trainer(plan)
    assert (trainer.loss_type, trainer.scale_rewards, trainer.mask_truncated_completions) == (
        "bnpo",
        "batch",
        True,
    )
    assert (trainer.num_iterations, trainer.args.steps_per_generation) == (2, 2)
    assert trainer.beta == 0 and trainer.ref_model is None
    assert trainer.reward_weights.tolist() == [0.5]
    assert plan.rl.stale  # generation every 4 micro-steps, optimizer every 1: old log-probs are recorded
    assert trainer.args.gradient_accumulation_steps % (2 * 2) != 0
