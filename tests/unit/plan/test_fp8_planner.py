"""The planner models `fp8: true` (plan.fp8): the frozen base's FP8 weights byte for byte from the layer
shapes, the transient FP8 copies as named rows, 0.5B's layers too small to convert, and FP8 as a searched
setting (not a method change) on GPUs with FP8 tensor cores -- whose YAML change `lmstack check` accepts."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout
from dataclasses import replace

import pytest
import yaml

from chatml_tokenizer import write_chatml_tokenizer
from lmstack.config.load import build_config
from lmstack.memory import format_table, plan, resolve_auto, to_json
from lmstack.memory.memory import GIB
from lmstack.plan.runplan import RunPlan
from lmstack.plan.whatif import gpu_context, request_from_config
from lmstack.train.preflight import check

H200 = ((9, 0), "NVIDIA H200")
A100 = ((8, 0), "NVIDIA A100-SXM4-80GB")
EVERYTHING = frozenset({"deepspeed", "bitsandbytes", "liger_kernel", "torchao"})
YAML = dict(output_dir="o", bf16=True, cutoff_len=2048, packing=True, finetuning_type="lora", lora_target="all",
            per_device_train_batch_size=2, gradient_accumulation_steps=8, gradient_checkpointing=False)  # fmt: skip


@pytest.fixture
def model_dir(tmp_path, qwen_shapes):
    def make(size: str) -> str:
        d = tmp_path / f"qwen2.5-{size}"
        d.mkdir(exist_ok=True)
        config = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], **qwen_shapes[size]}
        (d / "config.json").write_text(json.dumps(config))
        write_chatml_tokenizer(d)
        return str(d)

    return make


def request(path: str, gib: float = 24, gpu=H200, gpus: int = 1, **kw):
    cfg = build_config({**YAML, "model_name_or_path": path, **kw})
    req = request_from_config(cfg, gpus, gib, gpu_capability=gpu[0], gpu_name=gpu[1])
    return replace(req, available=EVERYTHING)


# Qwen2.5-7B from first principles: hidden 3584, intermediate 18944, 28 layers, 28 heads x 128, 4 KV heads
# (kv 512), vocab 152064, untied head, q/k/v biases.
H, INTER, L, V, KV = 3584, 18944, 28, 152064, 512
FP8_PROJECTIONS = {
    "q_proj": (H, H),
    "o_proj": (H, H),
    "gate_proj": (INTER, H),
    "up_proj": (INTER, H),
    "down_proj": (H, INTER),
}
PER_LAYER = (
    H * H + H + 2 * (H * KV + KV) + H * H + 3 * H * INTER + 2 * H
)  # q(+bias), k, v (+bias), o, mlp, 2 norms
PARAMS_7B = 2 * V * H + L * PER_LAYER + H  # embedding, head, layers, final norm
FP8_PARAMS = L * sum(o * i for o, i in FP8_PROJECTIONS.values())
FP8_BYTES_7B = FP8_PARAMS * 1 + L * sum(o for o, _ in FP8_PROJECTIONS.values()) * 4  # e4m3 + fp32/row
BF16_BYTES_7B = 2 * (PARAMS_7B - FP8_PARAMS)  # embeddings, head, k/v (too small for FP8), norms, biases


def test_7b_lora_fp8_weights_are_the_exact_bytes_of_the_layer_shapes(model_dir):
    result = plan(request(model_dir("7b"), fp8=True))
    conf = result.configured
    assert conf.setup.fp8 == "frozen-base"
    assert req_params(result) == PARAMS_7B
    assert conf.estimate.gpu.weights * GIB == pytest.approx(FP8_BYTES_7B + BF16_BYTES_7B, abs=1)
    rows = dict(conf.estimate.weight_rows)
    assert rows["FP8 base layers (1 B/param + fp32 row scales)"] * GIB == pytest.approx(FP8_BYTES_7B, abs=1)
    assert rows["bf16 (embeddings, head, norms, kept layers)"] * GIB == pytest.approx(BF16_BYTES_7B, abs=1)
    bf16 = plan(request(model_dir("7b"))).configured
    assert bf16.estimate.gpu.weights * GIB == pytest.approx(2 * PARAMS_7B, abs=1)
    # the activations are bf16 LoRA's (the FP8 function saves only the weight); the backward's transient
    # is the largest converted layer's dy [tokens, out] + W^T [in, out] in FP8 with their fp32 scales
    assert conf.estimate.gpu.activations == bf16.estimate.gpu.activations
    tokens = 2 * 2048
    terms = dict(conf.estimate.gpu.terms)
    expected = tokens * INTER + INTER * H + 4 * (tokens + H)  # gate/up: out 18944, in 3584
    assert terms["fp8 backward: dy + W^T per input column, FP8 (one layer)"] * GIB == pytest.approx(expected)
    assert "fp8 forward: one GEMM input in FP8, beyond the backward's" in terms
    assert conf.estimate.gpu.total < bf16.estimate.gpu.total - 5.5  # ~6 GiB of frozen base saved


def req_params(result) -> int:
    return result.request.spec.num_params


def test_plan_shows_the_fp8_weight_rows_in_the_table_and_json(model_dir):
    result = plan(request(model_dir("7b"), fp8=True))
    table = format_table(result)
    assert "sft lora, fp8 frozen-base" in table.splitlines()[0]
    assert "of which FP8 base layers (1 B/param + fp32 row scales)" in table
    assert "fp8 backward: dy + W^T per input column" in table
    assert "kept bf16 (k_proj, v_proj: too small for FP8 to pay)" in table
    conf = to_json(result)["configured"]
    assert conf["fp8"] == "frozen-base"
    assert conf["weights_gib"]["FP8 base layers (1 B/param + fp32 row scales)"] == round(
        FP8_BYTES_7B / GIB, 3
    )


def test_05b_fp8_is_bf16_no_layer_converts_and_the_note_says_why(model_dir):
    result = plan(request(model_dir("0.5b"), fp8=True))
    bf16 = plan(request(model_dir("0.5b")))
    conf = result.configured
    assert conf.setup.fp8 == "frozen-base" and conf.estimate.weight_rows == ()
    assert conf.estimate.gpu.weights == bf16.configured.estimate.gpu.weights
    assert conf.estimate.gpu.total == bf16.configured.estimate.gpu.total  # no transient: nothing converts
    assert conf.cost == bf16.configured.cost  # nor a speed-up
    (note,) = [n for n in result.notes if n.startswith("fp8")]
    assert "no Linear layer converts" in note and "too small for FP8 to pay" in note


def test_24gb_7b_lora_lists_and_recommends_fp8_on_an_h200_not_on_an_a100(model_dir):
    result = plan(request(model_dir("7b"), 24, H200))
    fp8 = [c for c in result.candidates if c.setup.fp8]
    assert fp8 and all(c.strategy.name == "single+fp8" for c in fp8) and any(c.fits for c in fp8)
    rec = result.recommendation
    assert rec.candidate.setup.fp8 == "frozen-base" and not rec.candidate.changes_method
    assert rec.yaml_changes["fp8"] is True and "not a method change" in rec.reason
    bf16_best = min(c.cost for c in result.candidates if c.fits and not c.setup.fp8 and not c.changes_method)
    assert rec.candidate.cost < bf16_best
    on_a100 = plan(request(model_dir("7b"), 24, A100))
    assert not [c for c in on_a100.candidates if c.setup.fp8]
    assert "fp8" not in on_a100.recommendation.yaml_changes
    assert any(n.startswith("fp8: not searched") and "sm80" in n for n in on_a100.notes)
    unknown = plan(request(model_dir("7b"), 24, (None, None)))
    assert not [c for c in unknown.candidates if c.setup.fp8]
    assert any("compute capability is unknown" in n for n in unknown.notes)


def test_the_recommended_fp8_change_is_accepted_by_check(model_dir, base_cfg):
    """The YAML change applied to a config (the tiny model in place of 7B: the change does not depend on
    it) passes every rule `lmstack check` and `lmstack train` apply on an H200."""
    from lmstack.launch.context import LaunchContext

    rec = plan(request(model_dir("7b"), 24, H200)).recommendation
    assert rec.yaml_changes.get("fp8") is True
    flat = {**base_cfg, **rec.yaml_changes, "bf16": True}
    here = LaunchContext.from_env(probe_cuda=False).packages
    ctx = replace(gpu_context(1, 24, *H200), packages=here)
    check(RunPlan.resolve(build_config(flat), ctx), launch=True)  # raises ConfigError on a refusal


def test_an_fp8_config_on_an_a100_is_rejected_by_name_and_told_to_turn_it_off(model_dir, base_cfg):
    result = plan(request(model_dir("7b"), 24, A100, fp8=True))
    assert "FP8 tensor cores" in result.configured.why_not and "sm80" in result.configured.why_not
    rec = result.recommendation
    assert rec.yaml_changes["fp8"] is False and rec.candidate.setup.fp8 is None
    ctx = gpu_context(1, 24, *A100)
    check(RunPlan.resolve(build_config({**base_cfg, "fp8": True, **rec.yaml_changes, "bf16": True}), ctx))


def test_what_rules_refuse_with_fp8_runs_with_fp8_off(model_dir):
    """DeepSpeed (any stage) and LoRA under FSDP are refused with fp8 (plan/rules.py): an fp8 config's rows
    of those strategies run with fp8: false and say so; `auto` never picks one (it cannot change fp8)."""
    result = plan(request(model_dir("7b"), 24, H200, gpus=2, fp8=True))
    for c in result.candidates:
        if c.setup.deepspeed_stage is not None or c.setup.fsdp or c.changes_method:
            assert c.setup.fp8 is None and c.strategy.name.endswith("(no fp8)"), c.strategy.name
        else:
            assert c.setup.fp8 == "frozen-base", c.strategy.name
    if "deepspeed" in result.recommendation.yaml_changes:
        assert result.recommendation.yaml_changes["fp8"] is False


def test_auto_never_picks_deepspeed_for_an_fp8_config(model_dir):
    """On 2 x 12 GiB nothing fits without offload: bf16 `deepspeed: auto` takes ZeRO-3 offload, which the
    rules refuse with fp8 -- and `auto` cannot turn fp8 off, so it keeps no DeepSpeed and warns."""

    def auto(**kw):
        req = request(model_dir("7b"), 12, H200, gpus=2, **kw)
        return resolve_auto(
            replace(req, deepspeed_stage="auto", micro_batch=None, gradient_checkpointing=None)
        )

    assert auto()["deepspeed"] == "z3_offload"
    with_fp8 = auto(fp8=True)
    assert with_fp8["deepspeed"] is None and not with_fp8["fits"]


def test_full_fp8_is_float8_training_weights_and_activations_unchanged(model_dir):
    """torchao's Float8Linear keeps the bf16 weight and saves its bf16 input (as nn.Linear): only the
    transient FP8 copies of one layer are new rows."""
    fp8 = plan(request(model_dir("7b"), 80, H200, finetuning_type="full", fp8=True)).configured
    bf16 = plan(request(model_dir("7b"), 80, H200, finetuning_type="full")).configured
    assert fp8.setup.fp8 == "float8-training"
    g, b = fp8.estimate.gpu, bf16.estimate.gpu
    assert (g.weights, g.gradients, g.optimizer, g.activations) == (
        b.weights,
        b.gradients,
        b.optimizer,
        b.activations,
    )
    tokens = fp8.setup.micro_batch * 2048
    # W [out, in], dy per row and per column [tokens, out] x 2, the input per column [tokens, in] + scales:
    # largest for gate/up (out 18944, in 3584)
    expected = INTER * H + 2 * tokens * INTER + tokens * H + 4 * (2 * H + tokens + INTER)
    assert dict(g.terms)["fp8 backward: W, dy x2, input in FP8 (one layer)"] * GIB == pytest.approx(expected)
    assert fp8.cost > bf16.cost  # uncompiled float8 training is measured slower (the test below)


def full_request(path: str, gib: float = 141, gpus: int = 1, **kw):
    return request(path, gib, H200, gpus, finetuning_type="full", per_device_train_batch_size=8,
                   gradient_accumulation_steps=1, **kw)  # fmt: skip


def test_full_fp8_is_measured_slower_so_the_planner_ranks_it_below_bf16(model_dir):
    """bench/fp8_parity.py 1.5b_full on the H200: fp8 26,798 vs bf16 47,826 tok/s (torchao, uncompiled).
    The 1.5B full fine-tune's FP8 step costs that ratio; every FP8 row costs more than its bf16 twin, the
    recommendation keeps bf16, and the note says why: measured 0.56x, and no memory saved."""
    result = plan(full_request(model_dir("1.5b")))
    fp8 = [c for c in result.candidates if c.setup.fp8]
    assert fp8 and all(c.setup.fp8 == "float8-training" and c.fits for c in fp8)
    twin = {(c.strategy.name, c.setup.checkpoint_layers, c.setup.gradient_checkpointing,
             c.setup.checkpoint_offload, c.setup.micro_batch): c for c in result.candidates}  # fmt: skip
    for c in fp8:
        bf16 = twin[("single", c.setup.checkpoint_layers, c.setup.gradient_checkpointing,
                     c.setup.checkpoint_offload, c.setup.micro_batch)]  # fmt: skip
        assert c.cost / bf16.cost == pytest.approx(47_826 / 26_798, rel=1e-3)
        assert c.estimate.gpu.total >= bf16.estimate.gpu.total  # and it saves nothing in memory
    rec = result.recommendation
    assert rec.candidate.setup.fp8 is None and "fp8" not in rec.yaml_changes
    (note,) = [n for n in result.notes if n.startswith("fp8")]
    assert note.startswith("fp8 (float8-training): gate_proj, up_proj: GEMMs in FP8 (torchao)")
    assert "step time x1.78 of bf16's, slower" in note
    assert "ran at 0.56x of bf16's speed on the H200" in note and "without torch.compile" in note
    assert "saves no memory" in note
    assert note in format_table(result)
    # two GPUs: neither DDP nor FSDP with fp8 is recommended (FSDP's fp8 row is searched too)
    two = plan(full_request(model_dir("1.5b"), gpus=2))
    assert {c.strategy.name for c in two.candidates if c.setup.fp8} == {"ddp+fp8", "fsdp_full_shard+fp8"}
    assert two.recommendation.candidate.setup.fp8 is None and "fp8" not in two.recommendation.yaml_changes


def test_full_fp8_run_plan_says_once_it_is_measured_slower_and_still_runs_it(model_dir, base_cfg):
    """fp8: true with finetuning_type: full is accepted and runs torchao's float8 training as before; the
    run plan's notes say once that it was measured at 0.56x of bf16 uncompiled and saves no memory."""
    ctx = gpu_context(1, 141, *H200)
    flat = {**base_cfg, "model_name_or_path": model_dir("1.5b"), "bf16": True, "fp8": True}

    def speed_notes(**kw) -> tuple[RunPlan, list[str]]:
        run = RunPlan.resolve(build_config({**flat, **kw}), ctx)
        return run, [n for n in run.notes if "of bf16's speed" in n]

    run, notes = speed_notes(finetuning_type="full")
    assert (run.fp8.enabled, run.fp8.scope, run.fp8.backend) == (True, "float8-training", "torchao")
    (note,) = notes
    assert note.startswith("fp8 (full fine-tuning, torchao float8-training): expect it slower than bf16")
    assert "ran at 0.56x of bf16's speed on the H200 (Qwen2.5-1.5B shape, full fine-tuning, 8 x 2048" in note
    assert "without torch.compile" in note
    assert note.endswith("fp8: false runs faster here (uncompiled, as this run is)")
    assert "saves no memory either (weights, gradients and optimizer states stay bf16/fp32" in note
    assert f"note: {note}" in run.describe()
    check(run)  # not refused
    _, compiled = speed_notes(finetuning_type="full", torch_compile=True)
    assert len(compiled) == 1 and "FP8's speed compiled is not measured" in compiled[0]
    assert speed_notes(finetuning_type="lora")[1] == []  # frozen-base: faster, no such note
    assert speed_notes(finetuning_type="full", fp8=False)[1] == []
    # the tiny model: no projection converts (fp8_small_layers says the run computes in bf16)
    assert [n for n in RunPlan.resolve(build_config({**base_cfg, "bf16": True, "fp8": True,
            "finetuning_type": "full"}), ctx).notes if "of bf16's speed" in n] == []  # fmt: skip


def test_lmstack_plan_cli_gpu_capability_searches_fp8(model_dir, tmp_path):
    from lmstack.cli.main import main

    config = tmp_path / "train.yaml"
    config.write_text(
        yaml.safe_dump({**YAML, "model_name_or_path": model_dir("7b"), "dataset": "alpaca_en_demo"})
    )
    out = io.StringIO()
    args = ["plan", str(config), "--gpus", "1", "--gpu-memory", "24", "--no-data", "--json"]
    with redirect_stdout(out):
        main([*args, "--gpu-capability", "9.0"])
    got = json.loads(out.getvalue())
    assert any(c["fp8"] == "frozen-base" for c in got["candidates"])
    assert got["recommendation"]["yaml_changes"]["fp8"] is True
    with pytest.raises(SystemExit):
        main([*args, "--gpu-capability", "nine"])


def test_lmstack_plan_on_an_fp8_config_imports_no_training_stack(model_dir, tmp_path):
    """torch is imported here (models/fp8.py's layer rules), nothing of the training stack: what keeps
    the answer fast, asserted by the modules loaded rather than by a wall-clock bound."""
    import os
    import subprocess
    import sys

    import lmstack

    config = tmp_path / "train.yaml"
    flat = {**YAML, "model_name_or_path": model_dir("7b"), "dataset": "alpaca_en_demo", "fp8": True}
    config.write_text(yaml.safe_dump(flat))
    src = os.path.dirname(os.path.dirname(lmstack.__file__))
    probe = (
        "import sys; from lmstack.cli.main import main; sys.argv = ['lmstack', *sys.argv[1:]]\n"
        "try:\n    main()\nfinally:\n    print('MODULES', sorted({m.split('.')[0] for m in sys.modules}))"
    )
    argv = [sys.executable, "-c", probe, "plan", str(config), "--gpus", "1", "--gpu-memory", "24"]
    proc = subprocess.run([*argv, "--gpu-capability", "9.0", "--no-data"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": src}, timeout=120, check=True)  # fmt: skip
    loaded = proc.stdout.rsplit("MODULES", 1)[1]
    assert not [m for m in ("transformers", "trl", "peft", "datasets", "deepspeed") if f"'{m}'" in loaded], (
        loaded
    )
    assert "of which FP8 base layers" in proc.stdout
