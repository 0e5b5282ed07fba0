"""Offloaded checkpointing (use_unsloth_gc, models/offload_ckpt.py): the pack hook parks exactly the
decoder layers' input hidden states -- one per layer, nothing else -- and the gradients are those of
plain checkpointing. CPU, fp32, the tiny model through from_pretrained."""

from __future__ import annotations

import pytest
import torch

from lmstack.models.offload_ckpt import enable_offloaded_checkpointing

BATCH, SEQ = 2, 16


def model_and_ids(tiny_model):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ))
    return model, ids


def grads(model, ids) -> dict[str, torch.Tensor]:
    model.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("reentrant", [False, True])
def test_pack_parks_one_layer_input_per_layer_and_nothing_else(tiny_model, reentrant):
    model, ids = model_and_ids(tiny_model)
    offloader = enable_offloaded_checkpointing(model, {"use_reentrant": reentrant})
    model.enable_input_require_grads()  # as train/common.py does (reentrant needs a grad-requiring input)
    model(input_ids=ids, labels=ids).loss.backward()
    cfg = model.config
    # one [batch, seq, hidden] fp32 tensor per layer: the layer inputs, none of the tensors saved inside
    assert offloader.packed == cfg.num_hidden_layers
    assert offloader.packed_bytes == cfg.num_hidden_layers * BATCH * SEQ * cfg.hidden_size * 4


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradients_equal_plain_checkpointing(tiny_model, reentrant):
    model, ids = model_and_ids(tiny_model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    plain = grads(model, ids)
    model, _ = model_and_ids(tiny_model)
    enable_offloaded_checkpointing(model, {"use_reentrant": reentrant})
    model.enable_input_require_grads()
    offloaded = grads(model, ids)
    assert plain.keys() == offloaded.keys() and len(plain) > 0
    for name, g in plain.items():
        torch.testing.assert_close(offloaded[name], g, rtol=1e-5, atol=1e-6, msg=name)


def test_a_model_without_checkpointable_layers_is_refused_by_name():
    with pytest.raises(ValueError, match="use_unsloth_gc: Linear has no checkpointable decoder layers"):
        enable_offloaded_checkpointing(torch.nn.Linear(2, 2), {"use_reentrant": False})


def test_a_retained_graph_unpacks_the_parked_inputs_again(tiny_model):
    model, ids = model_and_ids(tiny_model)
    enable_offloaded_checkpointing(model, {"use_reentrant": False})
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward(retain_graph=True)
    first = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    loss.backward()  # the second backward needs every layer input back once more
    for n, p in model.named_parameters():
        if n in first:
            torch.testing.assert_close(p.grad, 2 * first[n], rtol=1e-5, atol=1e-6, msg=n)
