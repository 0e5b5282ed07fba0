"""The saved LoRA adapter is checked, never trusted: an adapter file with no tensors (seen with FSDP1 on
2 x H200: the Trainer's FULL_STATE_DICT save wrote `adapter_model.safetensors` with 0 tensors, bench
results 2026-11-29) is an error, not a silent success. Under FSDP the adapter is gathered here instead:
every rank enters FSDP.summon_full_params, rank 0 reads the full trainable tensors and writes them.
The same holds for checkpoint-N folders (written by ReliableMixin trainers after the Trainer's own save),
and a resume under FSDP + LoRA loads the adapter back from that verified file (`load_fsdp_adapter`)
rather than from the Trainer's adapter-only FSDP state dict, which PEFT filled by the same module names.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from lmstack.config.errors import ConfigError, LmstackError
from lmstack.launch.dist import barrier, world_size

logger = logging.getLogger(__name__)
ADAPTER_FILE = "adapter_model.safetensors"
FSDP_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def is_peft(model: Any) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "save_pretrained")


def clean_name(name: str) -> str:
    """Parameter name without the wrapper prefixes FSDP / activation checkpointing / compile add."""
    for prefix in FSDP_PREFIXES:
        name = name.replace(prefix, "")
    return name


def adapter_renamer(model: Any) -> tuple[str, Any]:
    """(active adapter name, rename(key, adapter)): PEFT's parameter name -> its key in the saved file."""
    from peft.mapping import PEFT_TYPE_TO_TUNER_MAPPING

    adapter = model.active_adapter if isinstance(model.active_adapter, str) else model.active_adapter[0]
    tuner = PEFT_TYPE_TO_TUNER_MAPPING.get(model.peft_config[adapter].peft_type)
    rename = getattr(tuner, "_remove_adapter_name_from_key", None) or (lambda k, a: k.replace(f".{a}", ""))
    return adapter, rename


def trainable_tensors(named: Any) -> dict[str, Any]:
    """{clean name: detached CPU copy} of the trainable (adapter) parameters; an FSDP2 DTensor is
    gathered whole (full_tensor() is a collective: every rank must call this then)."""
    return {
        clean_name(n): (p.full_tensor() if _is_dtensor(p) else p).detach().to("cpu", copy=True)
        for n, p in named
        if p.requires_grad and p.numel()
    }


def check_adapter_file(output_dir: str | Path) -> int:
    """Number of tensors in the saved adapter; raises when the file is missing, empty or hollow."""
    from safetensors import safe_open

    path = Path(output_dir) / ADAPTER_FILE
    if not path.is_file():
        raise LmstackError(f"saving the adapter failed: {path} was not written")
    with safe_open(str(path), framework="pt") as f:
        keys = list(f.keys())
        empty = [
            k for k in keys if f.get_slice(k).get_shape() in ([], [0]) or 0 in f.get_slice(k).get_shape()
        ]
    if not keys or empty:
        what = "no tensors" if not keys else f"{len(empty)} empty tensors (e.g. {empty[0]})"
        raise LmstackError(
            f"saving the adapter failed: {path} holds {what}; the trained weights were not gathered. "
            "Under FSDP use `deepspeed: examples/deepspeed/ds_z3_config.json` (ZeRO-3 LoRA saves are "
            "verified) or plain DDP for LoRA, and report this with `lmstack env`"
        )
    return len(keys)


def write_adapter(model: Any, tensors: dict[str, Any], output_dir: str) -> int:
    """adapter_model.safetensors + adapter_config.json from {model key: tensor} of the active adapter.

    PEFT's own save selects the adapter entries by walking model.named_modules(); under FSDP1 those names
    carry `_fsdp_wrapped_module.` and nothing matches -- the empty adapter of 2026-11-29 (reproduced
    with FSDP on CPU, tests/integration/test_fsdp_adapter.py). Here the keys are the trainable
    parameters themselves, renamed the way PEFT renames them on save (adapter name removed)."""
    import copy

    from safetensors.torch import save_file

    adapter, rename = adapter_renamer(model)
    config = model.peft_config[adapter]
    state = {rename(key, adapter): t.contiguous() for key, t in tensors.items()}
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    save_file(state, str(Path(output_dir) / ADAPTER_FILE), metadata={"format": "pt"})
    saved = copy.deepcopy(config)
    saved.inference_mode = True
    saved.save_pretrained(output_dir)
    return len(state)


def _is_dtensor(param: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return False
    return isinstance(param, DTensor)


def _fsdp2(model: Any) -> bool:
    """FSDP2 (fully_shard) keeps parameters as DTensors and wraps no module; FSDP1 flattens them."""
    return any(_is_dtensor(p) for p in model.parameters())


def save_fsdp_adapter(trainer: Any, output_dir: str) -> None:
    """All ranks: gather the trainable tensors (FSDP1: summon_full_params, rank 0 only; FSDP2: each
    DTensor's full_tensor(), a collective) and rank 0 writes the adapter from them."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = trainer.accelerator.unwrap_model(trainer.model)  # the PeftModel (its layers FSDP units)
    if _fsdp2(model):
        tensors = trainable_tensors(model.named_parameters())  # every rank: the gathers are collectives
        if trainer.is_world_process_zero():
            write_adapter(model, tensors, output_dir)
        barrier()
        return
    from torch.distributed.fsdp import ShardingStrategy

    # the gathered copy goes to CPU RAM, except where FSDP refuses it: one process (FSDP turns FULL_SHARD
    # into NO_SHARD) or NO_SHARD -- "offload_to_cpu=True and NO_SHARD is not supported" on 1 x H200
    wrapped = trainer.model_wrapped
    sharded = world_size() > 1 and getattr(wrapped, "sharding_strategy", None) != ShardingStrategy.NO_SHARD
    offload = sharded and next(wrapped.parameters()).device.type != "cpu"
    with FSDP.summon_full_params(wrapped, writeback=False, rank0_only=True, offload_to_cpu=offload):
        if trainer.is_world_process_zero():
            write_adapter(model, trainable_tensors(model.named_parameters()), output_dir)
    barrier()


def load_fsdp_adapter(trainer: Any, folder: str | Path) -> int:
    """All ranks: copy folder/adapter_model.safetensors into the FSDP-sharded model's trainable tensors
    (FSDP1: full parameters summoned with writeback, so every shard gets its part; FSDP2: each DTensor
    takes its shard of the saved tensor). A file that does not hold exactly the model's adapter
    tensors is an error naming the first mismatch."""
    import contextlib

    import torch
    from safetensors.torch import load_file
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    path = Path(folder) / ADAPTER_FILE
    saved = load_file(str(path))
    model = trainer.accelerator.unwrap_model(trainer.model)
    adapter, rename = adapter_renamer(model)
    fsdp2 = _fsdp2(model)
    full = (
        contextlib.nullcontext() if fsdp2 else FSDP.summon_full_params(trainer.model_wrapped, writeback=True)
    )
    with full:
        params = {rename(clean_name(n), adapter): p for n, p in model.named_parameters() if p.requires_grad}
        missing = sorted(set(params) - set(saved))
        extra = sorted(set(saved) - set(params))
        wrong = [k for k in params if k in saved and saved[k].shape != params[k].shape]
        if missing or extra or wrong:
            what = (
                f"{len(missing)} adapter tensors missing (e.g. {missing[0]})" if missing
                else f"{len(extra)} tensors the model has no parameter for (e.g. {extra[0]})" if extra
                else f"{wrong[0]} has shape {tuple(saved[wrong[0]].shape)}, the model {tuple(params[wrong[0]].shape)}"
            )  # fmt: skip
            raise LmstackError(
                f"resume_from_checkpoint: {path} does not match this model's adapter: {what}. Resume with "
                "the LoRA settings (lora_rank, lora_target, ...) the checkpoint was trained with"
            )
        with torch.no_grad():
            for key, param in params.items():
                value = saved[key].to(device=param.device, dtype=param.dtype)
                if _is_dtensor(param):
                    from torch.distributed.tensor import distribute_tensor

                    value = distribute_tensor(value, param.device_mesh, param.placements)
                param.copy_(value)
    return len(params)


def is_fsdp_peft(trainer: Any) -> bool:
    return bool(getattr(trainer, "is_fsdp_enabled", False)) and is_peft(
        trainer.accelerator.unwrap_model(trainer.model)
    )


def _umask() -> int:
    """This process's umask, read without setting it where the OS says it (Linux: /proc)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(folder: str | Path) -> list[Path]:
    """Weight files in `folder` (and its subfolders) get the mode the umask gives any new file: safetensors
    (0.8) writes them through a private temporary file, 0600, so a model saved for a team was readable by
    its owner alone. Only *.safetensors with mode 0600 are changed (lmstack's secret-holding YAMLs stay
    0600). Returns the files changed."""
    mode = 0o666 & ~_umask()
    changed = []
    for path in Path(folder).rglob("*.safetensors"):
        if path.is_file() and not path.is_symlink() and path.stat().st_mode & 0o777 == 0o600 != mode:
            path.chmod(mode)
            changed.append(path)
    return changed


def save_model(trainer: Any) -> None:
    """trainer.save_model(), with the FSDP adapter path and a check of what was written."""
    output_dir = trainer.args.output_dir
    peft = is_peft(trainer.accelerator.unwrap_model(trainer.model))
    if is_fsdp_peft(trainer):
        save_fsdp_adapter(trainer, output_dir)
        if trainer.is_world_process_zero():
            trainer.processing_class.save_pretrained(output_dir)
    else:
        trainer.save_model()
    if trainer.is_world_process_zero():
        follow_umask(output_dir)
    if peft and trainer.is_world_process_zero():
        count = check_adapter_file(output_dir)
        logger.info("adapter saved: %d tensors in %s", count, Path(output_dir) / ADAPTER_FILE)


PICKLED_ADAPTER = "adapter_model.bin"


def check_adapter_files(adapters: str | None) -> None:
    """A local adapter saved only as a pickle (`adapter_model.bin`) must hold plain tensors: PEFT
    reads it with torch.load(weights_only=True), which refuses anything else after the model loaded.
    Read here the same way, before anything loads, so the refusal says what to do."""
    import pickle

    import torch

    for name in [a.strip() for a in (adapters or "").split(",") if a.strip()]:
        folder = Path(name)
        pickled = folder / PICKLED_ADAPTER
        if (folder / ADAPTER_FILE).is_file() or not pickled.is_file():
            continue
        try:
            torch.load(pickled, map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError):
            raise ConfigError(
                f"adapter_name_or_path: {pickled} holds pickled objects that are not plain tensors "
                f"(torch.load with weights_only=True refuses it); lmstack loads adapters as {ADAPTER_FILE} "
                'and never unpickles code. Convert it where you trust the file: python -c "import torch; '
                "from safetensors.torch import save_file; sd = torch.load("
                f"'{pickled}', weights_only=False); save_file({{k: v.contiguous() for k, v in sd.items() "
                f"if isinstance(v, torch.Tensor)}}, '{folder / ADAPTER_FILE}')\""
            ) from None
