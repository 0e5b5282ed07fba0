from __future__ import annotations

import pytest

from lmstack.memory import check_layout, enumerate_layouts, pretrain_gpt_args
from lmstack.memory.parallel import bubble_ratio, korthikanti_layer_bytes

# seed 000 §3.3: (model, gpus, tp, pp, dp, micro-batch size, global batch, sp, dist-opt, recompute)
SEED_EXAMPLES = [
    ("llama-13b", 8, 2, 1, 4, 2, 256, False, False, None),
    ("llama-2-70b", 64, 8, 4, 2, 1, 1024, False, False, None),
    ("gpt3-175b", 256, 8, 8, 4, 1, 2048, True, True, "selective"),
]


@pytest.mark.parametrize(("name", "gpus", "tp", "pp", "dp", "mbs", "gbs", "sp", "dopt", "rc"), SEED_EXAMPLES)
def test_seed_examples_are_valid(specs, name, gpus, tp, pp, dp, mbs, gbs, sp, dopt, rc) -> None:
    m = gbs // (mbs * dp)
    layout = check_layout(
        specs[name], gpus, tp, pp, micro_batches=m, micro_batch_size=mbs, sequence_parallel=sp,
        distributed_optimizer=dopt, recompute=rc,
    )  # fmt: skip
    assert layout.valid, layout.reason
    assert (layout.tp, layout.pp, layout.dp) == (tp, pp, dp)
    args = pretrain_gpt_args(layout)
    expected = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
                "--data-parallel-size", str(dp), "--micro-batch-size", str(mbs), "--global-batch-size", str(gbs)]  # fmt: skip
    assert args[:10] == expected
    assert ("--sequence-parallel" in args) == sp and ("--use-distributed-optimizer" in args) == dopt
    assert ("selective" in args) == (rc == "selective")
    listed = enumerate_layouts(specs[name], gpus, 8, m, micro_batch_size=mbs, sequence_parallel=sp,
                               distributed_optimizer=dopt, recompute=rc)  # fmt: skip
    assert any(x.valid and (x.tp, x.pp, x.dp) == (tp, pp, dp) for x in listed)


@pytest.mark.parametrize(
    ("name", "gpus", "tp", "pp", "rule"),
    [("llama-2-7b", 24, 12, 1, "does not divide num_attention_heads=32"),
     ("llama-2-7b", 16, 16, 1, "exceeds gpus_per_node=8"),
     ("llama-2-70b", 32, 1, 32, "does not divide num_layers=80"),
     ("llama-3-8b", 32, 16, 1, "num_key_value_heads=8"),
     ("llama-2-7b", 12, 8, 1, "does not divide the 12 GPUs")],
)  # fmt: skip
def test_invalid_layouts_name_the_rule(specs, name, gpus, tp, pp, rule) -> None:
    layout = check_layout(specs[name], gpus, tp, pp, gpus_per_node=8)
    assert not layout.valid
    assert rule in layout.reason
    with pytest.raises(ValueError, match="not valid"):
        pretrain_gpt_args(layout)


def test_tp16_alone_breaks_only_the_node_rule(specs) -> None:
    layout = check_layout(specs["llama-2-7b"], 16, 16, 1, gpus_per_node=8)
    assert layout.reason.count(";") == 0 and "NVLink" in layout.reason
    assert check_layout(specs["llama-2-7b"], 16, 16, 1, gpus_per_node=16).valid


def test_bubble_and_warning(specs) -> None:
    assert bubble_ratio(8, 8) == pytest.approx(7 / 8)  # seed §3.5 pit 2
    few = check_layout(specs["gpt3-175b"], 256, 8, 8, micro_batches=8)
    enough = check_layout(specs["gpt3-175b"], 256, 8, 8, micro_batches=32)
    assert few.warnings and "4 x PP=32" in few.warnings[0]
    assert not enough.warnings and enough.bubble_ratio == pytest.approx(7 / 32)


def test_enumeration_covers_every_factorisation_and_ranks(specs) -> None:
    layouts = enumerate_layouts(specs["llama-2-70b"], 64, 8, 64, gpu_memory_gib=80)
    assert len(layouts) == 28  # ordered (tp, pp) pairs with tp*pp | 64
    assert all(x.tp * x.pp * x.dp == 64 for x in layouts if x.valid)
    first = layouts[0]
    assert first.valid and first.fits
    fitting = [x for x in layouts if x.valid and x.fits]
    assert first.tp * first.pp == min(x.tp * x.pp for x in fitting)
    assert not layouts[-1].valid


def test_megatron_memory_shrinks_with_model_parallelism_and_dist_optimizer(specs) -> None:
    s = specs["llama-2-70b"]
    small = check_layout(s, 64, 8, 4, micro_batches=64).per_gpu
    big = check_layout(s, 64, 8, 1, micro_batches=64).per_gpu
    assert small.weights == pytest.approx(big.weights / 4, rel=0.05)
    plain = check_layout(s, 64, 8, 4, micro_batches=64, distributed_optimizer=False).per_gpu
    assert plain.optimizer == pytest.approx(small.optimizer * 2)  # DP=2
    assert plain.gradients == pytest.approx(2 * plain.weights)  # fp32 main grads vs bf16 params


@pytest.mark.parametrize(
    ("t", "sp", "rc", "per_sbh"),
    [(1, False, None, 34 + 5 * 32 * 2048 / 4096), (8, False, None, 10 + 24 / 8 + 5 * 32 * 2048 / 4096 / 8),
     (8, True, None, (34 + 5 * 32 * 2048 / 4096) / 8), (8, True, "selective", 34 / 8), (8, False, "full", 2)],
)  # fmt: skip
def test_korthikanti_table(t, sp, rc, per_sbh) -> None:
    s, b, h, a = 2048, 1, 4096, 32
    assert korthikanti_layer_bytes(s, b, h, a, t, sp, rc, flash=False) == pytest.approx(s * b * h * per_sbh)
