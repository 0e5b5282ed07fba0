"""Installed packages a process never uses, kept out of it: transformers and peft import torchao and
bitsandbytes whenever they are installed (seconds of start-up, and their load warnings on every command),
even on a run that uses neither. The run plan (or, for chat/api/export, plan/decide_host.py's
inference_kept_out) says which packages a process never reaches; this marks them absent."""

from __future__ import annotations

import sys

# what imports torchao/bitsandbytes when they are installed (or caches whether they are): once one of
# these is loaded, keeping the packages out could break it, so nothing is kept out
_IMPORTERS = ("transformers", "peft", "accelerate", "trl", "liger_kernel", "unsloth", "deepspeed")


def keep_out(packages: tuple[str, ...]) -> list[str]:
    """Marks `packages` absent in this process, before transformers or peft is imported: their
    availability checks (`importlib.util.find_spec`) then see no package and skip importing it. Only for
    a process that is one command's alone (the mark lasts as long as the process); nothing once one of
    _IMPORTERS is loaded. Returns the packages kept out."""
    if not packages or any(name in sys.modules for name in _IMPORTERS):
        return []
    kept = [name for name in packages if name not in sys.modules]
    for name in kept:
        sys.modules[name] = None  # type: ignore[assignment]  # Python's mark for "import fails here"
    return kept
