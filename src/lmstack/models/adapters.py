"""What is trained: full | freeze | lora | oft (PEFT). `use_llama_pro` narrows freeze/lora/oft to the
expanded blocks of a block-expanded (LLaMA-Pro) model: with N layers and k = freeze_trainable_layers,
layers k'-1, 2k'-1, ..., N-1 with k' = N / k (LLaMA-Factory's layout: one new block after every group)."""

from __future__ import annotations

import logging
import re
from typing import Any

from lmstack.config.errors import ConfigError
from lmstack.config.schema import Config
from lmstack.models import unsloth_model
from lmstack.models.vision import freeze_parts, lora_targets

logger = logging.getLogger(__name__)
LAYER_RE = re.compile(r"\.(?:layers|h|blocks)\.(\d+)\.")
PISSA_INIT = "pissa_init"  # output_dir subfolders written with pissa_convert: true
PISSA_CONVERTED = "pissa_converted"


def find_all_linear_modules(model: Any) -> list[str]:
    """Leaf names of every linear layer except the output head (PEFT matches leaf names everywhere)."""
    head = model.get_output_embeddings()
    names = set()
    for full_name, module in model.named_modules():
        cls = type(module).__name__
        if module is head or full_name.split(".")[-1] in ("lm_head", "output_layer"):
            continue
        if "Linear" in cls and "Embedding" not in cls and not list(module.children()):
            names.add(full_name.split(".")[-1])
    return sorted(names)


def count_parameters(model: Any) -> tuple[int, int]:
    trainable = total = 0
    for p in model.parameters():
        n = p.numel()
        if hasattr(p, "ds_numel"):  # ZeRO-3 partitioned parameter
            n = p.ds_numel
        total += n
        if p.requires_grad:
            trainable += n
    return trainable, total


def log_trainable(model: Any) -> None:
    trainable, total = count_parameters(model)
    logger.info(
        "trainable params: %s || all params: %s || trainable%%: %.4f",
        f"{trainable:,}",
        f"{total:,}",
        100 * trainable / max(total, 1),
    )


def num_layers(model: Any) -> int:
    config = getattr(model.config, "text_config", None) or model.config
    return getattr(config, "num_hidden_layers", None) or getattr(config, "num_layers", 0)


def llama_pro_layers(n_layers: int, k: int) -> list[int]:
    """The expanded blocks of a LLaMA-Pro model: every (N / k)-th layer, the last one included."""
    if k <= 0 or n_layers % k:
        raise ConfigError(
            f"freeze_trainable_layers: got {k} with use_llama_pro; it is the number of expanded blocks and "
            f"must divide the model's {n_layers} layers (e.g. {', '.join(map(str, _divisors(n_layers)))})"
        )
    stride = n_layers // k
    return list(range(stride - 1, n_layers, stride))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _adapter_targets(cfg: Config, model: Any, field: str) -> list[str]:
    """The modules a PEFT adapter wraps: leaf names from `field` (lora_target | oft_target), or with
    use_llama_pro the full names of those modules inside the expanded blocks only."""
    value = getattr(cfg.finetuning, field)
    if value.strip() == "all":
        targets = find_all_linear_modules(model)
        logger.info("Found linear modules: %s", ",".join(targets))
    else:
        targets = [t.strip() for t in value.split(",") if t.strip()]
        leaves = {name.split(".")[-1] for name, _ in model.named_modules()}
        missing = [t for t in targets if t not in leaves]
        if missing:
            raise ConfigError(
                f"{field}: {', '.join(missing)} not found in the model; linear layers are: "
                f"{', '.join(find_all_linear_modules(model))} (or use `all`)"
            )
    if not cfg.finetuning.use_llama_pro:
        return lora_targets(cfg, model, targets)  # a vision model: outside its frozen parts only
    layers = set(llama_pro_layers(num_layers(model), cfg.finetuning.freeze_trainable_layers))
    chosen = []
    for name, _ in model.named_modules():
        match = LAYER_RE.search(name + ".")
        if match and int(match.group(1)) in layers and name.split(".")[-1] in targets:
            chosen.append(name)
    logger.info("LLaMA-Pro: adapters on the expanded layers %s", ",".join(map(str, sorted(layers))))
    return chosen


def _modules_to_save(cfg: Config) -> list[str] | None:
    extra = cfg.finetuning.additional_target
    return [m.strip() for m in extra.split(",") if m.strip()] if extra else None


def apply_lora(cfg: Config, model: Any, is_trainable: bool = True) -> Any:
    from peft import LoraConfig, PeftModel, get_peft_model

    ft = cfg.finetuning
    adapters = [a.strip() for a in (cfg.model.adapter_name_or_path or "").split(",") if a.strip()]
    # earlier adapters are merged into the base; with create_new_adapter the last one too
    to_merge = adapters if ft.create_new_adapter else adapters[:-1]
    for path in to_merge:
        model = PeftModel.from_pretrained(model, path).merge_and_unload()
        logger.info("merged adapter %s", path)
    if adapters and not ft.create_new_adapter:
        model = PeftModel.from_pretrained(model, adapters[-1], is_trainable=is_trainable)
        logger.info("resumed adapter %s", adapters[-1])
        return model
    common = dict(
        r=ft.lora_rank,
        lora_alpha=ft.lora_alpha or 2 * ft.lora_rank,
        lora_dropout=ft.lora_dropout,
        target_modules=_adapter_targets(cfg, model, "lora_target"),
        use_rslora=ft.use_rslora,
        modules_to_save=_modules_to_save(cfg),
    )
    if unsloth_model.is_unsloth(model):  # the run plan loaded it through Unsloth: its LoRA kernels too
        return unsloth_model.peft_model(model, common, cfg.training.seed)
    config = LoraConfig(
        task_type="CAUSAL_LM",
        use_dora=ft.use_dora,
        init_lora_weights=_init_lora_weights(cfg),
        **common,
    )
    return get_peft_model(model, config)


def apply_oft(cfg: Config, model: Any) -> Any:
    """PEFT's OFT: each targeted linear layer's input is rotated block-wise by a learned orthogonal
    matrix (identity at the start, so the model starts as the base); one of oft_rank (blocks) and
    oft_block_size (block width) is set, PEFT derives the other from the layer width."""
    from peft import OFTConfig, get_peft_model

    ft = cfg.finetuning
    config = OFTConfig(
        task_type="CAUSAL_LM",
        r=ft.oft_rank,
        oft_block_size=ft.oft_block_size,
        module_dropout=ft.module_dropout,
        target_modules=_adapter_targets(cfg, model, "oft_target"),
        modules_to_save=_modules_to_save(cfg),
    )
    return get_peft_model(model, config)


def _init_lora_weights(cfg: Config) -> bool | str:
    """PEFT's init switch: PiSSA moves the top-r singular directions of W into A, B (W keeps the rest)."""
    if not cfg.finetuning.pissa_init:
        return True
    if cfg.finetuning.pissa_iter == -1:
        return "pissa"
    return f"pissa_niter_{cfg.finetuning.pissa_iter}"


def freeze_extra_modules(cfg: Config) -> tuple[str, ...]:
    """freeze_extra_modules as names (freeze-tuning only): the non-layer modules apply_freeze trains."""
    ft = cfg.finetuning
    if ft.finetuning_type != "freeze" or not ft.freeze_extra_modules:
        return ()
    return tuple(m.strip() for m in ft.freeze_extra_modules.split(",") if m.strip())


def apply_freeze(cfg: Config, model: Any) -> Any:
    ft = cfg.finetuning
    n_layers = num_layers(model)
    k = ft.freeze_trainable_layers
    if ft.use_llama_pro:
        layer_ids = set(llama_pro_layers(n_layers, k))
    else:  # LF's ranges: the last k layers, or the first -k, clamped to the model's layers (0: none)
        if abs(k) > n_layers:
            logger.info("freeze_trainable_layers: %d for a %d-layer model: every layer trains", k, n_layers)
        layer_ids = set(range(max(0, n_layers - k), n_layers)) if k > 0 else set(range(min(-k, n_layers)))
    modules = (
        None
        if ft.freeze_trainable_modules.strip() == "all"
        else {m.strip() for m in ft.freeze_trainable_modules.split(",")}
    )
    extra = set(freeze_extra_modules(cfg))
    matched: set[str] = set()
    for name, param in model.named_parameters():  # a tied head is listed once, as the embedding
        match = LAYER_RE.search(name)
        in_layer = match is not None and int(match.group(1)) in layer_ids
        module_ok = modules is None or any(f".{m}." in name for m in modules)
        hits = {e for e in extra if name.startswith(e + ".") or f".{e}." in name}
        matched |= hits
        param.requires_grad = (in_layer and module_ok) or bool(hits)
    if extra - matched:  # LF refuses a module it cannot find, too
        raise ConfigError(
            f"freeze_extra_modules: {', '.join(sorted(extra - matched))} names no module with parameters "
            "outside this model's layers (a head tied to the embedding is embed_tokens); remove it or name "
            "one the model has, e.g. embed_tokens, norm"
        )
    logger.info(
        "Fine-tuning method: Freeze%s (trainable layers: %s)",
        " + LLaMA-Pro" if ft.use_llama_pro else "",
        ",".join(map(str, sorted(layer_ids))),
    )
    return model


def fuse_lora_layers(cfg: Config, model: Any) -> int:
    """The run plan chose lora_kernel fused: every PEFT LoRA Linear computes through one fused autograd
    function (models/fused_lora.py). A layer that cannot (a resumed DoRA adapter, a Conv1D base) is
    refused by name under an explicit `lora_kernel: fused`; under auto it keeps PEFT's forward."""
    from lmstack.models.fused_lora import apply_fused_lora

    fused, skipped = apply_fused_lora(model)
    if skipped:
        name, why = next(iter(skipped.items()))
        if cfg.finetuning.lora_kernel == "fused":
            raise ConfigError(
                f"lora_kernel: fused cannot compute LoRA layer {name} ({why}; {len(skipped)} such "
                "layer(s)); use lora_kernel: peft or auto (auto keeps PEFT's forward for those layers)"
            )
        logger.info("LoRA kernel: %d layer(s) keep PEFT's forward, e.g. %s (%s)", len(skipped), name, why)
    logger.info("LoRA kernel: fused in %d LoRA Linear layers (scaling and add in the GEMM epilogue)", fused)
    return fused


def setup_finetuning(cfg: Config, model: Any, lora_kernel: str = "peft") -> Any:
    """`lora_kernel` is the run plan's decision: fused (models/fused_lora.py) | peft (PEFT's forward)."""
    kind = cfg.finetuning.finetuning_type
    if kind == "lora":
        logger.info("Fine-tuning method: LoRA")
        model = apply_lora(cfg, model)
        from lmstack.models.kernels import cast_adapters_to_base_dtype

        if not unsloth_model.is_unsloth(model) and cast_adapters_to_base_dtype(
            model
        ):  # PEFT keeps fp32 adapters on a bf16 base: 1.4-1.55x slower
            logger.info("LoRA adapters kept in bf16 like the frozen base")
        if lora_kernel == "fused":
            fuse_lora_layers(cfg, model)
    elif kind == "oft":
        logger.info("Fine-tuning method: OFT")
        model = apply_oft(cfg, model)
    elif kind == "freeze":
        model = apply_freeze(cfg, model)
    else:
        logger.info("Fine-tuning method: Full")
        for p in model.parameters():
            p.requires_grad = True
    freeze_parts(cfg, model)  # a vision model: freeze_vision_tower / _multi_modal_projector / _language_model
    log_trainable(model)
    if cfg.model.print_param_status:
        for name, p in model.named_parameters():
            logger.info("%s: %s %s trainable=%s", name, p.dtype, p.device, p.requires_grad)
    return model
