"""The stages' own memory terms, each read from the code path that runs (TRL 1.16, lmstack's PPO).

Every term is a named row of the breakdown (bytes per GPU, what it adds to the peak):

* dpo (TRL DPOTrainer): chosen + rejected are one batch of 2 x micro_batch rows (``rows_per_example``);
  the policy's log-probs come from TRL's fused log-prob head (no logits, memory.trl_logprob_bytes); then
  the reference forward runs under no_grad *while the policy's activations are held* (before the
  backward): its working set is one decoder layer of the batch plus one log-prob tile. The reference is
  the policy with the adapter disabled (LoRA: no weights) or a frozen copy (full/freeze, ref_model).
* orpo / simpo (TRL's experimental ORPO/CPO trainers): no reference; 2 x rows; the model's full
  [tokens x vocab] logits and a log-softmax over them (``full_logits``).
* kto (TRL KTOTrainer): the KL batch (each prompt with another row's answer) is a no-grad forward of
  the policy *before* its own forward, so it never meets the policy's activations: it adds only where
  its one-layer working set exceeds them. The reference then scores the KL batch and the batch, one
  after the other, on top of the held activations.
* rm (TRL RewardTrainer + lmstack's value head): 2 x rows, no LM logits (logits_to_keep=1), the fp32
  copy of the last hidden states the value head reads (``value_head``).
* grpo / rloo (TRL): sampling ``generated_rows`` completions at once holds their KV cache over
  prompt + completion tokens and the sampling logits; then the training forward over micro_batch
  rows of the same length uses the fused log-prob head. The two phases never coexist: the generation
  row adds only what exceeds the training phase's activations + loss. A full-tuning KL term
  (pref_beta > 0) loads a frozen copy as reference.
* ppo (train/ppo.py): the rollout (KV cache + a no-grad forward over all rollout rows with their full
  logits and fp32 log-softmax of the answers) and the update (micro_batch rows, full logits); the
  reference (adapter off / copy) and the reward model's weights stay loaded; the rollout buffer
  (ids, masks, log-probs, values, advantages, returns) stays on the GPU through the update.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmstack.memory import memory as mem

if TYPE_CHECKING:
    from lmstack.memory.estimate import Setup
    from lmstack.memory.model_spec import ModelSpec

PAIRED_STAGES = ("dpo", "rm")  # chosen + rejected in one batch (orpo/simpo are dpo's pref_loss values)
REFERENCE_FREE_LOSSES = ("orpo", "simpo")
# rollout buffer per token per row: input ids + attention + answer mask (int64) and the fp32 log-prob,
# value, advantage, return, reference log-prob (train/ppo.py make_experience)
ROLLOUT_BUFFER_BYTES_PER_TOKEN = 3 * 8 + 5 * mem.FP32_BYTES


# rows that stay allocated through the optimizer step (weights, the rollout buffer); every other stage row is a
# forward's or a generation's working set, freed before the step (estimate's step transient can reuse it)
REFERENCE_COPY_ROW = "reference model weights (frozen copy)"
PERSISTENT_ROWS = (REFERENCE_COPY_ROW, "reward model weights", "rollout buffer")


# How the runs recorded before the frozen copy loaded in the compute dtype loaded it: like the policy (RunPlan.
# model_spec's load dtype). bench/plan_check.run_model sets it for them; the planner itself never does.
REFERENCE_COPY_LIKE_THE_POLICY = False


def reference_copy_bytes_per_param(s: Setup) -> int:
    """train/rlhf.load_frozen_model loads the frozen copy in the compute dtype (bf16; LF does the same), so it is
    bf16 under every scheme. Before, it loaded like the policy (RunPlan.model_spec's load dtype): fp32 under
    classic AMP (Setup.classic_amp), traced on the H200 (plan_accuracy.json `snap_r8_dpo_1.5b_full_mb2_ckpt`: 11.50 GiB of weights
    for the 1.5B policy and its reference, two fp32 copies), and fp32 under FSDP for full/freeze, which shards
    a module as loaded (MixedPrecision casts only the gathered copies; tests/unit/plan/test_reference_copy_and_recorded_layers.py);
    REFERENCE_COPY_LIKE_THE_POLICY models those runs."""
    if not REFERENCE_COPY_LIKE_THE_POLICY:
        return mem.BF16_BYTES
    full_or_freeze = s.finetuning_type != "lora"
    fsdp_fp32 = s.fsdp is not None and full_or_freeze and not s.pure_bf16 and s.optimizer != "badam"
    return mem.FP32_BYTES if s.classic_amp or fsdp_fp32 else mem.BF16_BYTES


def reference_copy_bytes(spec: ModelSpec, s: Setup) -> float:
    """The frozen copy's bytes per GPU: whole, or partitioned by ZeRO-3; FSDP shards it over every rank, and
    SHARD_GRAD_OP, which does not reshard a module after a forward without a backward (read from torch's FSDP
    code, not traced), keeps the whole bf16 gathered copy beside the shards."""
    stored = reference_copy_bytes_per_param(s) * spec.num_params
    if s.fsdp is None:
        return stored / _sharded(s)
    gathered = mem.BF16_BYTES * spec.num_params if s.fsdp == "SHARD_GRAD_OP" else 0.0
    return stored / s.num_gpus + gathered


def step_freed_bytes(rows: tuple[tuple[str, float], ...]) -> float:
    """The stage rows freed before the optimizer step (all but PERSISTENT_ROWS)."""
    return sum(v for name, v in rows if name not in PERSISTENT_ROWS)


def _sharded(s: Setup) -> int:
    """How many ways DeepSpeed splits a frozen copy: ZeRO-3 shards it, the lower stages keep it whole (FSDP:
    reference_copy_bytes)."""
    return s.num_gpus if s.deepspeed_stage == 3 else 1


def _no_grad_forward(spec: ModelSpec, s: Setup, layer_bytes: float) -> float:
    """One decoder layer's working set of the batch (what a no-grad forward holds at once: a share of the
    layer's activations, memory.NO_GRAD_FORWARD_LAYER_SHARE) + one tile of TRL's log-prob head."""
    tokens = s.micro_batch * s.rows_per_example * s.seq_len
    tile = min(tokens, mem.TRL_LOGPROB_TOKEN_TILE) * min(spec.vocab_size, mem.TRL_LOGPROB_VOCAB_TILE)
    return mem.NO_GRAD_FORWARD_LAYER_SHARE * layer_bytes + mem.BF16_BYTES * tile


def _generation_phase(spec: ModelSpec, s: Setup) -> tuple[float, str]:
    rows, length = s.generated_rows, s.seq_len
    kv = mem.kv_cache_bytes(rows, length, spec.num_layers, spec.kv_dim)
    phase = kv + mem.sampling_logits_bytes(rows, spec.vocab_size)
    if s.stage == "ppo":  # make_experience: a no-grad forward over every rollout row, full logits
        answer = max(length - s.prompt_len, 0)
        phase += (
            mem.BF16_BYTES * rows * length * spec.vocab_size
            + 2 * mem.FP32_BYTES * rows * answer * spec.vocab_size
        )
    return phase, f"generation: KV cache of {rows} x {length} tokens + sampling logits"


def stage_terms(
    spec: ModelSpec, s: Setup, train_phase: float, layer_bytes: float, headroom: float = 0.0
) -> tuple[tuple[str, float], ...]:
    """The named rows `s.stage` adds to the SFT-shaped estimate (bytes). `train_phase`: the training
    forward/backward's activations + loss bytes; `layer_bytes`: one layer's full activations of the batch;
    `headroom`: with full checkpointing, how far the backward's recompute rises above the loss head
    (estimate.recompute_phase_bytes) -- the reference forward runs between the policy's forward and its
    backward, next to the checkpointed inputs and the loss head, so only its part above that headroom adds."""
    rows: list[tuple[str, float]] = []
    if s.reference == "copy":
        rows.append((REFERENCE_COPY_ROW, reference_copy_bytes(spec, s)))
    if s.stage in ("dpo", "kto") and s.reference != "none":
        passes = "KL batch + batch, one at a time" if s.kl_batch else "the batch"
        where = "above the recompute" if headroom else "over the held activations"
        rows.append((f"reference forward, no grad ({passes}), {where}",
                     max(0.0, _no_grad_forward(spec, s, layer_bytes) - headroom)))  # fmt: skip
    if s.kl_batch:  # before the policy's forward: only its excess over the training phase counts
        rows.append(("KL batch forward, no grad (before the policy forward)",
                     max(0.0, _no_grad_forward(spec, s, layer_bytes) - train_phase)))  # fmt: skip
    if s.generated_rows:
        phase, name = _generation_phase(spec, s)
        rows.append((name, max(0.0, phase - train_phase)))
    if s.stage == "ppo":
        rows.append(("reward model weights", mem.BF16_BYTES * s.reward_model_params))
        rows.append(("rollout buffer", ROLLOUT_BUFFER_BYTES_PER_TOKEN * s.generated_rows * s.seq_len))
    return tuple(rows)
