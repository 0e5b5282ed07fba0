"""What `lmstack plan` shows: the margins as rows, allocated vs reserved, each rejected row's reason."""

from __future__ import annotations

import json

import pytest

from lmstack.memory import PlanRequest, format_table, plan, to_json
from lmstack.memory import memory as mem


def test_json_gives_allocated_and_reserved_and_the_margins(specs):
    result = plan(PlanRequest(spec=specs["qwen2.5-7b"], finetuning_type="lora", micro_batch=2, seq_len=2048,
                              gradient_checkpointing=True, gpu_memory_gib=80, fused_ce=True))  # fmt: skip
    conf = json.loads(json.dumps(to_json(result)))["configured"]
    g = conf["per_gpu_gib"]
    parts = sum(
        g[k] for k in ("weights", "gradients", "optimizer", "adapters", "activations", "logits", "stage")
    )
    assert conf["allocated_gib"] == pytest.approx(parts, abs=0.01)
    assert conf["reserved_gib"] == pytest.approx(conf["allocated_gib"] * mem.FRAGMENTATION_FACTOR, abs=0.01)
    assert g["total"] == pytest.approx(conf["reserved_gib"] + mem.CUDA_CONTEXT_GIB, abs=0.01)


def test_unpacked_rows_get_the_larger_fragmentation_margin(specs):
    packed = plan(PlanRequest(spec=specs["qwen2.5-0.5b"], micro_batch=4, packed=True)).configured
    padded = plan(PlanRequest(spec=specs["qwen2.5-0.5b"], micro_batch=4, packed=False)).configured
    ratio = padded.estimate.gpu.reserved / padded.estimate.gpu.allocated
    assert ratio == pytest.approx(mem.UNPACKED_FRAGMENTATION_FACTOR)
    assert padded.estimate.gpu.allocated == pytest.approx(packed.estimate.gpu.allocated)


def test_table_names_the_margins_and_why_each_row_was_rejected(specs):
    result = plan(PlanRequest(spec=specs["qwen2.5-7b"], finetuning_type="full", gpu_memory_gib=80,
                              cpu_memory_gib=64, fused_ce=True))  # fmt: skip
    table = format_table(result)
    assert "margin: allocator fragmentation" in table and "margin: CUDA context" in table
    assert "torch.cuda.max_memory_allocated" in table
    rejected = [line for line in table.splitlines() if "✗" in line]
    assert rejected and all("GiB" in line.split("✗", 1)[1] for line in rejected)  # the reason, in the row
    assert any("CPU" in line for line in rejected)  # offload rows: not enough CPU memory
