"""The rollout engine of stages grpo / rloo (plan.rl.rollout_engine, plan/decide_rl.py).

`continuous_batching`: transformers' `generate_batch` (a paged KV cache; each answer leaves the running
batch when it ends, so short answers stop costing decode steps; decode steps replayed as CUDA graphs on
a GPU) called on the trained module itself: a PeftModel forwards it to the base model, whose LoRA layers
are applied in place, so no weights are copied or merged.

TRL 1.16 has this path (`use_transformers_continuous_batching`), but its branch of
`_generate_single_turn` casts the whole model to bf16 in place when `bf16` is set (`unwrapped_model.to(
torch.bfloat16)`, trl/trainer/grpo_trainer.py), which turns fp32 LoRA weights or fp32 master weights into
bf16 ones for the rest of training, and it builds a new paged cache (and recaptures its graphs) on every
rollout. `FastRollouts` replaces that branch: no cast (the adapter computes in its own dtype, as in
training), and one engine per run, its cache sized for one rollout batch (requests x (cutoff_len +
max_new_tokens)) and kept, so later rollouts reuse cache and graphs. The optimizer updates the weights in
place, so a kept engine (and its graphs) always samples from the current policy.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any

import torch

CB_PAGE_SIZE = 256  # tokens per KV page (transformers' default)


def cb_settings(plan: Any, requests: int) -> dict[str, Any]:
    """GRPOConfig's continuous-batching fields for this run: the cache for one rollout batch of
    `requests` answers, CUDA graphs for the decode path on a GPU, the sampling seed from `seed`."""
    g, d = plan.cfg.generating, plan.cfg.data
    pages = requests * math.ceil((d.cutoff_len + g.max_new_tokens) / CB_PAGE_SIZE)
    cuda = plan.device == "cuda"
    wanted = {
        "page_size": CB_PAGE_SIZE,
        "num_blocks": pages + 1,
        "use_cuda_graph": (False, True) if cuda else False,
        "seed": plan.cfg.training.seed,
    }
    return {
        "use_transformers_continuous_batching": True,
        "transformers_continuous_batching_config": _known_fields(wanted),
    }


def _known_fields(wanted: dict[str, Any]) -> dict[str, Any]:
    """`wanted` as this transformers' ContinuousBatchingConfig names it (page_size was block_size before
    5.17); a setting the installed class lacks is refused, never dropped: the engine would run without it."""
    from transformers.generation import ContinuousBatchingConfig

    from lmstack.config.errors import ConfigError

    names = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    out = dict(wanted)
    if "page_size" not in names and "block_size" in names and "page_size" in out:
        out["block_size"] = out.pop("page_size")
    unknown = sorted(set(out) - names)
    if unknown:
        raise ConfigError(
            f"rollout_engine: continuous_batching: the installed transformers' ContinuousBatchingConfig has "
            f"no setting {', '.join(unknown)}, which lmstack sets; install the transformers version lmstack "
            "supports (pyproject.toml) or set rollout_engine: generate"
        )
    return out


def cb_completions(trainer: Any, prompt_ids: list[list[int]]) -> list[list[int]]:
    """One rollout through the kept continuous-batching engine: the answers' token ids, in prompt order,
    each ending at (and keeping) its end token, as TRL's generate path cuts them."""
    from trl.extras.profiling import profiling_context
    from trl.models import unwrap_model_for_generation

    with (
        profiling_context(trainer, "transformers.generate_batch"),
        unwrap_model_for_generation(
            trainer.model_wrapped,
            trainer.accelerator,
            gather_deepspeed3_params=trainer.args.ds3_gather_for_generation,
            gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs,
        ) as model,
        torch.no_grad(),
    ):
        was_training = model.training
        # transformers' continuous_batching/utils.py logger: its every-call "the manager will be kept alive"
        # warning says what this engine does on purpose
        cb_logger = logging.getLogger("ContinuousBatchingLogger")
        level = cb_logger.level
        cb_logger.setLevel(max(level, logging.ERROR))
        try:
            outputs = model.generate_batch(
                [list(p) for p in prompt_ids],
                generation_config=trainer.generation_config,
                continuous_batching_config=trainer.continuous_batching_config,
                progress_bar=False,
                persistent_manager=True,
            )
        finally:
            cb_logger.setLevel(level)
            model.train(was_training)
    errors = [e for o in outputs.values() if (e := getattr(o, "error", None))]  # older 5.x: no error field
    if len(outputs) != len(prompt_ids) or errors:
        raise RuntimeError(
            f"continuous-batching rollout returned {len(outputs)} of {len(prompt_ids)} answers "
            f"({errors[0] if errors else 'no error given'}); set rollout_engine: generate"
        )
    eos = set(trainer.eos_token_ids)
    return [_cut_at_end(list(o.generated_tokens), eos) for o in outputs.values()]


def _cut_at_end(ids: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(ids):
        if t in eos:
            return ids[: i + 1]
    return ids


def release(model: Any) -> None:
    """Free the kept engine's cache (and graphs) once training ends."""
    destroy = getattr(model, "destroy_cached_continuous_batching_manager", None)
    if destroy is not None:
        destroy()


class FastRollouts:
    """Mixed into the GRPO / RLOO trainers: the continuous-batching branch of their rollout replaced, and
    each rollout's speed logged (rollout/tokens_per_sec: answer tokens sampled per second of rollout)."""

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, *rest, **kwargs):
        start = time.perf_counter()
        if self.use_transformers_continuous_batching:
            completions = cb_completions(self, prompt_ids)
            out = (completions, None) if self._returns_logprobs else completions
        else:
            out = super()._generate_single_turn(prompt_ids, images, multimodal_fields, *rest, **kwargs)
            completions = out[0] if self._returns_logprobs else out
        seconds = time.perf_counter() - start
        mode = "train" if self.model.training else "eval"
        tokens = sum(len(c) for c in completions)
        self._metrics[mode]["rollout/tokens_per_sec"].append(tokens / max(seconds, 1e-9))
        return out

    def train(self, *args, **kwargs):
        try:
            return super().train(*args, **kwargs)
        finally:
            release(self.accelerator.unwrap_model(self.model))
