"""The planner rules for full checkpointing's recompute, the accumulation margin under classic
AMP, the loss head above the recompute: the cases where they once gave a wrong number, each through the path
`lmstack plan` takes (a YAML on a config.json-only Qwen2.5 folder) or the run's own code path on CPU."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lmstack.config.load import build_config
from lmstack.memory import memory as mem
from lmstack.memory import plan
from lmstack.memory.estimate import Setup, estimate
from lmstack.plan.whatif import plan_for, request_from_config


def _margin(gpu) -> float:
    return sum(v for name, v in gpu.terms if name.startswith("margin: accumulating"))


def test_badam_keeps_its_bf16_weights_in_every_row(qwen):
    """BAdam under bf16 keeps the weights in half precision (decide.precision: load bf16, fp32 copies of one
    block only), so no row of it is classic AMP: not the configured one, not a searched single-GPU row. It
    was estimated as fp32 weights in the model (twice the weights, a negative optimizer row) with the
    accumulation margin on top."""
    flat = dict(model_name_or_path=qwen("0.5b"), output_dir="o", bf16=True, cutoff_len=1024,
                finetuning_type="full", use_badam=True, per_device_train_batch_size=4,
                gradient_accumulation_steps=4, gradient_checkpointing=False, flash_attn="sdpa")  # fmt: skip
    cfg = build_config(flat)
    assert plan_for(cfg, 1, 80).precision.load == "bf16"  # what the run does
    result = plan(request_from_config(cfg, 1, 80))
    gpu = result.configured.estimate.gpu
    assert not result.configured.setup.fp32_model_weights
    assert gpu.optimizer >= 0 and _margin(gpu) == 0.0
    assert gpu.weights * mem.GIB == pytest.approx(2 * result.request.spec.num_params, rel=1e-3)
    badam = [c for c in result.candidates if c.setup.optimizer == "badam" and c.setup.deepspeed_stage is None]
    assert badam and all(not c.setup.fp32_model_weights for c in badam)


def _freeze_kept_bytes(path, live_bytes, checkpoint_layers: int | None) -> float:
    """Bytes per token the decoder layers leave for the backward (live when the final norm starts, less its
    input) in one freeze-tuning step, last layer trainable, every layer (None) or the first k checkpointed,
    set up in train/sft.py's order (lmstack's enable_gradient_checkpointing, then the freeze)."""
    import torch
    from transformers import AutoModelForCausalLM

    from lmstack.launch.context import LaunchContext
    from lmstack.models.adapters import setup_finetuning
    from lmstack.plan.runplan import RunPlan
    from lmstack.train.common import enable_gradient_checkpointing

    yaml = dict(output_dir="o", template="qwen", stage="sft", finetuning_type="freeze", freeze_trainable_layers=1,
                bf16=True, model_name_or_path=str(path))  # fmt: skip
    p = RunPlan.resolve(build_config(yaml), LaunchContext())
    p = replace(p, checkpointing=True, checkpoint_layers=checkpoint_layers)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa")
    enable_gradient_checkpointing(p, model)
    model = setup_finetuning(p.cfg, model)
    model.train()
    tracker, kept = live_bytes(model), []
    model.get_decoder().norm.register_forward_pre_hook(
        lambda _, args: kept.append(tracker.live - args[0].untyped_storage().nbytes())
    )
    ids = torch.randint(3, model.config.vocab_size, (2, 256))
    with tracker.mode:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(input_ids=ids, labels=ids).loss.backward()
    return kept[0] / ids.numel()


def test_freeze_tuning_with_checkpointing_keeps_every_layers_input(tmp_path, live_bytes):
    """With checkpointing, enable_gradient_checkpointing calls enable_input_require_grads for every method
    but full: the embedding output requires grad, so the frozen layers below the trainable ones record too.
    Every layer keeps its checkpointed input (traced: 4 of 4 layers' 2h, with one trainable), and a frozen
    layer above the checkpointed ones keeps its activations. The planner counted only the trainable layers."""
    from lmstack.memory.estimate import kept_recomputed
    from lmstack.memory.model_spec import ModelSpec
    from lmstack.tiny import build_tiny_model

    path = build_tiny_model(tmp_path / "m", data_dir=None, hidden_size=256, intermediate_size=512,
                            num_hidden_layers=4)  # fmt: skip
    spec = ModelSpec.from_pretrained_dir(str(path))
    s = Setup(finetuning_type="freeze", freeze_trainable_layers=1, gradient_checkpointing=True)
    inputs = _freeze_kept_bytes(path, live_bytes, None) / mem.checkpointed_bytes_per_token_layer(256)
    assert inputs == pytest.approx(4, rel=0.1)  # measured 4.26 (the rotary tables besides)
    assert kept_recomputed(spec, s) == (0, 4)
    # partial (the first k recompute): the frozen layers k.. above them keep their activations too
    one, three = (_freeze_kept_bytes(path, live_bytes, k) for k in (1, 3))
    assert one - three > 2 * mem.checkpointed_bytes_per_token_layer(256) * 2  # layers 1, 2: more than inputs
    assert kept_recomputed(spec, replace(s, checkpoint_layers=1)) == (3, 1)
    assert kept_recomputed(spec, replace(s, checkpoint_layers=3)) == (1, 3)


def test_freeze_tuning_accumulation_margin_is_its_trainable_paths(qwen):
    """The accumulation margin under classic AMP is the bf16 copy of each weight autocast saves for the
    backward (memory.ACCUMULATING_CLASSIC_AMP_MARGIN_BYTES): autocast caches only weights that require grad
    and the frozen layers below the trainable ones build no graph, so a freeze-tuned run carries it for its
    trainable layers and the head its loss backpropagates through, not for every parameter (7B, two of 28
    layers trained: 14.2 GiB before, 1.9 after)."""
    base = dict(model_name_or_path=qwen("7b"), output_dir="o", bf16=True, cutoff_len=1024,
                per_device_train_batch_size=2, gradient_accumulation_steps=4, gradient_checkpointing=False,
                flash_attn="sdpa")  # fmt: skip
    full = plan(request_from_config(build_config({**base, "finetuning_type": "full"}), 1, 139.8))
    spec = full.request.spec
    assert _margin(full.configured.estimate.gpu) * mem.GIB == pytest.approx(2 * spec.num_params)
    for k in (2, 4):
        cfg = build_config({**base, "finetuning_type": "freeze", "freeze_trainable_layers": k})
        result = plan(request_from_config(cfg, 1, 139.8))
        assert result.configured.setup.fp32_model_weights  # classic AMP: accumulation blocks the masters
        grad_path = k * spec.layer_params + spec.vocab_size * spec.hidden_size
        assert _margin(result.configured.estimate.gpu) * mem.GIB == pytest.approx(2 * grad_path)


def test_the_accumulation_margin_is_freed_before_the_optimizer_step(specs):
    """The margin stands for activations the model misses (autocast's bf16 weight copies): the backward
    frees them like the activations, so torch's multi-tensor AdamW step (sqrt(exp_avg_sq) of every
    parameter, after the backward) raises the peak only above activations + loss + margin. Where the step
    is the peak, an accumulating run peaks where the one-step run does; the margin was stacked on it."""
    from lmstack.memory.estimate import accumulation_terms, activations, loss_bytes

    spec = specs["qwen2.5-0.5b"]
    acc = Setup(finetuning_type="full", fp32_model_weights=True, adam_foreach=True, micro_batch=1,
                optimizer_batch=4, seq_len=256, gradient_checkpointing=True, fused_ce=True)  # fmt: skip
    ((_, margin),) = accumulation_terms(spec, acc)
    step = mem.FOREACH_ADAM_TEMP_BYTES * spec.num_params
    assert step > activations(spec, acc) + loss_bytes(spec, acc) + margin  # the step is this run's peak
    one_step = estimate(spec, replace(acc, optimizer_batch=1)).gpu
    assert estimate(spec, acc).gpu.allocated == pytest.approx(one_step.allocated)


def test_eager_attention_recompute_phase_holds_the_layers_scores(specs):
    """With every layer recomputed the loss head counts only above the recompute phase; under eager
    attention the recomputed layer holds its s x s scores too (they are in the activations' recomputed
    layer), so the phase the loss never meets is that whole layer: the training phase above the
    checkpointed inputs is the larger of the two, not their partial sum."""
    from lmstack.memory.estimate import (
        activations,
        loss_bytes,
        outside_layers_bytes,
        recompute_phase_bytes,
        train_tokens,
    )

    spec = specs["qwen2.5-0.5b"]
    s = Setup(
        finetuning_type="lora", micro_batch=4, seq_len=1024, gradient_checkpointing=True, attention="eager"
    )
    inputs = train_tokens(s) * spec.num_layers * mem.checkpointed_bytes_per_token_layer(spec.hidden_size)
    inputs += outside_layers_bytes(spec, s)  # the embedding output (eager: no packed SDPA mask)
    recompute = activations(spec, s) - inputs  # one layer's full activations, scores included, + its backward
    assert recompute_phase_bytes(spec, s) == pytest.approx(recompute)
    head = mem.logits_bytes(train_tokens(s), spec.vocab_size, fused=False)
    assert activations(spec, s) + loss_bytes(spec, s) == pytest.approx(inputs + max(head, recompute))


def test_freeze_tuning_of_the_first_layers(qwen):
    """freeze_trainable_layers: -k trains the first k layers (LF; models/adapters.apply_freeze): as many
    trainable parameters as the last k, and every layer above the first trainable one on the graph. The
    planner took -k as the count: negative gradients, optimizer and activations."""
    base = dict(model_name_or_path=qwen("0.5b"), output_dir="o", bf16=True, cutoff_len=1024,
                finetuning_type="freeze", per_device_train_batch_size=4, gradient_checkpointing=False,
                flash_attn="sdpa")  # fmt: skip

    def gpu(**kw):
        return plan(request_from_config(build_config({**base, **kw}), 1, 80)).configured.estimate.gpu

    last, first, full = (
        gpu(freeze_trainable_layers=2),
        gpu(freeze_trainable_layers=-2),
        gpu(finetuning_type="full"),
    )
    assert first.gradients == pytest.approx(last.gradients) and first.optimizer == pytest.approx(
        last.optimizer
    )
    # all 24 layers above layer 0 record; the 22 frozen ones keep less than a trained layer (their linears
    # save no input for a weight gradient: estimate.frozen_layers_saving)
    spec = plan(
        request_from_config(build_config({**base, "freeze_trainable_layers": -2}), 1, 80)
    ).request.spec
    saving = 22 * 4 * 1024 * mem.frozen_layer_discount_bytes_per_token(896, 4864, False, False) / mem.GIB
    assert spec.num_layers == 24 and saving > 0
    assert first.activations == pytest.approx(full.activations - saving)
    assert last.activations < first.activations / 5


def test_an_fsdp_row_is_estimated_alike_whichever_strategy_the_yaml_names(qwen):
    """A DDP config that accumulates runs classic AMP (fp32 weights in the model); its searched FSDP rows
    run FSDP's MixedPrecision like a config that names FSDP, whose row is estimated with bf16 compute
    weights (from_config: no classic AMP under FSDP). The searched row kept the DDP row's fp32 weights: the
    same FSDP setup was 14.3 GiB searched and 13.3 GiB configured (0.5B full, 2 GPUs)."""
    base = dict(model_name_or_path=qwen("0.5b"), output_dir="o", bf16=True, cutoff_len=1024,
                finetuning_type="full", per_device_train_batch_size=4, gradient_accumulation_steps=4,
                gradient_checkpointing=False, flash_attn="sdpa", optim="adamw_torch")  # fmt: skip
    ddp = plan(request_from_config(build_config(base), 2, 80))
    assert ddp.configured.setup.fp32_model_weights  # DDP + accumulation: classic AMP
    fsdp = plan(request_from_config(build_config({**base, "fsdp": "full_shard auto_wrap"}), 2, 80)).configured
    assert fsdp.strategy.name == "fsdp_full_shard" and not fsdp.setup.fp32_model_weights
    same = [c for c in ddp.candidates if replace(c.setup, fp32_model_weights=False) == fsdp.setup]
    assert same and all(c.estimate.gpu.allocated == pytest.approx(fsdp.estimate.gpu.allocated) for c in same)
