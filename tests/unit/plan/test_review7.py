"""Review of issue 20's planner rules (full checkpointing's recompute, the accumulation margin under classic
AMP, the loss head above the recompute): the cases where they gave a wrong number, each through the path
`lmstack plan` takes (a YAML on a config.json-only Qwen2.5 folder) or the run's own code path on CPU."""

from __future__ import annotations

import json

import pytest

from lmstack.config.load import build_config
from lmstack.plan import memory as mem
from lmstack.plan import plan
from lmstack.plan.whatif import plan_for, request_from_config


@pytest.fixture
def qwen(tmp_path, qwen_shapes):
    def make(size: str) -> str:
        d = tmp_path / f"qwen2.5-{size}"
        if not d.exists():
            d.mkdir()
            body = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], **qwen_shapes[size]}
            (d / "config.json").write_text(json.dumps(body))
        return str(d)

    return make


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
