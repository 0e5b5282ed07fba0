"""Offloaded activation checkpointing (LF's `use_unsloth_gc`): every decoder layer is recomputed in the
backward (torch.utils.checkpoint) and the one tensor each checkpoint keeps -- the layer's input hidden
state -- waits in CPU RAM instead of GPU memory.

How: the checkpoint call runs inside a `saved_tensors_hooks(pack, unpack)` context. A checkpoint saves
only its inputs at that level (non-reentrant: through its input saver, before it pushes its own hook for
the layer body; reentrant: `save_for_backward` of the tensor arguments, the body runs without grad), so
the pack hook sees the layer inputs and nothing else. On a GPU, pack copies the tensor into pinned CPU
memory on a side stream (the compute stream goes on); unpack, when the layer's backward needs it, takes
the copy that the previous unpack started on the side stream (the prefetch of the layer below) and starts
the next one. On CPU both are plain copies (the tests run there).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch


class _Parked:
    """One layer input in CPU memory, and (once prefetched) its way back to the device."""

    def __init__(self, cpu: torch.Tensor, device: torch.device, ready: Any, below: _Parked | None):
        self.cpu = cpu
        self.device = device
        self.ready = ready  # CUDA event: the device-to-host copy is done (None on CPU)
        self.below = weakref.ref(below) if below is not None else None  # the layer packed before this one
        self.back: torch.Tensor | None = None  # prefetched device copy
        self.back_ready: Any = None
        self.used = False  # unpacked once (its backward ran; a retained graph may unpack it again)


class ActivationOffloader:
    """The pack/unpack pair of one model's offloaded checkpoints (one side stream on CUDA)."""

    def __init__(self) -> None:
        self.stream: Any = None
        self.last: _Parked | None = None
        self.packed = 0  # tensors parked so far (a counter for logs and tests)
        self.packed_bytes = 0

    def _side_stream(self) -> Any:
        if self.stream is None:
            self.stream = torch.cuda.Stream()
        return self.stream

    def pack(self, tensor: torch.Tensor) -> _Parked:
        self.packed += 1
        self.packed_bytes += tensor.numel() * tensor.element_size()
        below = self.last if self.last is not None and not self.last.used else None
        if tensor.device.type != "cuda":
            parked = _Parked(tensor.detach().clone(), tensor.device, None, below)
        else:
            stream = self._side_stream()
            stream.wait_stream(torch.cuda.current_stream(tensor.device))
            cpu = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            with torch.cuda.stream(stream):
                cpu.copy_(tensor.detach(), non_blocking=True)
                tensor.record_stream(stream)  # the caching allocator keeps it until the copy is done
                ready = torch.cuda.Event()
                ready.record(stream)
            parked = _Parked(cpu, tensor.device, ready, below)
        self.last = parked
        return parked

    def _prefetch(self, parked: _Parked) -> None:
        if parked.back is not None:
            return
        if parked.ready is None:
            parked.back = parked.cpu.to(parked.device)
            return
        stream = self._side_stream()
        with torch.cuda.stream(stream):
            stream.wait_event(parked.ready)
            parked.back = parked.cpu.to(parked.device, non_blocking=True)
            parked.back_ready = torch.cuda.Event()
            parked.back_ready.record(stream)

    def unpack(self, parked: _Parked) -> torch.Tensor:
        self._prefetch(parked)  # a no-op when the layer above already started it
        tensor = parked.back
        if parked.back_ready is not None:
            current = torch.cuda.current_stream(parked.device)
            current.wait_event(parked.back_ready)
            tensor.record_stream(current)
        below = parked.below() if parked.below is not None else None
        if below is not None and not below.used:
            self._prefetch(below)  # overlaps the layer below's copy with this layer's backward
        parked.back, parked.back_ready, parked.used = None, None, True  # the CPU copy lives with the graph
        return tensor


def offloaded_checkpoint(offloader: ActivationOffloader, checkpoint_kwargs: dict) -> Callable:
    """A drop-in for transformers' `_gradient_checkpointing_func`: torch.utils.checkpoint with its saved
    inputs parked by `offloader`."""
    from torch.utils.checkpoint import checkpoint

    def run(function: Callable, *args: Any, **kwargs: Any) -> Any:
        with torch.autograd.graph.saved_tensors_hooks(offloader.pack, offloader.unpack):
            return checkpoint(function, *args, **checkpoint_kwargs, **kwargs)

    run = functools.wraps(checkpoint)(run)
    run.offloader = offloader  # type: ignore[attr-defined]  (its counters, for logs and tests)
    return run


def enable_offloaded_checkpointing(model: Any, checkpoint_kwargs: dict) -> ActivationOffloader:
    """Turn on per-layer checkpointing with offloaded inputs on every GradientCheckpointingLayer of
    `model` (a transformers model, PEFT-wrapped or not). Returns the offloader (its counters)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    offloader = ActivationOffloader()
    func = offloaded_checkpoint(offloader, checkpoint_kwargs)
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise ValueError(
            f"use_unsloth_gc: {type(model).__name__} has no checkpointable decoder layers "
            "(transformers' GradientCheckpointingLayer); remove use_unsloth_gc"
        )
    for layer in layers:
        layer.gradient_checkpointing = True
        layer._gradient_checkpointing_func = func
    return offloader
