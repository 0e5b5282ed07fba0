"""Evaluation metrics of the causal-LM stages (sft, pt): `compute_accuracy` -> `eval_accuracy`.

Token accuracy as LLaMA-Factory reports it: the model's argmax at position t is compared with the label
at t + 1 (the causal shift) on the trained positions only (label != -100); each evaluated row is
averaged on its own, then the rows are averaged. A row with no trained token is left out (LF would
average an empty row to NaN). With packing a row holds several samples; packing already masks the first
label of each sample, so no sample is scored on a prediction made from the previous one.

Memory: `preprocess_logits_for_metrics` reduces each eval batch's [batch x tokens x vocab] logits to
[batch x tokens] int32 ids at once, so the Trainer only ever keeps the ids, never the logits.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)
IGNORE_INDEX = -100


def argmax_ids(logits: Any, labels: Any) -> Any:
    """`preprocess_logits_for_metrics`: the most likely next token at every position, as int32 ids.

    `logits` is the model output the Trainer kept: the [B, T, V] tensor, or a tuple holding it (MoE
    models put their aux loss, a 0-d tensor, before it)."""
    import torch

    if isinstance(logits, tuple | list):
        found = [x for x in logits if hasattr(x, "dim") and x.dim() == 3]
        if not found:
            raise ValueError(
                "compute_accuracy: the model returned no [batch x tokens x vocab] logits at evaluation "
                f"(got {[getattr(x, 'shape', type(x).__name__) for x in logits]})"
            )
        logits = found[0]
    if logits.dim() != 3:
        raise ValueError(
            "compute_accuracy: expected [batch x tokens x vocab] logits at evaluation, "
            f"got shape {tuple(logits.shape)}"
        )
    return logits.argmax(dim=-1).to(torch.int32)  # half the memory of int64; any vocab fits


def row_accuracies(preds: Any, labels: Any) -> list[float]:
    """Per row: the fraction of trained positions (label != -100) where pred[t] == label[t + 1].
    Rows without a trained position are skipped. `preds`, `labels`: [rows, tokens] arrays or tensors."""
    import numpy as np

    preds, labels = _numpy(preds), _numpy(labels)
    if preds.shape != labels.shape:
        raise ValueError(f"compute_accuracy: predictions {preds.shape} and labels {labels.shape} differ")
    pred, target = preds[:, :-1], labels[:, 1:]  # the prediction at t is scored against the label at t + 1
    trained = target != IGNORE_INDEX
    counts = trained.sum(axis=1)
    hits = ((pred == target) & trained).sum(axis=1)
    keep = counts > 0
    return (hits[keep] / counts[keep]).astype(np.float64).tolist()


def _numpy(x: Any) -> Any:
    import numpy as np

    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.asarray(x)


class TokenAccuracy:
    """`compute_metrics` for the Trainer: {"accuracy": mean of the row accuracies}; the Trainer adds the
    `eval_` prefix. Works with whole-set evaluation and with `batch_eval_metrics` (rows collected over
    the batches until `compute_result`)."""

    def __init__(self) -> None:
        self.scores: list[float] = []

    def __call__(self, eval_pred: Any, compute_result: bool = True) -> dict[str, float] | None:
        self.scores += row_accuracies(eval_pred.predictions, eval_pred.label_ids)
        if not compute_result:
            return None
        scores, self.scores = self.scores, []
        return {"accuracy": sum(scores) / len(scores) if scores else 0.0}


def accuracy_trainer_kwargs(compute_accuracy: bool) -> dict[str, Any]:
    """The Trainer keyword arguments that make evaluation report `eval_accuracy` (none when off)."""
    if not compute_accuracy:
        return {}
    return {"compute_metrics": TokenAccuracy(), "preprocess_logits_for_metrics": argmax_ids}


def warn_compute_accuracy(compute_accuracy: bool, has_eval_data: bool, evaluates: bool) -> str | None:
    """Logs (and returns) why `compute_accuracy: true` has no effect on this run; None when it has one.
    A stage that reports no token accuracy is refused by plan/rules.accuracy_stage."""
    note = _no_effect(compute_accuracy, has_eval_data, evaluates)
    if note:
        logger.warning(note)
    return note


def _no_effect(compute_accuracy: bool, has_eval_data: bool, evaluates: bool) -> str | None:
    if not compute_accuracy:
        return None
    if not has_eval_data:
        return (
            "compute_accuracy: has no effect without evaluation data; set val_size (e.g. 0.1) or "
            "eval_dataset, with do_eval: true or eval_strategy: steps"
        )
    if not evaluates:
        return (
            "compute_accuracy: has no effect: nothing is evaluated (do_eval: false and eval_strategy: no); "
            "set do_eval: true (evaluate after training) or eval_strategy: steps"
        )
    return None
