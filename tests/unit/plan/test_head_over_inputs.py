"""With every decoder layer checkpointed the loss head meets only the layers' inputs. Traced on the H200 (round 8,
plan_accuracy.json `snap_r8_freeze_0.5b_mb8_ckpt`): lmstack's chunked CE there holds its code's own 6 B per
chunk element (the fp32 copy and the bf16 gradient of one 2048 x V chunk) and a few per-token tensors beside
it, not the 9 B fitted on runs whose peak also holds every layer's activations; the planner's 9 B made that
freeze-tuning run +17.6%. Next to the inputs the embedding output and the packed rows' SDPA mask stay alive
through the step, and under classic AMP every input is fp32."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lmstack.memory import memory as mem
from lmstack.memory.estimate import (
    Setup,
    _loss_head_bytes,
    activations,
    input_hidden,
    outside_layers_bytes,
    train_tokens,
)


def test_the_chunked_ce_allocates_its_codes_six_bytes_per_chunk_element(live_bytes):
    """The kernel alone on the CPU, a frozen head (LoRA/freeze): the peak is one chunk's fp32 logits and
    their bf16 copy, 6 B x chunk x V, whatever the vocabulary."""
    from lmstack.models.kernels import linear_cross_entropy

    vocab, hidden, tokens = 32768, 128, 4096  # two chunks of models/kernels.DEFAULT_CHUNK
    weight = torch.randn(vocab, hidden, dtype=torch.bfloat16)
    states = torch.randn(tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,))
    tracker = live_bytes()
    tracker.skip |= {weight.untyped_storage().data_ptr(), states.untyped_storage().data_ptr()}
    with tracker.mode:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            linear_cross_entropy(states, weight, labels).backward()
    chunk = min(tokens, mem.LMSTACK_CE_CHUNK_TOKENS)
    assert tracker.peak / (chunk * vocab) == pytest.approx(mem.LMSTACK_CE_TRACED_BYTES, rel=0.03)


def test_the_traced_head_applies_only_when_every_layer_is_checkpointed(specs):
    spec = specs["qwen2.5-0.5b"]
    s = Setup(finetuning_type="freeze", micro_batch=8, seq_len=2048, gradient_checkpointing=True, fused_ce=True,
              liger=False)  # fmt: skip
    tokens, v, h = train_tokens(s), spec.vocab_size, spec.hidden_size
    traced = mem.LMSTACK_CE_TRACED_BYTES * 2048 * v + mem.LMSTACK_CE_SIDE_BYTES_PER_HIDDEN * tokens * h
    assert _loss_head_bytes(spec, s) == pytest.approx(traced)
    fitted = mem.LMSTACK_CE_BYTES * 2048 * v
    assert _loss_head_bytes(spec, replace(s, gradient_checkpointing=False)) == pytest.approx(fitted)
    # partial checkpointing: the kept layers' activations are alive at the head, the fitted figure stands
    assert _loss_head_bytes(spec, replace(s, checkpoint_layers=12)) == pytest.approx(fitted)


def test_full_checkpointing_counts_the_embedding_output_and_the_packed_mask(specs):
    """snap_r8_sft_0.5b_lora_mb16_ckpt_ga2 on the H200: beside the 24 layers' inputs (1.31 GiB) the embedding
    output (0.055 GiB) and masking_utils' block-diagonal bool mask, 16 x 2048^2 B (0.062 GiB)."""
    spec = specs["qwen2.5-0.5b"]
    s = Setup(finetuning_type="lora", micro_batch=16, seq_len=2048, gradient_checkpointing=True)
    tokens = train_tokens(s)
    assert outside_layers_bytes(spec, s) == pytest.approx(tokens * 2 * spec.hidden_size + 16 * 2048**2)
    # one unpacked row: no padding, SDPA's is_causal and no mask (a padded batch has one:
    # test_reference_copy_and_recorded_layers.py)
    assert outside_layers_bytes(spec, replace(s, packed=False, micro_batch=1)) == pytest.approx(
        tokens / 16 * 2 * spec.hidden_size
    )
    one_more_input = tokens * spec.num_layers * 2 * spec.hidden_size
    with_term = activations(spec, s)
    assert with_term - outside_layers_bytes(spec, s) > one_more_input  # the inputs and one recomputed layer


def test_classic_amp_checkpoints_fp32_inputs(specs):
    """Classic AMP's residual stream is fp32: every checkpointed layer input is 4h bytes per token."""
    spec = specs["qwen2.5-0.5b"]
    amp = Setup(finetuning_type="full", micro_batch=4, seq_len=2048, gradient_checkpointing=True,
                fp32_model_weights=True)  # fmt: skip
    masters = replace(amp, fp32_model_weights=False)
    assert input_hidden(spec, amp) == 2 * input_hidden(spec, masters) == 2 * spec.hidden_size
    inputs = (
        train_tokens(amp) * (spec.num_layers + 1) * 2 * spec.hidden_size
    )  # the layers' and the embedding's
    recompute_gap = activations(spec, amp) - activations(spec, masters)
    assert recompute_gap >= inputs  # (the recomputed layer's classic-AMP factor besides)
