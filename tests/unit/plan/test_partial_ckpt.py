"""Partial gradient checkpointing chosen by the planner (issue 19 "memory-bounded speed", issue 20): under
`gradient_checkpointing: auto` on a GPU the run plan recomputes only the smallest number of decoder layers
that fits (plan.checkpoint_layers); an explicit true keeps every layer; the estimate counts k recomputed
and N - k full layers, the cost k/N of the recompute; `lmstack plan` shows the k/N rows and the decision."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from lmstack.config.load import build_config
from lmstack.launch.context import LaunchContext
from lmstack.memory import format_table, plan
from lmstack.memory import memory as mem
from lmstack.memory.estimate import Setup, estimate
from lmstack.memory.model_spec import ModelSpec
from lmstack.memory.recommend import RECOMPUTE_COST, relative_cost
from lmstack.plan.runplan import RunPlan
from lmstack.plan.whatif import gpu_context, request_from_config
from lmstack.train.preflight import check

H200 = ((9, 0), "NVIDIA H200")
N = 28  # Qwen2.5-7B's decoder layers
EVERYTHING = frozenset({"deepspeed", "bitsandbytes", "liger_kernel", "torchao"})
YAML = dict(output_dir="o", bf16=True, cutoff_len=2048, packing=True, finetuning_type="lora", lora_target="all",
            per_device_train_batch_size=8, gradient_accumulation_steps=1, fp8=True)  # fmt: skip


@pytest.fixture
def qwen7b(tmp_path, qwen_shapes) -> str:
    d = tmp_path / "qwen2.5-7b"
    d.mkdir()
    config = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], **qwen_shapes["7b"]}
    (d / "config.json").write_text(json.dumps(config))
    return str(d)


def resolve(path: str, gib: float, **over) -> RunPlan:
    return RunPlan.resolve(
        build_config({**YAML, "model_name_or_path": path, **over}), gpu_context(1, gib, *H200)
    )


def request(path: str, gib: float, **over):
    cfg = build_config({**YAML, "model_name_or_path": path, **over})
    return replace(
        request_from_config(cfg, 1, gib, gpu_capability=H200[0], gpu_name=H200[1]), available=EVERYTHING
    )


def configured_at(path: str, gib: float, k: int | None):
    """The configured candidate's setup with k recomputed layers, estimated."""
    req = request(path, gib)
    s = replace(plan(req).configured.setup, gradient_checkpointing=True, checkpoint_layers=k)
    return estimate(req.spec, s).gpu.total


def test_7b_lora_8x2048_fp8_on_24gb_checkpoints_the_fewest_layers_that_fit(qwen7b):
    p = resolve(qwen7b, 24)
    k = p.checkpoint_layers
    assert p.checkpointing and k is not None and 1 <= k < N
    usable = 24 * mem.SAFETY_MARGIN
    assert configured_at(qwen7b, 24, k) <= usable < configured_at(qwen7b, 24, k - 1)  # the smallest that fits
    assert (
        p.reasons["checkpoint_layers"]
        == f"checkpointing {k} of {N} layers: the smallest count that fits 24 GiB"
    )
    assert p.decisions()["checkpoint_layers"] == k
    assert f"checkpoint_layers {k}" in " ".join(p.describe().split())
    # more memory, fewer recomputed layers; enough for everything: none
    roomier = resolve(qwen7b, 80)
    assert roomier.checkpoint_layers is not None and roomier.checkpoint_layers < k
    assert resolve(qwen7b, 141, per_device_train_batch_size=1).checkpointing is False


def test_every_layer_when_only_full_checkpointing_fits(qwen7b):
    """A GPU where all-checkpointed fits and N - 1 layers do not: k = N (None: every layer)."""
    full, almost = configured_at(qwen7b, 24, None), configured_at(qwen7b, 24, N - 1)
    gib = (full + almost) / 2 / mem.SAFETY_MARGIN
    p = resolve(qwen7b, gib)
    assert p.checkpointing and p.checkpoint_layers is None
    assert p.decisions()["checkpoint_layers"] == "all" and "checkpoint_layers" not in p.reasons


def test_an_explicit_true_keeps_every_layer_and_cpu_is_unchanged(qwen7b, base_cfg):
    p = resolve(qwen7b, 24, gradient_checkpointing=True)
    assert p.checkpointing and p.checkpoint_layers is None
    cpu = RunPlan.resolve(build_config(base_cfg), LaunchContext())
    assert cpu.checkpointing is False and cpu.checkpoint_layers is None
    assert cpu.decisions()["checkpoint_layers"] is None
    unsloth_gc = resolve(
        qwen7b, 24, use_unsloth_gc=True, gradient_checkpointing=True
    )  # every layer, offloaded
    assert unsloth_gc.checkpoint_offload and unsloth_gc.checkpoint_layers is None


def test_use_unsloth_gc_under_auto_offloads_the_fewest_layers_that_fit(qwen7b):
    """use_unsloth_gc keeps checkpointing on (LF) with the inputs in CPU RAM; `gradient_checkpointing: auto`
    (the default) then recomputes only the fewest layers that fit, never none; more memory, fewer layers."""
    p = resolve(qwen7b, 24, use_unsloth_gc=True)
    k = p.checkpoint_layers
    assert p.checkpointing and p.checkpoint_offload and k is not None and 1 <= k < N
    req = request(qwen7b, 24, use_unsloth_gc=True)
    base = plan(req).configured.setup
    assert base.checkpoint_offload and base.checkpoint_layers == k

    def total(layers: int | None) -> float:
        return estimate(req.spec, replace(base, checkpoint_layers=layers)).gpu.total

    usable = 24 * mem.SAFETY_MARGIN
    assert total(k) <= usable < total(k - 1)
    assert (
        p.reasons["checkpoint_layers"]
        == f"checkpointing {k} of {N} layers: the smallest count that fits 24 GiB"
    )
    # offloading never makes more layers recompute than plain partial checkpointing on the same GPU
    assert k <= resolve(qwen7b, 24).checkpoint_layers
    # a GPU where everything fits: one layer still recomputes (checkpointing stays on), offloaded
    roomy = resolve(qwen7b, 141, use_unsloth_gc=True, per_device_train_batch_size=1)
    assert roomy.checkpointing and roomy.checkpoint_offload and roomy.checkpoint_layers == 1


def test_the_estimate_counts_k_recomputed_and_n_minus_k_full_layers(specs):
    spec: ModelSpec = specs["qwen2.5-7b"]
    s = Setup(finetuning_type="lora", micro_batch=8, seq_len=2048, gradient_checkpointing=True, fused_ce=True)
    tokens, h = 8 * 2048, spec.hidden_size
    off = estimate(spec, replace(s, gradient_checkpointing=False)).gpu.activations
    full_layer = off / N  # no checkpointing: N full layers
    layer_input = tokens * 2 * h / mem.GIB  # what a checkpointed layer keeps: its bf16 input
    for k in (1, 10, 27):
        part = estimate(spec, replace(s, checkpoint_layers=k)).gpu.activations
        assert part == pytest.approx((N - k) * full_layer + k * layer_input)
        cost = relative_cost(spec, replace(s, checkpoint_layers=k)) / relative_cost(
            spec, replace(s, gradient_checkpointing=False)
        )
        assert cost == pytest.approx(1 + (RECOMPUTE_COST - 1) * k / N)
    # offloaded: only the k recomputed layers' inputs wait in CPU RAM; the GPU holds the kept layers
    parked = estimate(spec, replace(s, checkpoint_layers=10, checkpoint_offload=True))
    assert parked.offloaded_activations_gib == pytest.approx(10 * layer_input)
    assert parked.gpu.activations == pytest.approx(18 * full_layer + 2 * layer_input)
    # the loss head coexists with the kept layers' activations (it never does with full checkpointing's recompute)
    assert estimate(spec, replace(s, checkpoint_layers=27)).gpu.logits > estimate(spec, s).gpu.logits


def test_plan_table_shows_partial_rows_and_the_recommendation_is_accepted_by_check(qwen7b, base_cfg):
    result = plan(request(qwen7b, 24, gradient_checkpointing=False))
    rec = result.recommendation
    k = rec.candidate.setup.checkpoint_layers
    assert k is not None and 1 <= k < N and not rec.candidate.changes_method
    assert rec.yaml_changes["gradient_checkpointing"] == "auto"  # no YAML field names k: auto picks it
    assert f"checkpointing {k}/{N}" in rec.reason and f"on {k} of the {N} decoder layers" in rec.reason
    table = format_table(result)
    assert f"{k}/{N}" in table and "ckpt k/N" in table
    auto = format_table(plan(request(qwen7b, 24)))
    assert (
        f"gradient_checkpointing: auto -> checkpointing {k} of {N} layers: the smallest count that fits 24 GiB"
        in auto
    )
    # the change on a config (the tiny model in place of the 7B one) passes the rules on an H200
    here = LaunchContext.from_env(probe_cuda=False).packages
    flat = {**base_cfg, "fp8": True, "bf16": True, **rec.yaml_changes}
    check(RunPlan.resolve(build_config(flat), replace(gpu_context(1, 24, *H200), packages=here)), launch=True)
    # and the 7B config with it resolves to the same k
    assert resolve(qwen7b, 24, **rec.yaml_changes).checkpoint_layers == k


@pytest.mark.parametrize("over", [{}, {"use_unsloth_gc": True}], ids=["recompute", "offloaded"])
def test_a_resolved_partial_plan_is_estimated_at_its_own_k(qwen7b, over):
    """request_from_plan on the run plan that auto resolved (what the train path and the GPU tests predict
    with) estimates the k layers the run recomputes, not every layer: the same figure the choice was made on."""
    from lmstack.plan.from_config import request_from_plan

    p = resolve(qwen7b, 24, **over)
    k = p.checkpoint_layers
    assert k is not None
    got = plan(replace(request_from_plan(p, 1, 24), available=EVERYTHING)).configured
    assert got.setup.checkpoint_layers == k and got.setup.checkpoint_offload == bool(over)
    chosen = plan(request(qwen7b, 24, **over)).configured  # the unresolved config: the search's pick
    assert chosen.setup.checkpoint_layers == k
    assert got.estimate.gpu.allocated == pytest.approx(chosen.estimate.gpu.allocated)
    every = replace(got.setup, checkpoint_layers=None)
    assert estimate(request(qwen7b, 24).spec, every).gpu.allocated < got.estimate.gpu.allocated


def test_partial_offloaded_rows_are_shown_labelled_and_explained(qwen7b):
    """With use_unsloth_gc under auto the configured row is k/N offloaded: `lmstack plan` shows such rows
    ("k/N offload"), and a recommendation of one says it recomputes k of the N layers, offloaded."""
    from lmstack.memory.advice import ckpt_cell, reason
    from lmstack.memory.report import shown_candidates

    result = plan(request(qwen7b, 24, use_unsloth_gc=True))
    conf = result.configured.setup
    assert conf.checkpoint_offload and conf.checkpoint_layers is not None
    shown = [c for c in shown_candidates(result) if c.setup.checkpoint_offload and c.setup.checkpoint_layers]
    assert shown
    k = shown[0].setup.checkpoint_layers
    assert ckpt_cell(shown[0].setup, N) == f"{k}/{N} offload"
    assert f"{k}/{N} offload" in format_table(result)
    text = reason(result.request, shown[0], {}, None)
    assert (
        f"re-runs the forward of {k} of the {N} decoder layers" in text
        and "offloaded (use_unsloth_gc)" in text
    )


def test_the_recommendation_from_a_resolved_plan_searches_every_layer_count(qwen7b):
    """A resolved plan's k is its configured row's, not every searched row's: the recommendation still has
    rows that recompute every layer; and a request with k but checkpointing off is no error."""
    from lmstack.plan.from_config import request_from_plan

    p = resolve(qwen7b, 24)
    req = replace(request_from_plan(p, 1, 24), available=EVERYTHING)
    result = plan(req)
    assert result.configured.setup.checkpoint_layers == p.checkpoint_layers
    every = [
        c for c in result.candidates if c.setup.gradient_checkpointing and c.setup.checkpoint_layers is None
    ]
    assert every
    assert plan(replace(req, gradient_checkpointing=False, checkpoint_offload=False)).configured is not None
