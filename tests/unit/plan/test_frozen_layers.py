"""Freeze-tuning's frozen layers that record a graph (freeze_trainable_layers < 0: the first k layers train, the
backward runs through every frozen layer above them) keep less than a trained layer: a frozen linear saves no
input for a weight gradient, a frozen norm's weight product saves nothing. Traced here on CPU through the run's
own code path (the tiny model's real from_pretrained, lmstack's freeze and chunked CE, autocast like the
Trainer) with an allocation-level tracker: the difference per layer is memory.frozen_layer_discount_bytes_per_
token to the byte, with bf16 weights and under classic AMP. On the H200 the planner counted every recording
layer as a trained one: the freeze 1.5B run with the first 2 of 28 layers trained was +21.9% (round 8), -0.7%
with this term."""

from __future__ import annotations

import pytest

from lmstack.config.load import build_config
from lmstack.memory import memory as mem

LAYERS, ROWS, SEQ = 4, 2, 256  # ROWS x SEQ: what conftest.kept_per_token runs


@pytest.mark.parametrize("hidden,intermediate", [(256, 512), (128, 1536), (512, 1024)])
@pytest.mark.parametrize("classic_amp", [False, True], ids=["bf16-weights", "classic-amp"])
def test_a_frozen_recording_layer_keeps_the_traced_discount_less(tmp_path, kept_per_token, hidden, intermediate,
                                                                 classic_amp):  # fmt: skip
    from lmstack.tiny import build_tiny_model

    path = build_tiny_model(tmp_path / "m", data_dir=None, hidden_size=hidden, intermediate_size=intermediate,
                            num_hidden_layers=LAYERS)  # fmt: skip
    # the first layer trained (3 frozen above it) against the first three (1 frozen): layers 1 and 2 differ
    one = kept_per_token(path, classic_amp, freeze_trainable_layers=-1)
    three = kept_per_token(path, classic_amp, freeze_trainable_layers=-3)
    per_layer = (three - one) / 2
    expected = mem.frozen_layer_discount_bytes_per_token(hidden, intermediate, classic_amp, liger=False)
    assert per_layer == pytest.approx(expected, rel=0.01)  # measured: exact to the byte at every width


def test_classic_amp_frozen_layers_keep_a_bf16_copy_of_their_weights(tmp_path, kept_per_token):
    """Autocast caches the bf16 cast only of weights that require grad; a frozen fp32 weight is cast anew in
    every forward and its matmul keeps the copy for the input gradient: 2 B/param per recording frozen layer
    (estimate.frozen_layers_saving adds them back)."""
    from lmstack.memory.model_spec import ModelSpec
    from lmstack.tiny import build_tiny_model

    path = build_tiny_model(tmp_path / "m", data_dir=None, hidden_size=256, intermediate_size=512,
                            num_hidden_layers=LAYERS)  # fmt: skip
    spec = ModelSpec.from_pretrained_dir(str(path))
    tokens = ROWS * SEQ
    bf16 = kept_per_token(path, False, freeze_trainable_layers=-1) * tokens
    classic = kept_per_token(path, True, freeze_trainable_layers=-1) * tokens
    copies = (LAYERS - 1) * mem.BF16_BYTES * spec.layer_params
    assert classic - bf16 > copies  # the copies, and the fp32 residual stream's wider tensors besides


def test_the_planner_counts_the_frozen_layers_with_the_discount(qwen):
    """The 1.5B with its first 2 of 28 layers trained, accumulating under classic AMP (round 8's +21.9% run):
    26 frozen layers at the traced discount, plus their bf16 weight copies."""
    from lmstack.memory import plan
    from lmstack.memory.estimate import frozen_layers_saving
    from lmstack.plan.whatif import request_from_config

    base = dict(model_name_or_path=qwen("1.5b"), output_dir="o", bf16=True, cutoff_len=2048,
                per_device_train_batch_size=4, gradient_accumulation_steps=2, gradient_checkpointing=False,
                flash_attn="sdpa")  # fmt: skip

    def result(**kw):
        return plan(request_from_config(build_config({**base, **kw}), 1, 139.8))

    first = result(finetuning_type="freeze", freeze_trainable_layers=-2)
    full = result(finetuning_type="full")
    spec, s = first.request.spec, first.configured.setup
    assert s.fp32_model_weights  # accumulation: classic AMP
    discount = mem.frozen_layer_discount_bytes_per_token(
        spec.hidden_size, spec.intermediate_size, True, False
    )
    expected = 26 * (4 * 2048 * discount - mem.BF16_BYTES * spec.layer_params)
    assert frozen_layers_saving(spec, s) == pytest.approx(expected)
    saved = full.configured.estimate.gpu.activations - first.configured.estimate.gpu.activations
    assert saved * mem.GIB == pytest.approx(expected)
    # the last 2 trained: the frozen layers below build no graph, nothing to discount
    last = result(finetuning_type="freeze", freeze_trainable_layers=2)
    assert frozen_layers_saving(last.request.spec, last.configured.setup) == 0


def test_a_trained_embedding_puts_every_frozen_layer_on_the_backwards_path(tmp_path, kept_per_token, qwen):
    """freeze_extra_modules: embed_tokens with the last layer trained: the backward reaches the embedding, so
    the three frozen layers below record too (traced: one frozen layer's bf16 figure each, 2(6h + 2kv + 3i) per
    token, to 2%), and the embedding's parameters train (gradients, optimizer states; the tied head with it).
    The planner had counted neither."""
    from lmstack.memory import plan
    from lmstack.memory.estimate import frozen_recording_layers, head_trainable
    from lmstack.memory.model_spec import ModelSpec
    from lmstack.plan.whatif import request_from_config
    from lmstack.tiny import build_tiny_model

    hidden, intermediate = 256, 512
    path = build_tiny_model(tmp_path / "m", data_dir=None, hidden_size=hidden, intermediate_size=intermediate,
                            num_hidden_layers=LAYERS)  # fmt: skip
    spec = ModelSpec.from_pretrained_dir(str(path))
    layer_only = kept_per_token(path, freeze_trainable_layers=1)
    with_embedding = kept_per_token(path, freeze_trainable_layers=1, freeze_extra_modules="embed_tokens")
    frozen = mem.activation_bytes_per_token_layer(hidden, spec.kv_dim, intermediate)
    assert (with_embedding - layer_only) / (LAYERS - 1) == pytest.approx(frozen, rel=0.03)  # measured -2.2%

    base = dict(model_name_or_path=qwen("0.5b"), output_dir="o", bf16=True, cutoff_len=1024, finetuning_type="freeze",
                freeze_trainable_layers=2, per_device_train_batch_size=4, gradient_checkpointing=False,
                flash_attn="sdpa")  # fmt: skip
    plain = plan(request_from_config(build_config(base), 1, 139.8))
    extra = plan(
        request_from_config(build_config({**base, "freeze_extra_modules": "embed_tokens"}), 1, 139.8)
    )
    big, s = extra.request.spec, extra.configured.setup
    assert s.freeze_extra_modules == ("embed_tokens",) and head_trainable(
        big, s
    )  # Qwen2.5-0.5B ties its head
    assert frozen_recording_layers(big, s) == big.num_layers - 2
    grads = extra.configured.estimate.gpu.gradients - plain.configured.estimate.gpu.gradients
    assert grads * mem.GIB >= mem.BF16_BYTES * big.embed_params * 0.999  # the embedding's bf16 gradient
    assert extra.configured.estimate.gpu.activations > 5 * plain.configured.estimate.gpu.activations
    unsized = plan(request_from_config(build_config({**base, "freeze_extra_modules": "visual"}), 1, 139.8))
    assert any("freeze_extra_modules: visual not sized" in n for n in unsized.notes)
