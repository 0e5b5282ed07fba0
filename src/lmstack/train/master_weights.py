"""bf16 weights in the model, fp32 master weights in the optimizer — the precision scheme DeepSpeed's
bf16 mode, FSDP's MixedPrecision and Megatron use — for full/freeze fine-tuning on one GPU or DDP.

Why: with classic AMP (fp32 weights in the model, autocast) the residual stream, norms and every
weight cast run in fp32/converted every micro-batch. On the H200 the 0.5B full-SFT profile spent 16%
of kernel time in copies/casts, and the fp32 residual stream made activations 1.3x the bf16 formula
(bench/results/speed.jsonl, plan_accuracy.json). Here the model computes in bf16 end to end while
the update is still applied to fp32 weights, so small updates are not rounded away.

`master_weights` (YAML): model (classic AMP) | optimizer (this module) | auto (optimizer where it
applies: CUDA, bf16, full/freeze, default AdamW, no DeepSpeed/FSDP/quantization/BAdam, one
micro-batch per step — bf16 gradients are not summed over micro-batches here).
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


def _optimizer_base() -> type:
    import torch

    return torch.optim.Optimizer


class Fp32MasterWeights(_optimizer_base()):  # type: ignore[misc]
    """Wraps the Trainer's optimizer: its param groups hold fp32 copies of the bf16 model weights.

    step(): bf16 grads -> fp32 master grads (transient), inner step on the masters, masters -> bf16
    model weights. Like accelerate's AcceleratedOptimizer it does not call Optimizer.__init__: the
    param groups and state are the inner optimizer's (the LR scheduler edits them in place).
    """

    def __init__(self, inner: Any):
        import torch

        self.inner = inner
        self.model_params: list[Any] = []
        self.masters: list[Any] = []
        for group in inner.param_groups:
            masters = []
            for p in group["params"]:
                master = p.detach().to(torch.float32, copy=True)
                self.model_params.append(p)
                self.masters.append(master)
                masters.append(master)
            group["params"] = masters

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict]) -> None:
        self.inner.param_groups = groups

    @property
    def state(self) -> Any:
        return self.inner.state

    @property
    def defaults(self) -> dict:
        return self.inner.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.model_params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def step(self, closure: Any = None) -> Any:
        import torch

        with torch.no_grad():
            live = [
                (p, m) for p, m in zip(self.model_params, self.masters, strict=True) if p.grad is not None
            ]
            for p, m in live:
                m.grad = p.grad.to(torch.float32)
            loss = self.inner.step(closure)
            for _, m in live:
                m.grad = None
            self._copy_to_model([p for p, _ in live], [m for _, m in live])
        return loss

    @staticmethod
    def _copy_to_model(params: list[Any], masters: list[Any]) -> None:
        import torch

        if not params:
            return
        try:
            torch._foreach_copy_(params, masters)  # one fused cast-copy per device/dtype bucket
        except (RuntimeError, AttributeError):
            for p, m in zip(params, masters, strict=True):
                p.copy_(m)

    def state_dict(self) -> dict:
        state = self.inner.state_dict()
        state["fp32_master_weights"] = list(self.masters)
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        import torch

        state = dict(state_dict)
        masters = state.pop("fp32_master_weights", None)
        self.inner.load_state_dict(state)
        if masters is None:  # a checkpoint from an AMP run: start the masters from the model weights
            return
        if len(masters) != len(self.masters):
            raise ValueError(
                f"optimizer state has {len(masters)} master weights, the model {len(self.masters)}"
            )
        with torch.no_grad():
            for m, saved in zip(self.masters, masters, strict=True):
                m.copy_(saved)
            self._copy_to_model(self.model_params, self.masters)

    def __repr__(self) -> str:
        return f"Fp32MasterWeights({self.inner!r})"


class MasterWeightsMixin:
    """Mixed in before a Trainer: with `lm_master_weights` set, the optimizer the Trainer builds (from
    `optim`) is wrapped so a bf16 model trains against fp32 masters."""

    lm_master_weights = False

    def create_optimizer(self, *args: Any, **kwargs: Any) -> Any:
        optimizer = super().create_optimizer(*args, **kwargs)
        if self.lm_master_weights and not isinstance(optimizer, Fp32MasterWeights):
            self.optimizer = optimizer = Fp32MasterWeights(optimizer)
            count = sum(m.numel() for m in optimizer.masters)
            logger.info(
                "master_weights: optimizer -> bf16 model, fp32 master copy of %.1fM params in the optimizer",
                count / 1e6,
            )
        return optimizer
