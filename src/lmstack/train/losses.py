"""Token losses of stage sft that reweight the cross-entropy (LLaMA-Factory's `use_dft_loss`,
`use_eaft_loss`, `use_asft_loss`). They need the [tokens x vocab] logits, so the run plan turns the
fused/chunked CE off for them (plan/decide.py `loss_kernel`).

Per target token t with model distribution p (labels shifted for a causal LM, -100 ignored):
- DFT:  CE_t * p(t), the probability detached (confident tokens weigh more, as in DFT).
- EAFT: CE_t * (H_20 / 3) ** eaft_alpha, H_20 the entropy of the softmax over the 20 largest logits
  (detached): tokens the model is unsure about weigh more.
- ASFT: DFT_t + asft_alpha * KL(q || p), q the reference model's distribution at that position.

The sum over the batch's target tokens is divided by the Trainer's `num_items_in_batch` (the target
tokens of the whole accumulated batch), so gradient accumulation and several processes give the same
objective; on one micro-batch of one process that is the mean over its target tokens, LLaMA-Factory's
value. `compute_loss_func(cfg)` is what `Trainer(compute_loss_func=...)` takes; ASFT also needs the
reference logits of the same batch, which `ReferenceLogitsMixin` computes before each loss.
"""

from __future__ import annotations

import logging
from typing import Any

from lmstack.config.schema import Config

logger = logging.getLogger(__name__)
IGNORE_INDEX = -100
LOSS_FIELDS = ("use_dft_loss", "use_eaft_loss", "use_asft_loss")
EAFT_TOP_K = 20
EAFT_SCALE = 3.0  # LLaMA-Factory divides the top-20 entropy by 3 (close to ln 20 = 3.0)


def active_loss(cfg: Config) -> str | None:
    """The field of the custom token loss switched on (the rules allow at most one), or None."""
    on = [name for name in LOSS_FIELDS if getattr(cfg.finetuning, name)]
    return on[0] if on else None


def _flat_targets(logits: Any, labels: Any) -> tuple[Any, Any, Any]:
    """(logits of the target positions [n, vocab] in fp32, their targets [n], the valid mask of all
    shifted positions): position i predicts labels[i + 1]."""
    import torch

    targets = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1)
    targets = targets.to(logits.device)
    flat = logits.float().reshape(-1, logits.shape[-1])
    valid = targets != IGNORE_INDEX
    return flat[valid], targets[valid], valid


def _reduce(per_token: Any, num_items_in_batch: Any, anchor: Any) -> Any:
    import torch

    if per_token.numel() == 0:
        return anchor.sum() * 0.0  # no target token: a zero that keeps the graph
    if num_items_in_batch is None:
        return per_token.mean()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(per_token.device)
    return per_token.sum() / num_items_in_batch


def dft_token_losses(logits: Any, targets: Any) -> Any:
    import torch

    ce = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
    return ce * torch.exp(-ce).detach()


def eaft_token_losses(logits: Any, targets: Any, alpha: float) -> Any:
    import torch

    ce = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
    with torch.no_grad():
        top = torch.topk(logits.detach(), k=min(EAFT_TOP_K, logits.shape[-1]), dim=-1).values
        log_p = top - torch.logsumexp(top, dim=-1, keepdim=True)
        entropy = -(log_p.exp() * log_p).sum(dim=-1)
        weight = torch.pow(entropy / EAFT_SCALE, alpha)
    return ce * weight


def kl_token_losses(logits: Any, ref_logits: Any) -> Any:
    """KL(q || p) per row, q = softmax(ref_logits) (no gradient), p = softmax(logits)."""
    import torch

    log_p = torch.log_softmax(logits, dim=-1)
    log_q = torch.log_softmax(ref_logits.float(), dim=-1).detach()
    return (log_q.exp() * (log_q - log_p)).sum(dim=-1)


def dft_loss(logits: Any, labels: Any, num_items_in_batch: Any = None) -> Any:
    flat, targets, _ = _flat_targets(logits, labels)
    return _reduce(dft_token_losses(flat, targets), num_items_in_batch, logits)


def eaft_loss(logits: Any, labels: Any, num_items_in_batch: Any = None, alpha: float = 1.0) -> Any:
    flat, targets, _ = _flat_targets(logits, labels)
    return _reduce(eaft_token_losses(flat, targets, alpha), num_items_in_batch, logits)


def asft_loss(
    logits: Any, labels: Any, ref_logits: Any, num_items_in_batch: Any = None, alpha: float = 0.1
) -> Any:
    flat, targets, valid = _flat_targets(logits, labels)
    ref = ref_logits.reshape(-1, ref_logits.shape[-1]).to(flat.device)[valid]
    per_token = dft_token_losses(flat, targets) + alpha * kl_token_losses(flat, ref)
    return _reduce(per_token, num_items_in_batch, logits)


class AsftLoss:
    """ASFT as a compute_loss_func: `ref_logits` is set for the batch by `ReferenceLogitsMixin`."""

    def __init__(self, alpha: float):
        self.alpha = alpha
        self.ref_logits: Any = None

    def __call__(self, outputs: Any, labels: Any, num_items_in_batch: Any = None) -> Any:
        if self.ref_logits is None:
            raise RuntimeError("use_asft_loss: no reference logits for this batch (ReferenceLogitsMixin)")
        ref, self.ref_logits = self.ref_logits, None
        return asft_loss(outputs.logits, labels, ref, num_items_in_batch, self.alpha)


def compute_loss_func(cfg: Config) -> Any:
    """The Trainer's compute_loss_func for the config's custom loss (None: the model's own CE)."""
    name = active_loss(cfg)
    ft = cfg.finetuning
    if name is None:
        return None
    logger.info("loss: %s", {"use_dft_loss": "DFT", "use_eaft_loss": "EAFT", "use_asft_loss": "ASFT"}[name])
    if name == "use_dft_loss":
        return lambda outputs, labels, num_items_in_batch=None: dft_loss(
            outputs.logits, labels, num_items_in_batch
        )
    if name == "use_eaft_loss":
        return lambda outputs, labels, num_items_in_batch=None: eaft_loss(
            outputs.logits, labels, num_items_in_batch, ft.eaft_alpha
        )
    return AsftLoss(ft.asft_alpha)


REFERENCE_INPUTS = ("input_ids", "attention_mask", "position_ids")


class ReferenceLogitsMixin:
    """Mixed in before a Trainer: with `lm_asft` set, the reference logits of each batch are computed
    before its loss (ASFT). `lm_reference`: a frozen model, or None for the trained PEFT model with its
    adapter disabled."""

    lm_asft = False
    lm_reference: Any = None

    def compute_loss(self, model: Any, inputs: dict, *args: Any, **kwargs: Any) -> Any:
        if self.lm_asft:
            batch = {k: v for k, v in inputs.items() if k in REFERENCE_INPUTS}
            self.compute_loss_func.ref_logits = self._lm_reference_logits(model, batch)
        return super().compute_loss(model, inputs, *args, **kwargs)

    def _lm_reference_logits(self, model: Any, batch: dict) -> Any:
        import torch

        reference = self.lm_reference
        if reference is not None:
            reference.to(self.args.device)
            with torch.no_grad():
                return reference(**batch).logits
        unwrapped = self.accelerator.unwrap_model(model)
        was_training = unwrapped.training
        unwrapped.eval()  # like a frozen reference: no dropout
        try:
            with torch.no_grad(), unwrapped.disable_adapter():
                return unwrapped(**batch).logits
        finally:
            unwrapped.train(was_training)


def asft_reference(plan: Any, tokenizer: Any) -> Any:
    """ASFT's reference: `ref_model` if set; a LoRA/OFT run without it uses the base with the adapter
    disabled (None, no copy); full/freeze a frozen copy of the starting model."""
    cfg = plan.cfg
    ft = cfg.finetuning
    if ft.ref_model:
        logger.info("ASFT reference model: %s", ft.ref_model)
        return _frozen_model(plan, ft.ref_model, ft.ref_model_adapters, tokenizer)
    if ft.finetuning_type in ("lora", "oft"):
        logger.info("ASFT reference model: the base model with the adapter disabled (no copy)")
        return None
    logger.info("ASFT reference model: a frozen copy of %s", cfg.model.model_name_or_path)
    return _frozen_model(plan, cfg.model.model_name_or_path, cfg.model.adapter_name_or_path, tokenizer)


def _frozen_model(plan: Any, path: str, adapters: str | None, tokenizer: Any) -> Any:
    """A causal LM from `path` loaded like the trained one, `adapters` (comma list) merged, frozen."""
    from lmstack.models.load import load_model

    model = load_model(plan.model_spec(path), tokenizer)
    for adapter in [a.strip() for a in (adapters or "").split(",") if a.strip()]:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    model.eval()
    model.requires_grad_(False)
    return model
