"""``lmstack plan``: per-GPU memory prediction, strategy choice and Megatron 3D layouts.

Pure Python; no GPU, no weights (the model is built on the meta device to count parameters).

Public API:

* ``ModelSpec.from_pretrained_dir(path)`` / ``ModelSpec.from_config(cfg)`` -- model shape facts.
* ``PlanRequest(spec, ...)`` -- what the YAML asks for (``None`` = search that field).
* ``plan(req) -> PlanResult`` -- every candidate, the configured one, the recommendation.
* ``format_table(result) -> str`` / ``to_json(result, all_candidates=False) -> dict``.
* ``resolve_auto(req) -> dict`` -- concrete values for ``auto`` fields plus a log ``message``.
* ``enumerate_layouts(spec, gpus, gpus_per_node, micro_batches, **options) -> list[Layout]``.
* ``check_layout(spec, gpus, tp, pp, **options) -> Layout``; ``pretrain_gpt_args(layout) -> list[str]``.
* ``MemoryBreakdown`` -- GiB per GPU by category (``to_dict()``); formulas in ``plan.memory``.
"""

from lmstack.memory.memory import MemoryBreakdown
from lmstack.memory.model_spec import ModelSpec
from lmstack.memory.parallel import Layout, check_layout, enumerate_layouts, pretrain_gpt_args
from lmstack.memory.recommend import PlanRequest, PlanResult, plan, resolve_auto
from lmstack.memory.report import format_table, to_json

__all__ = [
    "Layout",
    "MemoryBreakdown",
    "ModelSpec",
    "PlanRequest",
    "PlanResult",
    "check_layout",
    "enumerate_layouts",
    "format_table",
    "plan",
    "pretrain_gpt_args",
    "resolve_auto",
    "to_json",
]
