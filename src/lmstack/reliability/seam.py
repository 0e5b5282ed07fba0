"""Every private (underscore) hook of transformers / TRL that lmstack overrides, in one place.

These methods are not public API: an upgrade may rename one or change its parameters, and the
override would then be silently skipped (renamed) or break mid-run (re-signatured).
tests/unit/reliability/test_trainer_seam.py checks each entry against the installed libraries, so
such an upgrade fails a unit test instead. A new override of a private hook gets an entry here.

Each entry: the library class (`module:Class`), the method, the leading parameters lmstack's override
takes or passes on (by position, in this order), whether the override takes exactly these (`exact`:
no *args/**kwargs, so a new library parameter would break the call), and where lmstack overrides it.
`optional`: lmstack checks for the hook at run time and works without it (older versions).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Hook:
    library: str  # "module:Class" whose method is overridden
    method: str
    params: tuple[str, ...]  # the parameters after `self`, leading, in order
    overridden_by: str  # "module:Class" in lmstack
    exact: bool = False  # the override's parameters are exactly `params`
    optional: bool = False  # absent in some supported versions; lmstack looks it up first


TRAINER = "transformers:Trainer"
RELIABLE = "lmstack.reliability.trainer:ReliableMixin"

HOOKS: tuple[Hook, ...] = (
    # reliability/trainer.py: staged checkpoints, stop at the last step, NaN logging, safe loads
    Hook(TRAINER, "_run_epoch", (), RELIABLE, optional=True),
    Hook(TRAINER, "_maybe_log_save_evaluate", ("tr_loss",), RELIABLE),
    Hook(TRAINER, "_get_output_dir", ("trial",), RELIABLE, exact=True),
    Hook(TRAINER, "_save_checkpoint", ("model", "trial"), RELIABLE, exact=True),
    Hook(TRAINER, "_load_from_checkpoint", ("resume_from_checkpoint", "model"), RELIABLE, exact=True),
    Hook(TRAINER, "_load_best_model", (), RELIABLE, exact=True),
    Hook(TRAINER, "_load_rng_state", ("checkpoint",), RELIABLE, exact=True),
    Hook(TRAINER, "_load_optimizer_and_scheduler", ("checkpoint",), RELIABLE, exact=True),
    # train/rm.py: saves and resumes write/read the backbone + value_head.safetensors
    Hook(
        "trl:RewardTrainer",
        "_save",
        ("output_dir", "state_dict"),
        "lmstack.train.rm:ValueHeadRewardTrainer",
        exact=True,
    ),
    Hook(
        "trl:RewardTrainer",
        "_load_from_checkpoint",
        ("resume_from_checkpoint", "model"),
        "lmstack.train.rm:ValueHeadRewardTrainer",
        exact=True,
    ),
    # train/dpo.py, kto.py: our rows are already tokenized
    Hook(
        "trl:DPOTrainer",
        "_prepare_dataset",
        ("dataset", "processing_class", "args", "dataset_name"),
        "lmstack.train.dpo:PretokenizedDPOTrainer",
        exact=True,
    ),
    Hook(
        "trl:KTOTrainer",
        "_prepare_dataset",
        ("dataset", "processing_class", "args", "dataset_name"),
        "lmstack.train.kto:PretokenizedKTOTrainer",
        exact=True,
    ),
    # train/dpo.py (pref_loss orpo / simpo): not underscored, but an internal of TRL's experimental trainers
    Hook(
        "trl.experimental.orpo:ORPOTrainer",
        "tokenize_row",
        ("feature", "model"),
        "lmstack.train.pref_rows:PretokenizedRows",
        exact=True,
    ),
    Hook(
        "trl.experimental.cpo:CPOTrainer",
        "tokenize_row",
        ("feature", "model"),
        "lmstack.train.pref_rows:PretokenizedRows",
        exact=True,
    ),
    # train/grpo.py: prompts are our template's rendering, tokenized as they are
    Hook(
        "trl:GRPOTrainer",
        "_tokenize_prompts",
        ("prompts",),
        "lmstack.train.grpo:_TemplatePrompts",
        exact=True,
    ),
    Hook(
        "trl:RLOOTrainer",
        "_tokenize_prompts",
        ("prompts",),
        "lmstack.train.grpo:_TemplatePrompts",
        exact=True,
    ),
    # train/rollout_engine.py: the continuous-batching rollout without TRL's in-place bf16 cast, one
    # engine kept per run, each rollout's speed logged
    Hook(
        "trl:GRPOTrainer",
        "_generate_single_turn",
        ("prompt_ids", "images", "multimodal_fields"),
        "lmstack.train.rollout_engine:FastRollouts",
    ),
    Hook(
        "trl:RLOOTrainer",
        "_generate_single_turn",
        ("prompt_ids", "images", "multimodal_fields"),
        "lmstack.train.rollout_engine:FastRollouts",
    ),
)


def resolve(path: str) -> object:
    """`module:Name` -> the object (imports the module)."""
    import importlib

    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)
