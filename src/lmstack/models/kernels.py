"""Training kernels: a fused linear cross-entropy so the [tokens x vocab] logits are never materialised.

With `enable_liger_kernel: true` and liger-kernel installed, models/load.py applies Liger's kernels
(fused linear CE, RMSNorm, SwiGLU, RoPE). Everywhere else lmstack's own chunked linear CE replaces
the model's training forward: the decoder runs as usual, positions whose label is -100
are dropped before the head, and the head + CE run chunk by chunk with the gradients computed in the
same pass (custom autograd function), so the peak is one chunk of logits, not all of them. Eval and
generation keep the model's own forward (logits returned).
"""

from __future__ import annotations

import functools
import logging
import types
from typing import Any

logger = logging.getLogger(__name__)
IGNORE_INDEX = -100
# rows per chunk: the tensors here peak at ~6 B x chunk x vocab (bf16 product + fp32 copy, then fp32 grad
# + bf16 copy) = 1.7 GiB for Qwen's 152K vocab; the H200 measured ~9 B; plan/memory.py models it (LMSTACK_CE_*)
DEFAULT_CHUNK = 2048


def _chunked_ce_function():
    import torch

    class ChunkedLinearCrossEntropy(torch.autograd.Function):
        """sum_i CE(hidden_i @ weight.T, target_i) / denom over rows whose target is valid."""

        @staticmethod
        def forward(ctx, hidden, weight, targets, denom, chunk_size, compute_dtype):
            h = hidden if compute_dtype is None else hidden.to(compute_dtype)
            w = weight if compute_dtype is None else weight.to(compute_dtype)
            need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
            grad_h = torch.empty_like(h) if need_h else None
            acc = torch.promote_types(h.dtype, torch.float32)  # fp32 softmax/accumulation (fp64 stays fp64)
            grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
            total = torch.zeros((), dtype=acc, device=hidden.device)
            for start in range(0, h.shape[0], chunk_size):
                hc, tc = h[start : start + chunk_size], targets[start : start + chunk_size, None]
                logits = (hc @ w.t()).to(acc)
                target = logits.gather(1, tc)
                # logsumexp in place: torch.logsumexp allocates two more chunk-sized temporaries
                top = logits.amax(dim=-1, keepdim=True)
                logits.sub_(top).exp_()
                norm = logits.sum(dim=-1, keepdim=True)
                total += (top + norm.log() - target).sum()
                if need_h or need_w:  # d loss / d logits = softmax - onehot, scaled by 1/denom
                    logits.div_(norm)
                    logits.scatter_add_(1, tc, torch.full_like(tc, -1, dtype=logits.dtype))
                    logits.div_(denom)
                    g = logits.to(h.dtype)
                    if need_h:
                        grad_h[start : start + chunk_size] = g @ w
                    if need_w:
                        grad_w += (g.t() @ hc).to(acc)
                    del g
                del logits  # free this chunk before the next one is computed (else two chunks are alive)
            ctx.save_for_backward(
                grad_h.to(hidden.dtype) if need_h else None,
                grad_w.to(weight.dtype) if need_w else None,
            )
            return total / denom

        @staticmethod
        def backward(ctx, grad_out):
            grad_h, grad_w = ctx.saved_tensors
            return (
                None if grad_h is None else grad_h * grad_out.to(grad_h.dtype),
                None if grad_w is None else grad_w * grad_out.to(grad_w.dtype),
                None,
                None,
                None,
                None,
            )

    return ChunkedLinearCrossEntropy


_FUNCTION = None


def linear_cross_entropy(
    hidden: Any,
    weight: Any,
    shift_labels: Any,
    num_items_in_batch: Any = None,
    chunk_size: int = DEFAULT_CHUNK,
) -> Any:
    """Equals `cross_entropy(hidden @ weight.T, shift_labels, ignore_index=-100)` — mean over valid
    labels, or their sum / num_items_in_batch when given (the Trainer's gradient-accumulation rule) —
    without materialising the logits. `shift_labels[..., i]` is the target of `hidden[..., i, :]`."""
    import torch

    global _FUNCTION
    if _FUNCTION is None:
        _FUNCTION = _chunked_ce_function()
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_t = shift_labels.reshape(-1).to(flat_h.device)
    keep = flat_t != IGNORE_INDEX
    idx = keep.nonzero().squeeze(1)
    if num_items_in_batch is None:
        denom = keep.sum().clamp(min=1)
    else:
        denom = torch.as_tensor(num_items_in_batch, device=flat_h.device)
    denom = denom.to(torch.promote_types(flat_h.dtype, torch.float32))
    compute_dtype = None
    if torch.is_autocast_enabled(flat_h.device.type):
        compute_dtype = torch.get_autocast_dtype(flat_h.device.type)
    with torch.autocast(flat_h.device.type, enabled=False):
        return _FUNCTION.apply(
            flat_h.index_select(0, idx), weight, flat_t.index_select(0, idx), denom, chunk_size, compute_dtype
        )


def _fused_forward(self, input_ids=None, labels=None, **kwargs):
    """Training forward with the chunked linear CE; anything else goes to the model's own forward."""
    import torch
    import torch.nn.functional as F
    from transformers.modeling_outputs import CausalLMOutputWithPast

    shift_labels = kwargs.pop("shift_labels", None)
    if (labels is None and shift_labels is None) or not self.training or not torch.is_grad_enabled():
        if shift_labels is not None:
            kwargs["shift_labels"] = shift_labels
        return self._lmstack_forward(input_ids=input_ids, labels=labels, **kwargs)
    num_items = kwargs.pop("num_items_in_batch", None)
    kwargs.pop("logits_to_keep", None)
    kwargs.pop("return_dict", None)
    decoder = getattr(self, self.base_model_prefix)
    outputs = decoder(input_ids=input_ids, **kwargs)
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    loss = linear_cross_entropy(
        outputs.last_hidden_state, self.get_output_embeddings().weight, shift_labels, num_items
    )
    cache = _cache_field()  # the KV cache under this transformers' name, read without the alias's warning
    return CausalLMOutputWithPast(
        loss=loss,
        logits=None,
        hidden_states=getattr(outputs, "hidden_states", None),
        attentions=getattr(outputs, "attentions", None),
        **{cache: getattr(outputs, cache, None)},
    )


@functools.cache
def _cache_field() -> str:
    """`cache` on transformers >= 5.2x (where `past_key_values` is a deprecated alias that warns), else
    `past_key_values`."""
    import dataclasses

    from transformers.modeling_outputs import CausalLMOutputWithPast

    names = {f.name for f in dataclasses.fields(CausalLMOutputWithPast)}
    return "cache" if "cache" in names else "past_key_values"


def fused_ce_unsupported(model: Any) -> str | None:
    """Why the chunked CE cannot replace this model's forward (None = it can)."""
    import torch

    head = model.get_output_embeddings()
    config = model.config
    if type(head) is not torch.nn.Linear or head.bias is not None:
        return f"the output head is {type(head).__name__}, not a plain bias-free Linear"
    for attr in ("final_logit_softcapping", "logit_scale", "output_multiplier_scale"):
        if getattr(config, attr, None) not in (None, 1, 1.0):
            return f"the model scales its logits ({attr})"
    if not hasattr(model, getattr(model, "base_model_prefix", "") or "\0"):
        return "the decoder stack is not reachable through base_model_prefix"
    return None


def apply_fused_ce(model: Any) -> bool:
    """Replace the instance's forward (training only) with the chunked linear CE. True if applied."""
    reason = fused_ce_unsupported(model)
    if reason:
        logger.warning("fused cross-entropy: not applied (%s); logits are materialised", reason)
        return False
    if not hasattr(model, "_lmstack_forward"):
        model._lmstack_forward = model.forward
        model.forward = types.MethodType(_fused_forward, model)
    return True


def liger_forward_applied(model: Any) -> bool:
    """True when Liger's fused linear CE forward is patched onto the instance (models/load.py does
    that for `enable_liger_kernel: true`)."""
    func = getattr(model.forward, "__func__", model.forward)
    return getattr(func, "__module__", "").startswith("liger_kernel")


def apply_training_kernels(loss_kernel: str, model: Any) -> str:
    """Apply the run plan's training loss: "liger" (models/load.py patched Liger's fused linear CE in),
    "chunked" (lmstack's chunked linear CE replaces the training forward) or "none" (the model's own
    loss). Returns what is in effect: a model whose head cannot take the chunked CE keeps its own loss,
    with a warning."""
    if loss_kernel == "liger":
        if not liger_forward_applied(model):
            raise RuntimeError("the run plan chose Liger's fused CE, but the model's forward is not Liger's")
        return "liger"
    if loss_kernel == "chunked":
        if apply_fused_ce(model):
            logger.info("fused cross-entropy: lmstack's chunked linear CE (no [tokens x vocab] logits)")
            return "chunked"
        return "none"
    return "none"


def cast_adapters_to_base_dtype(model: Any) -> int:
    """LoRA A/B (and other trainable adapter params) to bf16 when the frozen base is bf16.
    PEFT's default keeps them in fp32 (autocast_adapter_dtype), which made LoRA slower than full
    fine-tuning on small models (bf16 adapters measured 1.38-1.55x faster on an H200). Returns params cast."""
    import torch

    base = {p.dtype for p in model.parameters() if not p.requires_grad and p.is_floating_point()}
    if base != {torch.bfloat16}:  # fp16 stays fp32: the fp16 GradScaler refuses fp16 gradients
        return 0
    dtype = torch.bfloat16
    count = 0
    for p in model.parameters():
        if p.requires_grad and p.dtype == torch.float32:
            p.data = p.data.to(dtype)
            count += 1
    return count
