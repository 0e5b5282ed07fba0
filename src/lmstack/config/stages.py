"""What each training stage can do: one capability table instead of `stage in (...)` tests spread
over the code, so a stage's abilities are decided in one place. The run plan, the rules, the data layer and the stages read it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageSpec:
    name: str
    data: str  # "text" (pt) | "supervised" | "pairwise" | "kto" | "prompt"
    packs: bool = False  # packing / neat_packing can apply
    packs_by_default: bool = False  # packing unset -> packed (LF: pt)
    fused_ce: bool = False  # the loss never needs the logits: a fused linear CE can replace the head
    reference: bool = False  # a reference model (ref_model, or the adapter-off base / a frozen copy)
    generates: bool = False  # samples completions while training
    value_head: bool = False
    method_optimizers: bool = False  # LoRA+, GaLore, APOLLO, BAdam, Muon, PiSSA conversion are wired
    master_weights: bool = False  # bf16 model + fp32 masters in the optimizer (train/master_weights.py)
    eval_accuracy: bool = False  # compute_accuracy reports token accuracy
    multi_process: bool = True  # runs under torchrun / DeepSpeed
    needs_reward: bool = False  # reward_model or reward_funcs
    trainer: bool = True  # a transformers/TRL Trainer runs it (trackers, early stopping, best checkpoint)


STAGE_SPECS: dict[str, StageSpec] = {
    "pt": StageSpec(
        "pt",
        "text",
        packs=True,
        packs_by_default=True,
        fused_ce=True,
        method_optimizers=True,
        master_weights=True,
        eval_accuracy=True,
    ),
    "sft": StageSpec(
        "sft",
        "supervised",
        packs=True,
        fused_ce=True,
        method_optimizers=True,
        master_weights=True,
        eval_accuracy=True,
    ),
    "rm": StageSpec("rm", "pairwise", value_head=True),
    "dpo": StageSpec("dpo", "pairwise", reference=True),
    "kto": StageSpec("kto", "kto", reference=True),
    "ppo": StageSpec(
        "ppo",
        "prompt",
        reference=True,
        generates=True,
        value_head=True,
        multi_process=False,
        needs_reward=True,
        trainer=False,
    ),
    # grpo/rloo: the KL term (pref_beta) uses the adapter-off base, never a ref_model
    "grpo": StageSpec("grpo", "prompt", generates=True, needs_reward=True),
    "rloo": StageSpec("rloo", "prompt", generates=True, needs_reward=True),
}


def stage_spec(stage: str) -> StageSpec:
    return STAGE_SPECS[stage]


def stages_where(capability: str) -> tuple[str, ...]:
    """Names of the stages that have `capability` (for error messages)."""
    return tuple(name for name, spec in STAGE_SPECS.items() if getattr(spec, capability))
