"""Planner: model states of the memory-saving optimizers (GaLore/APOLLO projected moments, Muon's single
momentum, BAdam's one active block) and how a YAML maps onto them."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmstack.config.load import build_config
from lmstack.memory import memory as mem
from lmstack.memory.advice import yaml_changes
from lmstack.memory.estimate import Setup, estimate


def states(spec, **setup) -> tuple[float, float, float]:
    g = estimate(spec, Setup(finetuning_type="full", **setup)).gpu
    return g.weights * mem.GIB, g.gradients * mem.GIB, g.optimizer * mem.GIB


def test_low_rank_elements_of_one_matrix() -> None:
    # Qwen2.5-7B gate_proj, 3584 x 18944 at rank 16: moments 16 x 18944 twice + the 3584 x 16 projector
    assert mem.low_rank_state_elements(18944, 3584, 16) == 16 * (2 * 18944 + 3584)
    assert mem.low_rank_state_elements(8, 32, 16) == 8 * (2 * 32 + 8)  # rank capped by the small side


@pytest.mark.parametrize("kind", ["galore", "apollo"])
def test_galore_keeps_master_weights_and_projected_moments(specs, kind) -> None:
    s = specs["qwen2.5-7b"]
    p, linear = s.num_params, s.linear_params
    w, g, o = states(s, optimizer=kind, optimizer_rank=16)
    shapes = {
        "q_proj": (3584, 3584), "k_proj": (3584, 512), "v_proj": (3584, 512), "o_proj": (3584, 3584),
        "gate_proj": (3584, 18944), "up_proj": (3584, 18944), "down_proj": (18944, 3584),
    }  # fmt: skip
    elements = 28 * sum(mem.low_rank_state_elements(r, c, 16) for r, c in shapes.values())
    assert w == pytest.approx(2 * p) and g == pytest.approx(2 * p)
    assert o == pytest.approx(4 * p + 8 * (p - linear) + 4 * elements)
    _, _, amp = states(s, fp32_model_weights=True)  # classic AMP: Adam m+v; the fp32 copy is the model
    assert amp == pytest.approx(8 * p) and o < 0.45 * (amp + 4 * p)  # GaLore's point: ~39 GB instead of ~91


def test_optimizer_masters_add_their_fp32_grad_copy_only_above_the_activations(specs) -> None:
    """master_weights: optimizer converts the bf16 grads to fp32 at the step, after the activations
    are freed: 7B full at one 2K row needs the copy on top, 0.5B at 64K tokens does not."""
    s = specs["qwen2.5-7b"]
    p = s.num_params
    small = estimate(s, Setup(finetuning_type="full", micro_batch=1, fused_ce=True)).gpu
    freed = (small.activations + small.logits) * mem.GIB
    assert small.optimizer * mem.GIB == pytest.approx(12 * p + 4 * p - freed)
    big = estimate(specs["qwen2.5-0.5b"], Setup(finetuning_type="full", micro_batch=32, fused_ce=True)).gpu
    assert big.optimizer * mem.GIB == pytest.approx(12 * specs["qwen2.5-0.5b"].num_params)


def test_foreach_adamw_holds_an_fp32_sqrt_per_parameter_at_the_step(specs) -> None:
    """optim: adamw_torch (torch's multi-tensor AdamW) allocates sqrt(exp_avg_sq) for every parameter next to
    the masters' fp32 grads; the fused AdamW does not. The H200 run r5_sft_1.5b_full_mb4_ckpt: 34.57 GiB
    measured, the step's parts 34.5."""
    s = specs["qwen2.5-1.5b"]
    p = s.num_params
    setup = dict(finetuning_type="full", micro_batch=4, gradient_checkpointing=True, fused_ce=True)
    fused = estimate(s, Setup(**setup)).gpu
    foreach = estimate(s, Setup(adam_foreach=True, **setup)).gpu
    freed = (foreach.activations + foreach.logits) * mem.GIB
    assert foreach.optimizer * mem.GIB == pytest.approx(12 * p + 8 * p - freed)
    assert fused.optimizer * mem.GIB == pytest.approx(12 * p + max(0.0, 4 * p - freed))
    # weights 2 + masters 4 + moments 8 + bf16 grads 2 + fp32 grads 4 + the sqrt 4 bytes per parameter
    assert foreach.allocated * mem.GIB == pytest.approx(24 * p)
    assert foreach.allocated == pytest.approx(34.57, rel=0.03)
    lora = estimate(s, Setup(finetuning_type="lora", adam_foreach=True, micro_batch=4)).gpu
    assert lora.optimizer == estimate(s, Setup(finetuning_type="lora", micro_batch=4)).gpu.optimizer


def test_optim_adamw_torch_as_written_is_the_foreach_step(tmp_path, qwen_shapes) -> None:
    import json

    from lmstack.plan.whatif import request_from_config

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2", **qwen_shapes["0.5b"]}))
    base = {"model_name_or_path": str(model), "template": "qwen", "stage": "sft", "do_train": True,
            "finetuning_type": "full", "dataset": "alpaca_en_demo", "output_dir": str(tmp_path / "o")}  # fmt: skip
    # optim unset: the plan runs LF's AdamW as the fused kernel, which holds no per-parameter temporary
    assert not request_from_config(build_config(base), 1, 80).adam_foreach
    assert request_from_config(build_config({**base, "optim": "adamw_torch"}), 1, 80).adam_foreach
    fused = build_config({**base, "optim": "adamw_torch_fused"})
    assert not request_from_config(fused, 1, 80).adam_foreach


def test_muon_keeps_one_moment_for_hidden_matrices(specs) -> None:
    s = specs["qwen2.5-7b"]
    p, linear = s.num_params, s.linear_params
    _, _, o = states(s, optimizer="muon")
    assert o == pytest.approx(4 * p + 4 * linear + 8 * (p - linear))


def test_badam_holds_grads_and_adam_states_of_one_layer(specs) -> None:
    s = specs["qwen2.5-7b"]
    w, g, o = states(s, optimizer="badam")
    assert w == pytest.approx(2 * s.num_params)  # bf16 weights, no fp32 master of the whole model
    assert g == pytest.approx(2 * s.layer_params) and o == pytest.approx(12 * s.layer_params)
    # seed 003 §10.11: full-parameter BAdam comes close to LoRA's bf16 base (2 B/param)
    assert w + g + o < 1.25 * 2 * s.num_params


def test_low_rank_optimizers_are_not_for_lora(specs) -> None:
    with pytest.raises(ValueError, match="use_galore: a full-parameter optimizer"):
        estimate(specs["qwen2.5-0.5b"], Setup(finetuning_type="lora", optimizer="galore"))
    with pytest.raises(ValueError, match="optimizer: got 'adam'"):
        estimate(specs["qwen2.5-0.5b"], Setup(optimizer="adam"))


@pytest.mark.parametrize(
    ("fields", "optimizer", "rank"),
    [
        ({"use_galore": True, "galore_rank": 32}, "galore", 32),
        ({"use_apollo": True, "apollo_rank": 4}, "apollo", 4),
        ({"use_badam": True}, "badam", 16),
        ({"optim": "muon"}, "muon", 16),
        ({"use_muon": True}, "muon", 16),
        ({}, "adamw", 16),
    ],
)
def test_request_from_config_maps_the_yaml(tiny_model, tmp_path, fields, optimizer, rank) -> None:
    from lmstack.plan.whatif import request_from_config

    cfg = build_config(
        {
            "model_name_or_path": str(tiny_model),
            "output_dir": str(tmp_path),
            "finetuning_type": "full",
            **fields,
        }
    )
    req = request_from_config(cfg, gpus=1, gpu_memory_gib=80)
    assert (req.optimizer, req.optimizer_rank) == (optimizer, rank)


def test_the_foreach_sqrt_is_in_the_moments_dtype(specs) -> None:
    """pure_bf16 keeps bf16 moments (no masters): torch's _foreach_sqrt of them is bf16, 2 bytes a parameter."""
    s = specs["qwen2.5-1.5b"]
    setup = dict(
        finetuning_type="full", micro_batch=1, seq_len=128, gradient_checkpointing=True, fused_ce=True
    )
    fused = estimate(s, Setup(pure_bf16=True, **setup)).gpu
    foreach = estimate(s, Setup(pure_bf16=True, adam_foreach=True, **setup)).gpu
    freed = (foreach.activations + foreach.logits) * mem.GIB
    assert (foreach.optimizer - fused.optimizer) * mem.GIB == pytest.approx(2 * s.num_params - freed)


def test_a_searched_micro_batch_that_accumulates_runs_classic_amp(specs, tmp_path, qwen_shapes) -> None:
    """master_weights: auto keeps the optimizer's fp32 masters only with gradient_accumulation_steps: 1
    (plan/decide.py): a row that splits the batch into accumulated micro-batches is estimated as what
    would run there, classic AMP (fp32 weights, their wider activations); an explicit
    master_weights: optimizer makes such rows unsupported."""
    import json

    from lmstack.memory import plan
    from lmstack.plan.whatif import request_from_config

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2", **qwen_shapes["0.5b"]}))
    yaml = {"model_name_or_path": str(model), "template": "qwen", "stage": "sft", "do_train": True,
            "finetuning_type": "full", "dataset": "alpaca_en_demo", "output_dir": str(tmp_path / "o"),
            "bf16": True, "per_device_train_batch_size": 8, "cutoff_len": 2048, "packing": True}  # fmt: skip
    req = request_from_config(build_config(yaml), 1, 80)
    assert req.masters_unless_accumulating and req.master_weights == "auto"
    rows = {(c.setup.micro_batch, c.setup.gradient_checkpointing): c for c in plan(req).candidates
            if c.strategy.name == "single" and not c.setup.checkpoint_offload and c.setup.checkpoint_layers is None}  # fmt: skip
    assert not rows[(8, False)].setup.fp32_model_weights  # the configured batch: the optimizer's masters
    split = rows[(4, False)]
    assert split.setup.optimizer_batch == 8 and split.setup.fp32_model_weights
    per_row = rows[(8, False)].estimate.gpu.activations / 8
    assert split.estimate.gpu.activations / 4 == pytest.approx(per_row * mem.FP32_RESIDUAL_ACTIVATION_FACTOR)
    explicit = request_from_config(build_config({**yaml, "master_weights": "optimizer"}), 1, 80)
    refused = [
        c for c in plan(explicit).candidates if c.strategy.name == "single" and c.setup.micro_batch < 8
    ]
    assert refused and all("master_weights: optimizer needs gradient_accumulation_steps: 1" in c.why_not
                           for c in refused)  # fmt: skip
    no_masters = request_from_config(build_config({**yaml, "pure_bf16": True}), 1, 80)
    assert not no_masters.masters_unless_accumulating


def test_a_zero0_row_that_accumulates_keeps_deepspeeds_masters(specs, tmp_path, qwen_shapes) -> None:
    """ZeRO-0 is DeepSpeed too (its bf16 optimizer holds the fp32 masters, the model stays bf16): a
    `deepspeed: ds_z0_config.json` run with gradient_accumulation_steps: 2 is estimated as the run plan
    resolved it (request_from_plan: no fp32 model weights under DeepSpeed), never as classic AMP."""
    import json

    from lmstack.memory import plan
    from lmstack.plan.whatif import request_from_config

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2", **qwen_shapes["0.5b"]}))
    z0 = Path(__file__).resolve().parents[3] / "examples/deepspeed/ds_z0_config.json"
    yaml = {"model_name_or_path": str(model), "template": "qwen", "stage": "sft", "do_train": True,
            "finetuning_type": "full", "dataset": "alpaca_en_demo", "output_dir": str(tmp_path / "o"),
            "bf16": True, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
            "cutoff_len": 1024, "deepspeed": str(z0), "gradient_checkpointing": False}  # fmt: skip
    req = request_from_config(build_config(yaml), 2, 80)
    assert req.deepspeed_stage == 0 and not req.fp32_model_weights and req.masters_unless_accumulating
    result = plan(req)
    assert result.configured.strategy.name == "zero0" and result.configured.setup.optimizer_batch == 8
    assert not result.configured.setup.fp32_model_weights
    rows = [c for c in result.candidates if c.strategy.deepspeed_stage is not None]
    assert rows and not [c for c in rows if c.setup.fp32_model_weights]


@pytest.mark.parametrize("gpus", [1, 2])
def test_master_weights_optimizer_rows_give_yaml_the_run_plan_accepts(tmp_path, qwen_shapes, gpus) -> None:
    """master_weights: optimizer holds only on one process/DDP without accumulation (plan/decide.py):
    a row on DeepSpeed, FSDP or LoRA gives YAML that sets master_weights back to auto (DeepSpeed/FSDP
    keep their own masters; adapters have none), so the recommendation passes `lmstack check`."""
    import json

    from lmstack.memory import plan
    from lmstack.plan.whatif import plan_for, request_from_config

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2", **qwen_shapes["7b"]}))
    yaml = {"model_name_or_path": str(model), "template": "qwen", "stage": "sft", "do_train": True,
            "finetuning_type": "full", "dataset": "alpaca_en_demo", "output_dir": str(tmp_path / "o"),
            "bf16": True, "per_device_train_batch_size": 4, "cutoff_len": 2048,
            "master_weights": "optimizer"}  # fmt: skip
    result = plan(request_from_config(build_config(yaml), gpus, 80))
    rec = result.recommendation
    assert not result.configured.fits and rec is not None  # 7B's masters + Adam do not fit one 80 GB GPU
    assert rec.yaml_changes.get("master_weights") == "auto"
    fitting = [c for c in result.candidates if c.fits]
    sharded = [c for c in fitting if c.setup.deepspeed_stage is not None or c.setup.fsdp or c.changes_method]
    assert sharded
    for c in fitting:
        changes = yaml_changes(result.request, c)
        run = plan_for(build_config({**yaml, **changes}), gpus, 80)  # raises where the masters cannot hold
        masters = run.precision.master_weights == "optimizer"
        assert masters == (c.setup.deepspeed_stage is None and not c.setup.fsdp and not c.changes_method)


def test_each_searched_strategy_is_estimated_with_its_own_precision_scheme(tmp_path, qwen_shapes) -> None:
    """A ZeRO config with master_weights: model searched onto DDP runs classic AMP there (fp32 weights); a
    classic-AMP single config (accumulation) searched onto ZeRO runs DeepSpeed's bf16 weights + masters."""
    import json

    from lmstack.memory import plan
    from lmstack.plan.whatif import request_from_config

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2", **qwen_shapes["0.5b"]}))
    repo = Path(__file__).resolve().parents[3]
    yaml = {"model_name_or_path": str(model), "template": "qwen", "stage": "sft", "do_train": True,
            "finetuning_type": "full", "dataset": "alpaca_en_demo", "output_dir": str(tmp_path / "o"),
            "bf16": True, "per_device_train_batch_size": 4, "cutoff_len": 2048}  # fmt: skip
    z2 = {**yaml, "deepspeed": str(repo / "examples/deepspeed/ds_z2_config.json"), "master_weights": "model"}
    cands = plan(request_from_config(build_config(z2), 2, 80)).candidates
    ddp = [c for c in cands if c.strategy.name == "ddp"]
    assert ddp and all(c.setup.fp32_model_weights for c in ddp)
    full = [c for c in cands if c.setup.finetuning_type == "full"]  # LoRA rows: adapters, no such scheme
    assert all(not c.setup.fp32_model_weights for c in full if c.setup.deepspeed_stage is not None)
    accumulating = plan(request_from_config(build_config({**yaml, "gradient_accumulation_steps": 2}), 2, 80))
    assert accumulating.configured.setup.fp32_model_weights  # classic AMP: what the run plan resolves
    zero = [c for c in accumulating.candidates
            if c.setup.deepspeed_stage is not None and c.setup.finetuning_type == "full"]  # fmt: skip
    assert zero and all(not c.setup.fp32_model_weights for c in zero)


def test_an_accumulating_classic_amp_step_carries_its_named_margin(specs) -> None:
    """Gradient accumulation under classic AMP (what master_weights: auto runs there) adds the explicit
    margin the H200 traces call for (memory.ACCUMULATING_CLASSIC_AMP_MARGIN_BYTES, 2 B/param), as a named row
    of the breakdown; not without accumulation, not for LoRA (bf16 base), not under ZeRO/FSDP (their own
    precision scheme), not with the optimizer's masters."""
    from dataclasses import replace

    spec = specs["qwen2.5-0.5b"]
    amp = Setup(
        finetuning_type="full", fp32_model_weights=True, micro_batch=4, optimizer_batch=16, seq_len=2048
    )

    def margin(s: Setup) -> float:
        return sum(v for name, v in estimate(spec, s).gpu.terms if name.startswith("margin: accumulating"))

    assert margin(amp) * mem.GIB == pytest.approx(2 * spec.num_params)
    one_step = estimate(spec, replace(amp, optimizer_batch=4)).gpu
    assert estimate(spec, amp).gpu.allocated - one_step.allocated == pytest.approx(margin(amp))
    for other in (
        replace(amp, optimizer_batch=4),  # one micro-batch per step
        replace(amp, finetuning_type="lora"),
        replace(amp, deepspeed_stage=2, num_gpus=2),
        replace(amp, fsdp="FULL_SHARD", num_gpus=2),
        replace(amp, fp32_model_weights=False),  # bf16 weights, the optimizer's masters
    ):
        assert margin(other) == 0.0, other
