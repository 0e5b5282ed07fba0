"""Shared fixtures: the built-in tiny model (built once per session, offline) and an isolated cache."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DATA_DIR = REPO / "data"


def pytest_configure(config):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory):
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from lmstack.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", data_dir=DATA_DIR)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture
def base_cfg(tiny_model, tmp_path) -> dict:
    """A small, fast LoRA SFT config on the tiny model (flat LF field names)."""
    return {
        "model_name_or_path": str(tiny_model),
        "template": "qwen",
        "stage": "sft",
        "do_train": True,
        "finetuning_type": "lora",
        "lora_target": "all",
        "dataset": "alpaca_en_demo",
        "dataset_dir": str(DATA_DIR),
        "cutoff_len": 128,
        "output_dir": str(tmp_path / "out"),
        "per_device_train_batch_size": 4,
        "learning_rate": 1e-2,
        "max_steps": 4,
        "logging_steps": 1,
        "save_steps": 100,
        "report_to": "none",
        "disable_tqdm": True,
        "seed": 0,
    }


class LiveBytes:
    """Peak bytes of the tensors the ops inside `with tracker.mode:` allocate (a TorchDispatchMode that sees
    every op's outputs, a weakref finaliser each storage's release): an allocation-level view that holds on
    any device, since it counts what the ops allocate, not what an allocator caches. `model`: its parameters
    and buffers are not counted."""

    def __init__(self, model=None):
        import weakref

        from torch.utils._python_dispatch import TorchDispatchMode

        tracker, self.live, self.peak = self, 0, 0
        self.owners: dict[int, int] = {}
        held = [*model.parameters(), *model.buffers()] if model is not None else []
        self.skip = {t.untyped_storage().data_ptr() for t in held}

        def free(ptr: int) -> None:
            tracker.live -= tracker.owners.pop(ptr, 0)

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                import torch

                out = func(*args, **(kwargs or {}))
                for t in out if isinstance(out, tuple | list) else [out]:
                    if not isinstance(t, torch.Tensor):
                        continue
                    storage = t.untyped_storage()
                    ptr, size = storage.data_ptr(), storage.nbytes()
                    if size and ptr not in tracker.owners and ptr not in tracker.skip:
                        tracker.owners[ptr] = size
                        tracker.live += size
                        tracker.peak = max(tracker.peak, tracker.live)
                        weakref.finalize(storage, free, ptr)
                return out

        self.mode = Mode()


@pytest.fixture
def live_bytes() -> type[LiveBytes]:
    """The allocation tracker class: `tracker = live_bytes(model)`, `with tracker.mode: ...`, `tracker.peak`."""
    return LiveBytes
