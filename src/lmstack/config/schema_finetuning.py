"""The finetuning section of the config: method, adapters (LoRA and its variants), freezing, the
preference / RL stage fields and the method optimizers' settings."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from lmstack.config.schema_base import Section


class FinetuningArgs(Section):
    stage: Literal["pt", "sft", "rm", "ppo", "dpo", "kto", "grpo", "rloo"] = Field(
        "sft",
        description="Training stage: pt | sft | rm (reward model) | dpo (also orpo/simpo via pref_loss) | kto | "
        "ppo | grpo / rloo (online REINFORCE family with a reward model or reward_funcs).",
    )
    finetuning_type: Literal["lora", "oft", "freeze", "full"] = Field("lora", description="What is trained.")
    lora_rank: int = Field(8, gt=0, description="LoRA rank r.")
    lora_alpha: int | None = Field(None, gt=0, description="LoRA alpha (default 2 x lora_rank).")
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the LoRA input.")
    lora_target: str = Field(
        "all", description="'all' (every linear layer but the head) or comma-separated names."
    )
    additional_target: str | None = Field(None, description="Extra modules trained fully (modules_to_save).")
    use_rslora: bool = Field(False, description="Rank-stabilised LoRA scaling alpha/sqrt(r).")
    use_dora: bool = Field(False, description="Weight-decomposed LoRA (DoRA).")
    lora_kernel: Literal["auto", "peft", "fused"] = Field(
        "auto", description="LoRA Linear compute: fused (one autograd function, no add/scale kernels) | peft."
    )
    pissa_init: bool = Field(
        False, description="Initialise LoRA from the principal singular vectors (PiSSA)."
    )
    pissa_iter: int = Field(16, ge=-1, description="PiSSA fast-SVD iterations (-1 = exact SVD).")
    pissa_convert: bool = Field(
        False,
        description="Also save the PiSSA adapter converted to a plain LoRA (output_dir/pissa_converted).",
    )
    loraplus_lr_ratio: float | None = Field(
        None, gt=0, description="LoRA+: learning rate of B = ratio x learning rate of A."
    )
    loraplus_lr_embedding: float = Field(
        1e-6, gt=0, description="LoRA+: learning rate of embedding adapters."
    )
    create_new_adapter: bool = Field(
        False, description="Merge every adapter_name_or_path adapter and train a new one on top."
    )
    oft_rank: int = Field(
        0,
        ge=0,
        description="OFT: blocks per layer (PEFT's r); 0 lets oft_block_size decide (set one of the two).",
    )
    oft_block_size: int = Field(
        32, ge=0, description="OFT: size of each orthogonal block; 0 lets oft_rank decide."
    )
    oft_target: str = Field(
        "all", description="OFT: 'all' (every linear layer but the head) or comma-separated names."
    )
    module_dropout: float = Field(
        0.0, ge=0, lt=1, description="OFT: probability of replacing a block's rotation by the identity."
    )
    use_llama_pro: bool = Field(
        False,
        description="LLaMA-Pro: train only the expanded blocks (every N/freeze_trainable_layers-th layer of a "
        "block-expanded model); freeze or lora/oft.",
    )
    use_adam_mini: bool = Field(
        False, description="Adam-mini: one second-moment value per head/neuron block (full/freeze only)."
    )
    use_dft_loss: bool = Field(
        False, description="sft: DFT loss, token CE scaled by the (detached) probability of the target token."
    )
    use_eaft_loss: bool = Field(
        False, description="sft: EAFT loss, token CE scaled by a power of the top-20 entropy (divided by 3)."
    )
    eaft_alpha: float = Field(1.0, description="sft, use_eaft_loss: exponent of the entropy weight.")
    use_asft_loss: bool = Field(
        False, description="sft: ASFT loss, DFT loss plus asft_alpha x KL(reference || model) per token."
    )
    asft_alpha: float = Field(0.1, description="sft, use_asft_loss: weight of the KL term.")
    use_galore: bool = Field(False, description="GaLore: low-rank projected gradients (full/freeze only).")
    galore_target: str = Field("all", description="GaLore: 'all' linear layers or comma-separated names.")
    galore_rank: int = Field(16, gt=0, description="GaLore: projection rank.")
    galore_update_interval: int = Field(200, gt=0, description="GaLore: steps between projection updates.")
    galore_scale: float = Field(2.0, gt=0, description="GaLore: scale of the projected update.")
    galore_proj_type: Literal["std", "reverse_std", "right", "left", "full"] = Field(
        "std", description="GaLore: projection side."
    )
    galore_layerwise: bool = Field(
        False, description="GaLore: step each layer during backward (needs gradient_accumulation_steps: 1)."
    )
    use_apollo: bool = Field(False, description="APOLLO: low-rank scaled AdamW (full/freeze only).")
    apollo_target: str = Field("all", description="APOLLO: 'all' linear layers or comma-separated names.")
    apollo_rank: int = Field(16, gt=0, description="APOLLO: projection rank.")
    apollo_update_interval: int = Field(200, gt=0, description="APOLLO: steps between projection updates.")
    apollo_scale: float = Field(32.0, gt=0, description="APOLLO: update scale.")
    apollo_proj: Literal["svd", "random"] = Field("random", description="APOLLO: projection kind.")
    apollo_proj_type: Literal["std", "right", "left"] = Field("std", description="APOLLO: projection side.")
    apollo_scale_type: Literal["channel", "tensor"] = Field(
        "channel", description="APOLLO: per-channel or per-tensor scaling."
    )
    apollo_layerwise: bool = Field(
        False, description="APOLLO: step each layer during backward (needs gradient_accumulation_steps: 1)."
    )
    apollo_scale_front: bool = Field(
        False, description="APOLLO: scale the gradient before the norm growth limiter."
    )
    use_badam: bool = Field(
        False, description="BAdam: block-coordinate AdamW, one block at a time (full only)."
    )
    badam_mode: Literal["layer", "ratio"] = Field(
        "layer", description="BAdam: blocks are layers or sparse ratios."
    )
    badam_start_block: int | None = Field(None, ge=0, description="BAdam: first block (layer mode).")
    badam_switch_mode: Literal["ascending", "descending", "random", "fixed"] = Field(
        "ascending", description="BAdam: order of the blocks (layer mode)."
    )
    badam_switch_interval: int = Field(50, gt=0, description="BAdam: optimizer steps per block.")
    badam_update_ratio: float = Field(0.05, gt=0, le=1, description="BAdam: fraction updated (ratio mode).")
    badam_mask_mode: Literal["adjacent", "scatter"] = Field(
        "adjacent", description="BAdam: which entries a ratio-mode block holds."
    )
    badam_verbose: int = Field(
        0, ge=0, le=2, description="BAdam: 0 quiet, 1 block switches, 2 every parameter."
    )
    use_muon: bool = Field(
        False, description="Muon for 2-D non-embedding weights, AdamW for the rest (same as optim: muon)."
    )
    freeze_trainable_layers: int = Field(
        2, description="Freeze: train the last N layers (negative: first N)."
    )
    freeze_trainable_modules: str = Field("all", description="Freeze: modules trained inside those layers.")
    freeze_extra_modules: str | None = Field(None, description="Freeze: extra non-layer modules to train.")
    freeze_vision_tower: bool = Field(
        True, description="Vision models: keep the vision tower frozen (full/freeze) and out of LoRA targets."
    )
    freeze_multi_modal_projector: bool = Field(
        True, description="Vision models: keep the vision-to-text projector frozen and out of LoRA targets."
    )
    freeze_language_model: bool = Field(
        False, description="Vision models: freeze the language model (and keep it out of LoRA targets)."
    )
    pure_bf16: bool = Field(False, description="Train in bf16 without fp32 master weights.")
    plot_loss: bool = Field(False, description="Write training_loss.png (and eval loss) at the end.")
    compute_accuracy: bool = Field(False, description="Report token accuracy during evaluation.")
    disable_shuffling: bool = Field(False, description="Keep the dataset order.")
    include_effective_tokens_per_second: bool = Field(False, description="Report effective_tokens_per_sec.")
    # ---- RLHF: dpo / kto / rm / ppo / grpo (LLaMA-Factory's field names and defaults) ----
    pref_beta: float = Field(
        0.1,
        ge=0,
        allow_inf_nan=False,
        description="beta of the preference loss (DPO/IPO/hinge/ORPO/SimPO/KTO); grpo/rloo: weight of the KL "
        "to the starting model (0 = no KL term and no reference forward).",
    )
    pref_ftx: float = Field(0.0, ge=0, description="dpo: weight of an extra SFT loss on the chosen answers.")
    pref_loss: Literal["sigmoid", "hinge", "ipo", "orpo", "simpo"] = Field(
        "sigmoid",
        description="dpo: sigmoid (DPO) | hinge | ipo | orpo | simpo (orpo/simpo use no reference).",
    )
    dpo_label_smoothing: float = Field(
        0.0,
        ge=0,
        lt=0.5,
        description="dpo, sigmoid only: assumed label-noise rate; TRL 1.16 applies it as robust DPO (rDPO).",
    )
    simpo_gamma: float = Field(0.5, description="simpo: target reward margin gamma.")
    kto_chosen_weight: float = Field(1.0, gt=0, description="kto: weight of the desirable examples' loss.")
    kto_rejected_weight: float = Field(
        1.0, gt=0, description="kto: weight of the undesirable examples' loss."
    )
    ref_model: str | None = Field(
        None,
        description="dpo/kto/grpo reference model dir; unset: LoRA uses the base with the adapter disabled, "
        "full/freeze a frozen copy of the starting model.",
    )
    ref_model_adapters: str | None = Field(None, description="Adapter dir loaded onto ref_model.")
    reward_model: str | None = Field(
        None,
        description="ppo/grpo: output_dir of an lmstack `stage: rm` run (adapter or weights + value head).",
    )
    reward_model_adapters: str | None = Field(
        None,
        description="Not used by lmstack: an rm output dir already holds its adapter; give it as reward_model.",
    )
    reward_model_type: Literal["lora", "full", "api"] = Field(
        "lora",
        description="ppo/grpo: lora (reward_model holds an adapter) | full (full weights) | api (not supported).",
    )
    ppo_buffer_size: int = Field(
        1, gt=0, description="ppo: mini-batches per rollout batch (rollout = batch size x this)."
    )
    ppo_epochs: int = Field(4, gt=0, description="ppo: optimisation epochs over each rollout batch.")
    ppo_score_norm: bool = Field(
        False, description="ppo: normalise reward scores with running stats; rloo: normalise the advantages."
    )
    ppo_target: float = Field(6.0, gt=0, description="ppo: target KL of the adaptive KL controller.")
    ppo_whiten_rewards: bool = Field(False, description="ppo: whiten per-token rewards before GAE.")
    reward_funcs: str | None = Field(
        None,
        description="grpo: comma-separated Python reward functions 'pkg.module:function', each called as "
        "f(prompts=..., completions=..., **columns) -> list[float].",
    )
    num_generations: int = Field(
        4, ge=2, description="grpo: completions sampled per prompt (the group size)."
    )
    reward_weights: str | list[float] | None = Field(
        None,
        description="grpo/rloo: weight of each reward, e.g. '1.0,0.5': one per reward_funcs entry, then one for "
        "reward_model (default: 1 each); the advantage uses the weighted sum.",
    )
    format_reward_pattern: str = Field(
        r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$",
        min_length=1,
        description="grpo/rloo, reward_funcs: format: the regular expression a whole answer must match to score 1 "
        "(default: <think>...</think><answer>...</answer>).",
    )
    tool_funcs: str | None = Field(
        None,
        description="grpo: comma-separated Python tools 'pkg.module:function' the model may call in its answers "
        "(the template's tool-call format; the prompts describe them through the dataset's tools column); "
        "their answers are fed back as observation turns and masked from the loss.",
    )
    max_tool_calling_iterations: int | None = Field(
        None, ge=1, description="grpo, tool_funcs: most tool calls per answer (unset: until max_new_tokens)."
    )
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = Field(
        "dapo",
        description="grpo: how token losses are averaged: grpo (per answer, then over answers) | bnpo (over the "
        "micro-batch's tokens) | dr_grpo (sum / (answers x max_new_tokens)) | dapo (over the tokens of the whole "
        "accumulated batch; TRL's default).",
    )
    epsilon: float = Field(
        0.2, gt=0, lt=1, description="grpo/rloo: clip range of the probability ratio, 1 - epsilon from below."
    )
    epsilon_high: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="grpo/rloo: upper clip 1 + epsilon_high (DAPO's clip-higher, e.g. 0.28); unset = epsilon.",
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group",
        description="grpo: divide the advantages by the reward std of the group | batch | none (Dr. GRPO); "
        "true = group, false = none.",
    )
    mask_truncated_completions: bool = Field(
        False, description="grpo/rloo: answers cut by max_new_tokens (no end token) are left out of the loss."
    )
    importance_sampling_level: Literal["token", "sequence"] = Field(
        "token",
        description="grpo: probability ratios per token, or one per answer from the mean log-ratio (GSPO; "
        "with loss_type: grpo).",
    )
    num_iterations: int = Field(
        1,
        ge=1,
        description="grpo/rloo: optimisation passes over each batch of rollouts (mu); > 1 reuses them, corrected "
        "by the ratio to the sampling-time probabilities.",
    )
    steps_per_generation: int | None = Field(
        None,
        ge=1,
        description="grpo/rloo: micro-steps one rollout batch serves (default gradient_accumulation_steps); more "
        "trains on rollouts of an older policy, corrected by the same ratio.",
    )
    rollout_engine: Literal["auto", "continuous_batching", "generate"] = Field(
        "auto",
        description="grpo/rloo: how answers are sampled: continuous_batching (transformers' paged-KV engine, "
        "generate_batch, on the trained weights in place; CUDA graphs for decode on a GPU) | generate (one "
        "padded batch, model.generate) | auto (the run plan picks: continuous_batching where it applies).",
    )

    @field_validator("scale_rewards", mode="before")
    @classmethod
    def _scale_rewards_bool(cls, value: object) -> object:
        """TRL's GRPOConfig reads true as group and false as none."""
        return {True: "group", False: "none"}.get(value, value) if isinstance(value, bool) else value

    @field_validator("reward_weights", mode="before")
    @classmethod
    def _reward_weights(cls, value: object) -> object:
        """'1.0,0.5' (LF's comma lists) or a YAML list -> a list of floats."""
        if value is None or isinstance(value, list | tuple) and not value:
            return None
        if isinstance(value, int | float) and not isinstance(value, bool):
            value = [value]  # `reward_weights: 2` (one reward)
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, list | tuple):
            raise ValueError("write a comma list of numbers, e.g. '1.0,0.5', or a YAML list")
        weights = []
        for item in items:
            try:
                weight = float(str(item).strip()) if not isinstance(item, bool) else None
            except ValueError:
                weight = None
            if weight is None or weight != weight or weight in (float("inf"), float("-inf")):
                raise ValueError(f"{item!r} is not a number; write a comma list of numbers, e.g. '1.0,0.5'")
            weights.append(weight)
        return weights


# optimizers the validator passes without importing transformers (its OptimizerNames list is the rule)
# torch's AdamW as transformers names it: multi-tensor (foreach) and fused
