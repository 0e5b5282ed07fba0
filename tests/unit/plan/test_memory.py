from __future__ import annotations

import pytest

from lmstack.memory import memory as mem
from lmstack.memory.estimate import Setup, estimate

KB = 1000


def test_seed_70b_zero3_example_is_140gb_per_gpu_not_17_5(specs) -> None:
    """Seed 000 §2.3 divides by 8 twice: 70e9 x 16 B / 8 GPUs = 140 GB per GPU of model states."""
    per_gpu = mem.zero_paper_model_states(70e9, stage=3, n=8)
    assert per_gpu == pytest.approx(140e9)
    assert per_gpu / mem.GIB == pytest.approx(130.4, abs=0.05)
    for gpu_gib in (40, 80):
        assert per_gpu / mem.GIB > gpu_gib  # model states alone do not fit without offload
    base = Setup(
        num_gpus=8, deepspeed_stage=3, micro_batch=1, seq_len=2048, gradient_checkpointing=True, fused_ce=True
    )
    no_offload = estimate(specs["llama-2-70b"], base).gpu
    assert no_offload.total > 80
    offload = estimate(
        specs["llama-2-70b"], Setup(**{**base.__dict__, "offload_optimizer": True, "offload_param": True})
    )
    assert offload.gpu.weights + offload.gpu.gradients + offload.gpu.optimizer < 5
    assert offload.gpu.total < 40
    assert offload.cpu_gib == pytest.approx(68.98e9 * 18 * 1.5 / mem.GIB, rel=0.01)  # DS: 18P/nodes x 1.5


@pytest.mark.parametrize(
    ("stage", "expected"),  # (2+2+K)Psi, (2+2)Psi + K Psi/N, 2Psi + (2+K)Psi/N, (2+2+K)Psi/N; Psi=1, N=4
    [(0, 16.0), (1, 4 + 3.0), (2, 2 + 3.5), (3, 4.0)],
)
def test_zero_paper_formulas(stage: int, expected: float) -> None:
    assert mem.zero_paper_model_states(1.0, stage, 4) == pytest.approx(expected)


def test_deepspeed_estimators_reference_qwen7b_on_2_gpus(specs) -> None:
    spec = specs["qwen2.5-7b"]
    assert spec.num_params / 1e9 == pytest.approx(7.62, abs=0.01)
    assert spec.largest_layer_params / 1e6 == pytest.approx(545, abs=0.5)  # the embedding
    z2, _ = mem.deepspeed_zero2_estimate(spec.num_params, gpus=2, gpus_per_node=2, offload=False)
    z3, _ = mem.deepspeed_zero3_estimate(spec.num_params, spec.largest_layer_params, 2, 1, False, False)
    assert (4 * spec.num_params / 1e9, 16 * spec.num_params / 2 / 1e9) == pytest.approx((30.5, 61.0), abs=0.1)
    # REFERENCE rounds P to 7.62B (exact 7.6156B), hence 0.15 GB of slack
    assert z2 / 1e9 == pytest.approx(91.5, abs=0.15)
    assert z3 / 1e9 == pytest.approx(70.8, abs=0.15)
    # the planner's breakdown reproduces DeepSpeed's estimators exactly
    for stage, ds in [(2, z2), (3, z3)]:
        g = estimate(spec, Setup(num_gpus=2, deepspeed_stage=stage)).gpu
        assert (g.weights + g.gradients + g.optimizer) * mem.GIB == pytest.approx(ds, rel=1e-9)


@pytest.mark.parametrize(
    ("stage", "opt", "par", "gpu_formula"),
    [(2, True, False, lambda p, ll, n: 2 * p), (3, True, False, lambda p, ll, n: 4 * ll + 2 * p / n),
     (3, True, True, lambda p, ll, n: 4 * ll)],
)  # fmt: skip
def test_offload_gpu_side_matches_deepspeed(specs, stage, opt, par, gpu_formula) -> None:
    spec = specs["qwen2.5-7b"]
    g = estimate(spec, Setup(num_gpus=4, deepspeed_stage=stage, offload_optimizer=opt, offload_param=par)).gpu
    expected = gpu_formula(spec.num_params, spec.largest_layer_params, 4)
    assert (g.weights + g.gradients + g.optimizer) * mem.GIB == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize(
    ("name", "kb", "l_mb", "gb_16k", "ckpt_gb_16k"),  # REFERENCE 7.2 table
    [("qwen2.5-0.5b", 40, 0.97, 15.9, 0.7), ("qwen2.5-1.5b", 73, 2.05, 33.6, 1.4),
     ("qwen2.5-7b", 159, 4.44, 72.8, 3.3), ("llama-3-8b", 139, 4.46, 73.0, 4.3)],
)  # fmt: skip
def test_activation_table(specs, name, kb, l_mb, gb_16k, ckpt_gb_16k) -> None:
    s = specs[name]
    per = mem.activation_bytes_per_token_layer(s.hidden_size, s.kv_dim, s.intermediate_size)
    assert round(per / KB) == kb
    assert per * s.num_layers / 1e6 == pytest.approx(l_mb, abs=0.01)
    tokens = 16 * 1024
    assert mem.activation_bytes(tokens, s.num_layers, per, s.hidden_size, False) / 1e9 == pytest.approx(
        gb_16k, abs=0.1
    )
    ckpt_inputs = tokens * s.num_layers * mem.checkpointed_bytes_per_token_layer(s.hidden_size)
    assert ckpt_inputs / 1e9 == pytest.approx(ckpt_gb_16k, abs=0.1)
    with_recompute = mem.activation_bytes(tokens, s.num_layers, per, s.hidden_size, True)
    assert with_recompute == pytest.approx(ckpt_inputs + tokens * per)  # + one full layer


def test_eager_attention_adds_score_matrix(specs) -> None:
    s = specs["qwen2.5-0.5b"]
    base = Setup(micro_batch=1, seq_len=4096, fused_ce=True)
    eager = estimate(s, Setup(**{**base.__dict__, "attention": "eager"})).gpu.activations
    sdpa = estimate(s, base).gpu.activations
    extra = 5 * s.num_heads * 4096 * 4096 * s.num_layers  # 5*a*s B/token/layer
    extra *= mem.BF16_ACTIVATION_CALIBRATION  # Liger (fused_ce) stack: only the measured calibration
    assert (eager - sdpa) * mem.GIB == pytest.approx(extra)


def test_logits_and_quantization_bytes(specs) -> None:
    assert mem.logits_bytes(16384, 151936, fused=False) / 1e9 == pytest.approx(24.9, abs=0.1)  # REFERENCE 7.3
    assert mem.logits_bytes(16384, 151936, fused=True) / 1e9 == pytest.approx(0.62, abs=0.01)
    assert 0.5 <= mem.nf4_bytes_per_param() <= 0.55
    s = specs["llama-2-70b"]
    q4 = estimate(s, Setup(finetuning_type="lora", quantization_bit=4)).gpu.weights * mem.GIB
    q8 = estimate(s, Setup(finetuning_type="lora", quantization_bit=8)).gpu.weights * mem.GIB
    assert 0.5 < q4 / s.num_params < 0.55 and 1.0 < q8 / s.num_params < 1.05


@pytest.mark.parametrize(("ftype", "pure", "bytes_per_param"), [("full", False, 16), ("full", True, 8)])
def test_single_gpu_model_states(specs, ftype, pure, bytes_per_param) -> None:
    s = specs["qwen2.5-1.5b"]
    g = estimate(s, Setup(finetuning_type=ftype, pure_bf16=pure)).gpu
    assert (g.weights + g.gradients + g.optimizer) * mem.GIB == pytest.approx(bytes_per_param * s.num_params)


def test_lora_states_are_base_plus_16_bytes_per_adapter(specs) -> None:
    s = specs["qwen2.5-7b"]
    g = estimate(s, Setup(finetuning_type="lora", lora_rank=16)).gpu
    assert g.weights * mem.GIB == pytest.approx(2 * s.num_params)
    assert g.adapters * mem.GIB == pytest.approx(16 * s.lora_params(16))
    assert g.gradients == g.optimizer == 0


@pytest.mark.parametrize(
    ("setup", "field"),
    [(Setup(finetuning_type="lroa"), "finetuning_type"), (Setup(deepspeed_stage=4), "deepspeed stage"),
     (Setup(offload_param=True, deepspeed_stage=2), "offload_param"), (Setup(quantization_bit=4), "quantization_bit"),
     (Setup(attention="flash2"), "attention")],
)  # fmt: skip
def test_errors_name_the_field(specs, setup, field) -> None:
    with pytest.raises(ValueError, match=field):
        estimate(specs["qwen2.5-0.5b"], setup)


def test_offloaded_checkpointing_reserves_its_pending_inputs_once_more(specs):
    """use_unsloth_gc: each offloaded layer input waits for its copy before its block is reused -- a
    reserved-only margin of one more copy of the offloaded inputs (memory.offload_pending_bytes); allocated
    is unchanged, and plain checkpointing has none."""
    from dataclasses import replace

    from lmstack.memory.estimate import Setup, estimate

    spec = specs["qwen2.5-7b"]
    s = Setup(finetuning_type="lora", micro_batch=8, seq_len=2048, gradient_checkpointing=True, fused_ce=True,
              packed=True)  # fmt: skip
    plain, parked = estimate(spec, s).gpu, estimate(spec, replace(s, checkpoint_offload=True)).gpu
    layer_input = 8 * 2048 * 2 * spec.hidden_size / mem.GIB
    pending = parked.reserved - parked.allocated - (mem.FRAGMENTATION_FACTOR - 1) * parked.allocated
    share = mem.ALL_OFFLOADED_PENDING_SHARE  # every layer recomputed: the peak is in the backward
    assert pending == pytest.approx(share * spec.num_layers * layer_input, rel=1e-6)
    assert plain.reserved - plain.allocated == pytest.approx((mem.FRAGMENTATION_FACTOR - 1) * plain.allocated)
    few = estimate(
        spec, replace(s, checkpoint_offload=True, checkpoint_layers=3)
    ).gpu  # 25 layers keep theirs
    assert few.reserved - few.allocated == pytest.approx(
        (mem.FRAGMENTATION_FACTOR - 1) * few.allocated + 3 * layer_input, rel=1e-6
    )
