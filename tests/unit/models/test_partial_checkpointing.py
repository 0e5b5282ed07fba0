"""Partial gradient checkpointing (plan.checkpoint_layers, models/checkpointing.py, train/common.py): with k
of the N decoder layers checkpointed, a training step gives the loss and gradients of no / full
checkpointing, and only the first k layers run their forward again in the backward. CPU, fp32, a 4-layer
tiny model written with save_pretrained and loaded back through from_pretrained."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from lmstack.config.load import build_config
from lmstack.launch.context import LaunchContext
from lmstack.models.checkpointing import decoder_layers, keep_activations_above
from lmstack.plan.runplan import RunPlan
from lmstack.train import common

LAYERS, BATCH, SEQ = 4, 2, 16
DATA_DIR = Path(__file__).resolve().parents[3] / "data"


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory) -> Path:
    from lmstack.tiny import build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("tiny4") / "m", data_dir=DATA_DIR, num_hidden_layers=LAYERS
    )


def run_plan(base_cfg, model_dir, checkpointing: bool, layers: int | None, reentrant: bool) -> RunPlan:
    cfg = {**base_cfg, "model_name_or_path": str(model_dir), "finetuning_type": "full"}
    cfg.update(gradient_checkpointing=checkpointing, use_reentrant_gc=reentrant)
    plan = RunPlan.resolve(build_config(cfg), LaunchContext())
    return replace(plan, checkpoint_layers=layers)  # what the planner sets under auto on a GPU


def counted(forward, calls: list[int], i: int):
    def run(*args, **kwargs):
        calls[i] += 1
        return forward(*args, **kwargs)

    return run


def step(model_dir, plan: RunPlan):
    """One forward + backward of the model set up by train/common.py; (loss, grads, MLP calls per layer
    in the forward, MLP calls per layer in the backward, the model)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    common.enable_gradient_checkpointing(plan, model)
    calls = [0] * LAYERS
    for i, layer in enumerate(decoder_layers(model)):
        layer.mlp.forward = counted(layer.mlp.forward, calls, i)  # module hooks may not run in a recompute
    ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    loss = model(input_ids=ids, labels=ids).loss
    forward = list(calls)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, forward, [c - f for c, f in zip(calls, forward)], model


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("k", [1, 3])
def test_k_of_n_layers_checkpointed_equals_none_and_all_and_only_the_first_k_recompute(
    base_cfg, four_layers, k, reentrant
):
    none = step(four_layers, run_plan(base_cfg, four_layers, False, None, reentrant))
    full = step(four_layers, run_plan(base_cfg, four_layers, True, None, reentrant))
    part = step(four_layers, run_plan(base_cfg, four_layers, True, k, reentrant))
    assert none[3] == [0] * LAYERS and full[3] == [1] * LAYERS  # the counter sees recomputes
    assert part[2] == [1] * LAYERS
    assert part[3] == [1] * k + [0] * (LAYERS - k)  # the first k recompute, the last N - k keep activations
    for other in (none, full):
        torch.testing.assert_close(part[0], other[0], rtol=1e-6, atol=1e-7)
        assert part[1].keys() == other[1].keys() and len(part[1]) > 0
        for name, g in other[1].items():
            torch.testing.assert_close(part[1][name], g, rtol=1e-5, atol=1e-6, msg=name)


def test_partial_offloaded_checkpointing_parks_only_the_recomputed_layers_inputs(base_cfg, four_layers):
    plan = replace(run_plan(base_cfg, four_layers, True, 2, False), checkpoint_offload=True)
    loss, grads, _, recomputed, model = step(four_layers, plan)
    full = step(four_layers, run_plan(base_cfg, four_layers, True, None, False))
    assert recomputed == [1, 1, 0, 0]
    offloader = decoder_layers(model)[0]._gradient_checkpointing_func.offloader
    assert offloader.packed == 2 and offloader.packed_bytes == 2 * BATCH * SEQ * model.config.hidden_size * 4
    torch.testing.assert_close(loss, full[0], rtol=1e-6, atol=1e-7)
    for name, g in full[1].items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=name)


def test_a_count_the_model_does_not_have_is_refused_by_name(four_layers):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(four_layers, dtype=torch.float32)
    model.gradient_checkpointing_enable()
    with pytest.raises(
        ValueError, match="5 recomputed layers asked for, but Qwen2ForCausalLM has 4 .* 1 .. 4"
    ):
        keep_activations_above(model, 5)
