"""DeepSpeed through the Trainer integration: find `deepspeed: <path or template name>`, validate it
before launch, resolve the few "auto" values the Trainer does not fill, and make DeepSpeed's op
builder survive TORCH_CUDA_ARCH_LIST values like '9.0a' (what an H200 image sets).

The ZeRO templates ship inside the package (launch/templates/, the same files as LLaMA-Factory's
examples/deepspeed/), so `deepspeed: z3_offload` works from any working directory.

The Trainer (transformers.integrations.deepspeed) fills these "auto" values from the YAML: batch
sizes, accumulation, clipping (max_grad_norm), optimizer/scheduler params, fp16/bf16 and the
hidden-size based bucket sizes. "auto" anywhere else would reach DeepSpeed unresolved, so it is
either resolved here (communication_data_type) or reported.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

from lmstack.config.errors import ConfigError, closest, did_you_mean

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install deepspeed"
TEMPLATE_DIR = Path(__file__).resolve().parent / "templates"
# `deepspeed:` names of the shipped templates -> their file in TEMPLATE_DIR (LF's file names)
TEMPLATES = {
    "z0": "ds_z0_config.json",
    "z1": "ds_z1_config.json",
    "z2": "ds_z2_config.json",
    "z2_offload": "ds_z2_offload_config.json",
    "z3": "ds_z3_config.json",
    "z3_offload": "ds_z3_offload_config.json",
}
# where a source checkout (and LF) keeps the same files; `deepspeed: examples/deepspeed/ds_z3_config.json`
# finds the shipped copy when run from a directory without that folder
EXAMPLES_DIR = Path("examples/deepspeed")

TOP_LEVEL_KEYS = frozenset(
    """train_batch_size train_micro_batch_size_per_gpu gradient_accumulation_steps gradient_clipping
    steps_per_print wall_clock_breakdown dump_state memory_breakdown prescale_gradients
    gradient_predivide_factor sparse_gradients zero_allow_untested_optimizer zero_force_ds_cpu_optimizer
    optimizer scheduler fp16 bf16 bfloat16 amp torch_autocast zero_optimization activation_checkpointing
    flops_profiler communication_data_type seq_parallel_communication_data_type data_types tensorboard
    wandb csv_monitor comet aio elasticity autotuning compression_training data_efficiency
    curriculum_learning checkpoint pipeline tensor_parallel nebula disable_allgather
    dataloader_drop_last sparse_attention eigenvalue progressive_layer_drop quantize_training
    weight_quantization hybrid_engine compile timers graph_harvesting
    use_data_before_expert_parallelism use_node_local_storage load_universal_checkpoint
    zero_quantized_weights fp8 sequence_parallel_size""".split()
)
ZERO_KEYS = frozenset(
    """stage allgather_partitions allgather_bucket_size overlap_comm reduce_scatter reduce_bucket_size
    contiguous_gradients offload_param offload_optimizer sub_group_size cpu_offload cpu_offload_params
    cpu_offload_use_pin_memory load_from_fp32_weights elastic_checkpoint ignore_unused_parameters
    legacy_stage1 round_robin_gradients zero_hpz_partition_size zero_quantized_weights
    zero_quantized_nontrainable_weights zero_quantized_gradients mics_shard_size
    mics_hierarchical_params_gather memory_efficient_linear pipeline_loading_checkpoint
    override_module_apply use_multi_rank_bucket_allreduce log_trace_cache_warnings
    stage3_max_live_parameters stage3_max_reuse_distance stage3_prefetch_bucket_size
    stage3_param_persistence_threshold stage3_model_persistence_threshold
    stage3_gather_16bit_weights_on_model_save stage3_gather_fp16_weights_on_model_save
    stage3_module_granularity_threshold stage3_use_all_reduce_for_fetch_params
    max_live_parameters max_reuse_distance prefetch_bucket_size param_persistence_threshold
    model_persistence_threshold gather_16bit_weights_on_model_save module_granularity_threshold
    use_all_reduce_for_fetch_params zeropp_loco_param leaf_module""".split()
)
# "auto" keys the Trainer's DeepSpeed integration fills (transformers/integrations/deepspeed.py)
TRAINER_AUTO_KEYS = frozenset(
    """train_batch_size train_micro_batch_size_per_gpu gradient_accumulation_steps gradient_clipping
    optimizer.params.lr optimizer.params.betas optimizer.params.eps optimizer.params.weight_decay
    scheduler.params.warmup_min_lr scheduler.params.warmup_max_lr scheduler.params.warmup_num_steps
    scheduler.params.total_num_steps fp16.enabled bf16.enabled zero_optimization.reduce_bucket_size
    zero_optimization.stage3_prefetch_bucket_size zero_optimization.stage3_param_persistence_threshold
    amp.enabled amp.opt_level""".split()
)
# "auto" keys lmstack resolves itself before the Trainer sees the config
LMSTACK_AUTO_KEYS = frozenset({"communication_data_type"})


def check_installed() -> None:
    if importlib.util.find_spec("deepspeed") is None:
        raise ConfigError(
            f"deepspeed: the `deepspeed` package is not installed; {INSTALL_HINT} "
            "(or remove `deepspeed:` to train without ZeRO)"
        )


def _unknown_keys(section: str, mapping: dict, known: frozenset[str]) -> tuple[list[str], list[str]]:
    """(errors for likely typos, warnings for keys lmstack does not know)."""
    errors, warnings = [], []
    for key in mapping:
        if key in known:
            continue
        match = closest(key, known, cutoff=0.75)
        where = f"{section}.{key}" if section else key
        if match:
            errors.append(f"{where}: unknown DeepSpeed key (did you mean '{match[0]}'?)")
        else:
            warnings.append(f"{where}: not a DeepSpeed key lmstack knows; passed to DeepSpeed unchanged")
    return errors, warnings


def _auto_paths(obj: Any, prefix: str = "") -> list[str]:
    if isinstance(obj, dict):
        out = []
        for key, value in obj.items():
            out += _auto_paths(value, f"{prefix}{key}" if not prefix else f"{prefix}.{key}")
        return out
    return [prefix] if obj == "auto" else []


def _drop_comments(obj: Any) -> Any:
    """Keys starting with `_` are comments (`"_comment": "..."`, as LF's own DeepSpeed files write them):
    dropped at every level, so they are neither refused nor handed to DeepSpeed."""
    if isinstance(obj, dict):
        return {k: _drop_comments(v) for k, v in obj.items() if not str(k).startswith("_")}
    if isinstance(obj, list):
        return [_drop_comments(v) for v in obj]
    return obj


def _short(name: str) -> str:
    return name.removesuffix(".json").removeprefix("ds_").removesuffix("_config")


def _template_name(ref: Path) -> str | None:
    """`z3_offload`, `ds_z3_offload_config`, `ds_z3_offload_config.json` and
    `examples/deepspeed/ds_z3_offload_config.json` -> "z3_offload"; None for anything else."""
    if ref.parent == Path(".") and ref.name in TEMPLATES:
        return ref.name
    if ref.parent not in (Path("."), EXAMPLES_DIR):
        return None  # a missing file in some other folder is not silently replaced by a template
    stem = ref.name.removesuffix(".json")
    return _short(stem) if TEMPLATES.get(_short(stem)) == f"{stem}.json" else None


def resolve_deepspeed_ref(value: str | Path, field: str = "deepspeed") -> Path:
    """The DeepSpeed JSON that `deepspeed: <value>` means: a file that exists wins; else the name of a
    shipped template (z0 z1 z2 z2_offload z3 z3_offload, or its LF file name). Unknown: ConfigError."""
    ref = Path(value)
    if ref.is_file():
        return ref
    name = _template_name(ref)
    if name is not None:
        return TEMPLATE_DIR / TEMPLATES[name]
    names = " | ".join(TEMPLATES)
    raise ConfigError(
        f"{field}: {value} not found: no such file, and not a shipped template; set a path to a "
        f"DeepSpeed JSON or a template name: {names}{did_you_mean(_short(ref.name), TEMPLATES)}"
    )


def load_deepspeed_config(path: str | Path, field: str = "deepspeed") -> dict:
    """Read and validate a DeepSpeed JSON (a path or a shipped template name, see
    `resolve_deepspeed_ref`); errors name the file, the key and the fix."""
    path = resolve_deepspeed_ref(path, field)
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ConfigError(
            f"{field}: {path} is not valid JSON (line {err.lineno}, column {err.colno}: {err.msg}); "
            "note that JSON allows no comments and no trailing commas"
        ) from None
    if not isinstance(config, dict):
        raise ConfigError(f"{field}: {path} must hold a JSON object, got {type(config).__name__}")
    config = _drop_comments(config)
    errors, warnings = _unknown_keys("", config, TOP_LEVEL_KEYS)
    zero = config.get("zero_optimization", {})
    if not isinstance(zero, dict):
        errors.append('zero_optimization: must be an object like {"stage": 2}')
        zero = {}
    e2, w2 = _unknown_keys("zero_optimization", zero, ZERO_KEYS)
    errors += e2
    warnings += w2
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        errors.append(f"zero_optimization.stage: got {stage!r}; allowed: 0 | 1 | 2 | 3")
    if zero.get("offload_param") and stage != 3:
        errors.append("zero_optimization.offload_param: parameter offload needs stage 3")
    for key in _auto_paths(config):
        if key not in TRAINER_AUTO_KEYS | LMSTACK_AUTO_KEYS:
            errors.append(
                f'{key}: "auto" is not filled by anyone here; give a value ("auto" works for: '
                + ", ".join(sorted(TRAINER_AUTO_KEYS | LMSTACK_AUTO_KEYS))
                + ")"
            )
    if errors:
        raise ConfigError(f"{field}: {path}:\n  " + "\n  ".join(errors))
    for w in warnings:
        logger.warning("%s: %s", path, w)
    return config


def zero_stage(config: dict) -> int:
    zero = config.get("zero_optimization") or {}
    return int(zero.get("stage", 0))


def resolve_config(config: dict, bf16: bool, fp16: bool) -> dict:
    """Fill the "auto" values the Trainer leaves alone; returns a new dict."""
    out = json.loads(json.dumps(config))
    if out.get("communication_data_type") == "auto":
        out["communication_data_type"] = "bf16" if bf16 else "fp16" if fp16 else "fp32"
        logger.info("deepspeed: communication_data_type auto -> %s", out["communication_data_type"])
    return out


_ARCH = re.compile(r"^(\d+)\.(\d+)[a-zA-Z]*(\+PTX)?$")


def normalize_arch_list(env: MutableMapping[str, str] | None = None) -> str | None:
    """DeepSpeed's op builder parses TORCH_CUDA_ARCH_LIST with int() and crashes on '9.0a'.
    Rewrite suffixed entries ('9.0a' -> '9.0', '10.0f+PTX' -> '10.0+PTX'); returns a log line
    when something changed. Called by the launcher only (never at import)."""
    env = os.environ if env is None else env
    raw = env.get("TORCH_CUDA_ARCH_LIST")
    if not raw:
        return None
    items = [x for x in re.split(r"[;\s,]+", raw.strip()) if x]
    fixed = []
    for item in items:
        m = _ARCH.match(item)
        value = f"{m.group(1)}.{m.group(2)}{m.group(3) or ''}" if m else item
        if value not in fixed:
            fixed.append(value)
    if fixed == items:
        return None
    new = ";".join(fixed)
    env["TORCH_CUDA_ARCH_LIST"] = new
    return (
        f"TORCH_CUDA_ARCH_LIST: {raw!r} -> {new!r} (DeepSpeed's op builder cannot parse "
        "arch suffixes like 'a'; the generic arch builds the same kernels for training)"
    )
