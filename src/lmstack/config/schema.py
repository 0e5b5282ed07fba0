"""Typed configuration. Users write flat LLaMA-Factory field names; internally they are grouped into
sections. Defaults live here and only here, so no reader can disagree with another about one."""

from __future__ import annotations

import json
import typing
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationInfo, field_validator, model_validator

from lmstack.config.errors import did_you_mean


def leaf_types(annotation: Any) -> list[Any]:
    """The plain types a field annotation accepts (through Union / Optional / Annotated)."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return leaf_types(typing.get_args(annotation)[0])
    if origin is Literal:
        return []
    args = typing.get_args(annotation)
    if args and origin is not None and origin not in (dict, list, tuple):
        return [t for arg in args for t in leaf_types(arg)]
    return [annotation]


def _typed_strings(value: Any) -> Any:
    """Inside a mapping: "true"/"false" -> bool, "2" -> 2, "0.5" -> 0.5; anything else as it is."""
    if isinstance(value, dict):
        return {k: _typed_strings(v) for k, v in value.items()}
    if not isinstance(value, str):
        return value
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    if value.isdigit():
        return int(value)
    if value.replace(".", "", 1).isdigit():
        return float(value)
    return value


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())

    @field_validator("*", mode="before")
    @classmethod
    def _booleans_are_not_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        """`lora_rank: true` would validate as 1 (bool is an int subclass): refuse it for number fields."""
        if isinstance(value, bool) and info.field_name in cls.model_fields:
            leaves = leaf_types(cls.model_fields[info.field_name].annotation)
            if bool not in leaves and (int in leaves or float in leaves):
                raise ValueError("a boolean is not a number; write a number")
        return value


class ModelArgs(Section):
    model_name_or_path: str = Field(description="Local directory or hub id of the base model (required).")
    adapter_name_or_path: str | None = Field(
        None,
        description="Comma-separated adapter dirs; training merges all but the last and resumes the last.",
    )
    cache_dir: str | None = Field(None, description="Where hub downloads are cached.")
    model_revision: str = Field("main", description="Hub revision (branch, tag or commit).")
    trust_remote_code: bool = Field(False, description="Allow custom modelling code from the model dir/hub.")
    hf_hub_token: SecretStr | None = Field(
        None, description="Hub token (redacted in logs and saved configs)."
    )
    use_fast_tokenizer: bool = Field(True, description="Use the fast (tokenizers) tokenizer.")
    split_special_tokens: bool = Field(False, description="Tokenize special-token strings as plain text.")
    resize_vocab: bool = Field(False, description="Resize embeddings to the tokenizer's length.")
    flash_attn: Literal["auto", "disabled", "sdpa", "fa2", "fa3", "flex"] = Field(
        "auto", description="Attention kernel: auto | disabled (eager) | sdpa | fa2 | fa3 | flex."
    )
    enable_liger_kernel: bool = Field(False, description="Patch the model with Liger's fused Triton kernels.")
    use_unsloth: bool = Field(False, description="Use Unsloth's patched LoRA path (single GPU).")
    disable_gradient_checkpointing: bool = Field(
        False, description="LF compatibility: true forces gradient_checkpointing off."
    )
    use_reentrant_gc: bool = Field(True, description="Use reentrant activation checkpointing.")
    use_unsloth_gc: bool = Field(
        False,
        description="Unsloth-style offloaded checkpointing: each recomputed decoder layer parks its input hidden "
        "state in CPU RAM until its backward (lmstack's own; does not need unsloth installed). Every layer with "
        "gradient_checkpointing: true; under auto (the default) the planner recomputes only as many as the GPU needs.",
    )
    upcast_layernorm: bool = Field(False, description="Keep norm weights in fp32.")
    low_cpu_mem_usage: bool = Field(True, description="Load weights without a full CPU copy.")
    train_from_scratch: bool = Field(
        False, description="Random-init the architecture instead of loading weights."
    )
    quantization_bit: Literal[4, 8] | None = Field(
        None, description="Quantize the base model to 4 or 8 bits (QLoRA)."
    )
    quantization_type: Literal["nf4", "fp4"] = Field("nf4", description="4-bit data type.")
    double_quantization: bool = Field(True, description="Quantize the quantization constants too.")
    infer_dtype: Literal["auto", "float16", "bfloat16", "float32"] = Field(
        "auto", description="Weights dtype for chat/api/export."
    )
    print_param_status: bool = Field(
        False, description="Log every parameter's dtype, device and trainability."
    )
    infer_backend: Literal["huggingface", "vllm", "sglang"] = Field(
        "huggingface", description="Engine of chat/api: transformers (batched by lmstack), vLLM or SGLang."
    )
    vllm_maxlen: int = Field(4096, gt=0, description="Max prompt+completion length of the vLLM engine.")
    vllm_gpu_util: float = Field(0.7, gt=0, le=1, description="Fraction of GPU memory vLLM may reserve.")
    vllm_enforce_eager: bool = Field(False, description="Disable CUDA graphs in vLLM.")
    vllm_max_lora_rank: int = Field(32, gt=0, description="Largest LoRA rank vLLM must support.")
    vllm_config: dict[str, Any] | None = Field(
        None, description="Extra vLLM engine arguments (a mapping or its JSON string)."
    )
    sglang_maxlen: int = Field(4096, gt=0, description="Context length of the SGLang engine.")
    sglang_mem_fraction: float = Field(0.7, gt=0, le=1, description="Static memory fraction for SGLang.")
    sglang_tp_size: int = Field(-1, description="SGLang tensor-parallel size; -1 = every visible GPU.")
    sglang_config: dict[str, Any] | None = Field(
        None, description="Extra SGLang engine arguments (a mapping or its JSON string)."
    )
    sglang_lora_backend: Literal["triton", "flashinfer"] = Field(
        "triton", description="Kernel backend of SGLang's LoRA GEMMs."
    )

    @field_validator("vllm_config", "sglang_config", mode="before")
    @classmethod
    def _json_config(cls, value: object) -> object:
        """LF reads these as a JSON string too (`vllm_config: '{"max_num_seqs": 64}'`)."""
        if isinstance(value, str):
            try:
                return json.loads(value)
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"not valid JSON ({err.msg}); write a mapping like {{max_num_seqs: 64}}"
                ) from None
        return value


class DataArgs(Section):
    template: str | None = Field(
        None, description="Chat template name; unset = the tokenizer's own chat template."
    )
    dataset: str | None = Field(None, description="Comma-separated dataset names from dataset_info.json.")
    eval_dataset: str | None = Field(None, description="Comma-separated evaluation dataset names.")
    dataset_dir: str = Field("data", description="Folder holding dataset_info.json and the data files.")
    cutoff_len: int = Field(2048, gt=0, description="Max tokens per sample after tokenization.")
    train_on_prompt: bool = Field(False, description="Also train on prompt tokens.")
    mask_history: bool = Field(False, description="Train only on the last assistant turn.")
    max_samples: int | None = Field(None, gt=0, description="Keep the first N records of each dataset.")
    val_size: float = Field(
        0.0, ge=0, allow_inf_nan=False, description="Validation split: a fraction < 1 or a record count >= 1."
    )
    overwrite_cache: bool = Field(False, description="Rebuild the tokenized cache even if it is valid.")
    preprocessing_num_workers: int | None = Field(None, ge=1, description="Processes used for tokenization.")
    preprocessing_batch_size: int = Field(1000, gt=0, description="Records per tokenization batch.")
    mix_strategy: Literal["concat", "interleave_under", "interleave_over"] = Field(
        "concat",
        description="Several datasets: concat | interleave_under (stop when one runs out) | "
        "interleave_over (until every one is used up, repeating the smaller ones).",
    )
    interleave_probs: str | list[float] | None = Field(
        None, description="Interleave: sampling probability per dataset, e.g. '0.7,0.3' (default: equal)."
    )
    streaming: bool = Field(
        False, description="Tokenize lazily while training instead of up front (needs max_steps > 0)."
    )
    strict: bool = Field(
        False,
        description="lmstack's: refuse the run (exit 2, before the model loads) when any record is dropped "
        "(a bad JSON line, a missing field, ...), as `lmstack check --strict` fails; `lmstack train CFG "
        "--strict` sets it.",
    )
    buffer_size: int = Field(16384, gt=0, description="Streaming: records in the shuffle buffer.")
    tokenized_path: str | None = Field(
        None,
        description="Save the tokenized data here on the first run; later runs load it (other data refused).",
    )
    packing: bool | None = Field(
        None, description="Pack samples into cutoff_len rows (no cross-sample attention)."
    )
    neat_packing: bool = Field(False, description="Same as packing (lmstack packing never contaminates).")
    default_system: str | None = Field(None, description="Override the template's default system prompt.")
    enable_thinking: bool | None = Field(
        True,
        description="Reasoning templates: empty <think> added to the answer (true) / prompt (false) / never (null).",
    )
    preserve_thinking: bool = Field(False, description="Reasoning templates: keep the CoT of history turns.")
    thinking_style: Literal["llamafactory", "inference"] = Field(
        "llamafactory",
        description="Reasoning templates: LLaMA-Factory's thought rules, or inference = history as the "
        "model's chat template shows it (lmstack's rules; templates/THINKING.md).",
    )
    escape_special_tokens_in_content: bool = Field(
        False,
        description="lmstack-only: tokenize user and tool-result text with special tokens not parsed "
        "(`<|im_end|>` typed by a user stays text); the template's own markup is unchanged. Off: special-"
        "token strings anywhere are control tokens, as in LLaMA-Factory and vLLM. Needs template: <name>.",
    )
    ignore_pad_token_for_loss: bool = Field(True, description="Padding positions never count in the loss.")
    image_max_pixels: int = Field(
        768 * 768,
        gt=0,
        description="Vision models: larger images are downscaled to at most this many pixels.",
    )
    image_min_pixels: int = Field(
        32 * 32, gt=0, description="Vision models: smaller images are upscaled to at least this many pixels."
    )
    image_do_pan_and_scan: bool = Field(
        False, description="Gemma 3's pan-and-scan crops of an image (other models: true is refused)."
    )
    crop_to_patches: bool = Field(
        False, description="InternVL's tiling of an image into patches (other models: true is refused)."
    )
    video_max_pixels: int = Field(
        256 * 256, gt=0, description="Video models: larger frames are downscaled to at most this many pixels."
    )
    video_min_pixels: int = Field(
        16 * 16, gt=0, description="Video models: smaller frames are upscaled to at least this many pixels."
    )
    video_fps: float = Field(
        2.0, gt=0, allow_inf_nan=False, description="Video models: frames sampled per second of video."
    )
    video_maxlen: int = Field(128, gt=0, description="Video models: at most this many frames per video.")
    audio_sampling_rate: int = Field(
        16000, gt=0, description="Audio models: audio is resampled to this rate (Hz) before its features."
    )

    @field_validator("val_size")
    @classmethod
    def _val_size_form(cls, value: float) -> float:
        # a fraction below 1 or a whole record count: 1.5 is neither, and int() would silently read 1
        if value >= 1 and value != int(value):
            raise ValueError("give a fraction in (0, 1) or a whole number of records >= 1 (LF's two forms)")
        return value

    @model_validator(mode="after")
    def _video_pixel_bounds(self) -> DataArgs:
        if self.video_max_pixels < self.video_min_pixels:  # LF's ProcessorArguments check
            raise ValueError(
                f"video_max_pixels: got {self.video_max_pixels}, less than video_min_pixels "
                f"{self.video_min_pixels}; raise video_max_pixels or lower video_min_pixels"
            )
        return self


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
ADAMW_OPTIMS = ("adamw_torch", "adamw_torch_fused")
FAST_OPTIMS = frozenset({*ADAMW_OPTIMS, "muon"})
# `report_to` trackers lmstack runs (transformers' integration callbacks; each an extra of its own), and
# the transformers integrations it does not have yet
TRACKERS = ("tensorboard", "wandb", "mlflow", "swanlab", "trackio")
TRACKERS_LATER = tuple("azure_ml clearml codecarbon comet_ml dagshub dvclive flyte kubeflow neptune".split())


def optim_names() -> list[str]:
    """transformers' OptimizerNames values plus lmstack's `muon` (torch.optim.Muon)."""
    from transformers.training_args import OptimizerNames

    return [o.value for o in OptimizerNames] + ["muon"]


def normalize_report_to(value: object) -> str:
    """LF's forms (`wandb`, `wandb,tensorboard`, a YAML list, `none`, `all`) -> "none", "all" (every
    tracker lmstack has that is installed where the run starts) or a comma list of tracker names;
    a tracker lmstack lacks is refused by name."""
    if value is None or value is False:
        return "none"
    if isinstance(value, list | tuple):
        names = [str(v).strip() for v in value]
    elif isinstance(value, str):
        names = [v.strip() for v in value.split(",")]
    else:
        raise ValueError("expected a tracker name, a comma list or a YAML list of names")
    names = [n for n in names if n]
    if not names or names == ["none"]:
        return "none"
    later = [n for n in names if n in TRACKERS_LATER]
    if later:
        raise ValueError(
            f"{', '.join(later)}: not available yet in lmstack (trackers: none | all | "
            f"{' | '.join(TRACKERS)}); remove {'them' if len(later) > 1 else 'it'}"
        )
    allowed = ["none", "all", *TRACKERS]
    for name in names:
        if name not in allowed:
            raise ValueError(
                f"unknown tracker {name!r}; allowed: {' | '.join(allowed)}{did_you_mean(name, allowed)}"
            )
    if len(names) > 1 and ("none" in names or "all" in names):
        raise ValueError(
            "`none` / `all` together with a tracker; write `none` or `all` alone, or the trackers"
        )
    return ",".join(dict.fromkeys(names))


class TrainingArgs(Section):
    output_dir: str = Field(description="Where checkpoints, adapters, logs and plots are written (required).")
    overwrite_output_dir: bool = Field(
        False, description="Reuse a non-empty output_dir, replacing old outputs."
    )
    do_train: bool = Field(True, description="Run training.")
    do_eval: bool = Field(False, description="Run evaluation on the validation split.")
    per_device_train_batch_size: Annotated[int, Field(gt=0)] | Literal["auto"] = Field(
        1, description="Micro-batch size per device, or auto (the largest the planner finds fits)."
    )
    per_device_eval_batch_size: int = Field(1, gt=0, description="Eval batch size per device.")
    gradient_accumulation_steps: int = Field(1, gt=0, description="Micro-batches per optimizer step.")
    learning_rate: float = Field(5e-5, gt=0, allow_inf_nan=False, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1, in [0, 1).")
    adam_beta2: float = Field(0.999, ge=0, lt=1, description="AdamW beta2, in [0, 1).")
    adam_epsilon: float = Field(1e-8, gt=0, allow_inf_nan=False, description="AdamW epsilon.")
    max_grad_norm: float = Field(
        1.0, ge=0, allow_inf_nan=False, description="Gradient clipping norm (0 = off)."
    )
    optim: str = Field(
        "adamw_torch", description="Optimizer name as transformers knows it (OptimizerNames), or muon."
    )
    num_train_epochs: float = Field(3.0, gt=0, description="Epochs (ignored when max_steps > 0).")
    max_steps: int = Field(-1, description="Total optimizer steps; overrides num_train_epochs when > 0.")
    lr_scheduler_type: Literal[
        "linear",
        "cosine",
        "cosine_with_restarts",
        "polynomial",
        "constant",
        "constant_with_warmup",
        "inverse_sqrt",
        "reduce_lr_on_plateau",
        "cosine_with_min_lr",
        "warmup_stable_decay",
    ] = Field("linear", description="Learning-rate schedule.")
    lr_scheduler_kwargs: dict[str, Any] | None = Field(
        None,
        description="Extra arguments of the schedule (transformers' lr_scheduler_kwargs), e.g. "
        "{min_lr_rate: 0.1} for cosine_with_min_lr; a JSON string is read as a mapping.",
    )
    warmup_ratio: float = Field(0.0, ge=0, lt=1, description="Warm-up as a fraction of the total steps.")
    warmup_steps: int = Field(0, ge=0, description="Warm-up steps (wins over warmup_ratio when > 0).")
    bf16: bool = Field(False, description="bf16 mixed precision (CPU autocast on CPU).")
    fp16: bool = Field(False, description="fp16 mixed precision (GPU only).")
    master_weights: Literal["auto", "model", "optimizer"] = Field(
        "auto",
        description="Full/freeze with bf16: fp32 weights in the model under autocast (model), or bf16 "
        "model weights with fp32 master copies in the optimizer (optimizer, as DeepSpeed/FSDP do); "
        "auto = optimizer on a CUDA GPU where it applies.",
    )
    gradient_checkpointing: bool | Literal["auto"] = Field(
        "auto",
        description="Recompute activations in backward: true | false | auto (default: the planner turns it "
        "on only when the run would not fit without; LLaMA-Factory always recomputes).",
    )
    seed: int = Field(42, ge=0, le=2**32 - 1, description="Random seed for init, data order and dropout.")
    logging_steps: int = Field(10, gt=0, description="Log every N optimizer steps.")
    save_strategy: Literal["steps", "epoch", "no"] = Field(
        "steps", description="When checkpoints are written."
    )
    save_steps: int = Field(
        500, gt=0, description="Checkpoint every N steps (the last step is always saved)."
    )
    save_total_limit: int | None = Field(None, gt=0, description="Keep at most N checkpoints.")
    save_only_model: bool = Field(False, description="Checkpoints without optimizer/scheduler state.")
    eval_strategy: Literal["no", "steps", "epoch"] = Field("no", description="When to evaluate.")
    eval_steps: int | None = Field(None, gt=0, description="Evaluate every N steps.")
    load_best_model_at_end: bool = Field(
        False,
        description="Load the best checkpoint (by metric_for_best_model) at the end; rotation by "
        "save_total_limit always keeps it. Needs evaluation data and save_strategy equal to eval_strategy.",
    )
    metric_for_best_model: str | None = Field(
        None,
        description="Eval metric that picks the best checkpoint, e.g. loss or accuracy (eval_ prefix optional); "
        "default loss with load_best_model_at_end.",
    )
    greater_is_better: bool | None = Field(
        None, description="A larger metric_for_best_model is better (default: false for *loss, else true)."
    )
    early_stopping_steps: int | None = Field(
        None,
        gt=0,
        description="Early-stopping patience: stop after N evaluations without improvement of "
        "metric_for_best_model (needs load_best_model_at_end).",
    )
    do_predict: bool = Field(
        False, description="sft: generate for the eval data after training (or alone with do_train: false)."
    )
    predict_with_generate: bool = Field(
        False,
        description="sft, do_predict: write generated_predictions.jsonl and the predict_bleu-4 / predict_rouge-* "
        "metrics (needs the `metrics` extra).",
    )
    run_name: str | None = Field(None, description="Run name handed to the Trainer and its trackers.")
    gradient_checkpointing_kwargs: dict | None = Field(
        None,
        description="Keyword arguments of torch.utils.checkpoint (e.g. {use_reentrant: false}, which wins over "
        "use_reentrant_gc); only with gradient checkpointing on.",
    )
    report_to: str = Field(
        "none",
        description="Experiment trackers, as LF writes them: a name, a comma list or a YAML list; "
        "none | all (every installed one) | tensorboard | wandb | mlflow | swanlab | trackio (each an extra: "
        "pip install 'lmstack[wandb]').",
    )
    logging_dir: str | None = Field(None, description="TensorBoard log dir (default output_dir/runs).")
    project: str = Field(
        "huggingface",
        min_length=1,
        description="report_to: trackio: the trackio project the run is logged in.",
    )
    use_swanlab: bool = Field(
        False,
        description="Log to SwanLab with the swanlab_* settings below (LF's switch; needs the swanlab extra).",
    )
    swanlab_project: str | None = Field("llamafactory", description="use_swanlab: the SwanLab project.")
    swanlab_workspace: str | None = Field(None, description="use_swanlab: the SwanLab workspace.")
    swanlab_run_name: str | None = Field(None, description="use_swanlab: the experiment name.")
    swanlab_mode: Literal["cloud", "local", "offline", "disabled"] = Field(
        "cloud",
        description="use_swanlab: cloud (uploads) | local | offline (both stay on this machine) | disabled.",
    )
    swanlab_api_key: SecretStr | None = Field(
        None, description="use_swanlab: API key to log in (cloud mode)."
    )
    swanlab_logdir: str | None = Field(
        None, description="Where SwanLab writes its run (default output_dir/swanlog, or SWANLAB_LOG_DIR)."
    )
    resume_from_checkpoint: str | None = Field(
        None, description="A checkpoint dir, or 'auto' for the newest one."
    )
    dataloader_num_workers: int = Field(0, ge=0, description="Data-loader worker processes.")
    ddp_timeout: int = Field(1800, gt=0, description="Seconds a rank waits for the others.")
    ddp_find_unused_parameters: bool = Field(
        False,
        description="DDP searches the graph for unused parameters every step (slower); lmstack's "
        "stages use every trainable parameter, so off unless a custom model needs it.",
    )
    deepspeed: str | None = Field(
        None,
        description="Path to a DeepSpeed JSON config, or auto (the planner picks none or a ZeRO template).",
    )
    fsdp: str | None = Field(
        None,
        description="FSDP through the Trainer (transformers' form, as LLaMA-Factory passes it): e.g. "
        "'full_shard auto_wrap', 'shard_grad_op auto_wrap', add 'offload' for CPU offload; needs several "
        "processes (torchrun, or lmstack's relaunch on several GPUs).",
    )
    fsdp_config: dict | None = Field(
        None, description="FSDP options for the Trainer (e.g. {version: 2}); only with fsdp."
    )
    max_tokens_per_batch: int | None = Field(
        None, gt=0, description="Token budget per micro-batch (packing)."
    )
    torch_compile: bool = Field(
        False,
        description="Compile each decoder layer with torch.compile (regional compile; the run plan says how).",
    )
    torch_compile_backend: str | None = Field(
        None, description="torch.compile backend for torch_compile (None = inductor; e.g. aot_eager)."
    )
    fp8: bool = Field(
        False,
        description="FP8 GEMMs on NVIDIA sm89+ GPUs: LoRA keeps its frozen base in FP8 (row-wise scales, "
        "forward and input-grad GEMMs in FP8, adapters bf16); full fine-tuning uses torchao's float8 "
        "training (rowwise recipe). Needs bf16: true.",
    )
    fp8_backend: Literal["auto", "torchao"] = Field(
        "auto", description="FP8 implementation: auto | torchao (te and msamp are LF's, not lmstack's)."
    )
    fp8_enable_fsdp_float8_all_gather: bool = Field(
        False,
        description="FSDP2 all-gathers float8 weights (full fine-tuning with fp8 and fsdp_config {version: 2}; "
        "torchao's tensorwise recipe).",
    )
    ray_num_workers: int = Field(
        1,
        ge=1,
        description="USE_RAY=1: the Ray Train workers (one device each: a GPU, or 1 CPU on a CPU cluster).",
    )
    ray_init_kwargs: dict | None = Field(
        None,
        description="USE_RAY=1: keyword arguments of ray.init (address, num_cpus, runtime_env, ...); a "
        "mapping or a JSON object string. Without `address` a local Ray cluster starts for the run.",
    )
    master_addr: str | None = Field(
        None,
        description="USE_RAY=1: the Ray node whose address hosts the process-group rendezvous (rank 0 runs "
        "there); None = the node Ray places rank 0 on.",
    )
    master_port: int | None = Field(
        None,
        gt=0,
        lt=65536,
        description="USE_RAY=1: the rendezvous port; None = a free one on rank 0's node.",
    )
    disable_tqdm: bool = Field(False, description="No progress bar.")
    use_cpu: bool = Field(False, description="Train on the CPU even if a GPU is visible.")
    on_nonfinite: Literal["abort", "skip"] = Field(
        "abort",
        description="NaN/Inf loss: abort (stop, naming the step) | skip (no optimizer update that step).",
    )
    nonfinite_skip_budget: int = Field(
        10, ge=0, description="on_nonfinite: skip -> abort once more than this many steps were skipped."
    )

    @field_validator("fsdp", mode="before")
    @classmethod
    def _fsdp_words(cls, value: object) -> object:
        """`fsdp: [full_shard, auto_wrap]` (a YAML list) and `fsdp: full_shard auto_wrap` are the same;
        `false` / empty = off."""
        if value is False or value == "" or value == []:
            return None
        if isinstance(value, list | tuple):
            return " ".join(str(v) for v in value)
        return value

    @field_validator("ray_init_kwargs", mode="before")
    @classmethod
    def _ray_init_json(cls, value: object) -> object:
        """LF reads `ray_init_kwargs` as a mapping or a JSON object string (`'{"num_cpus": 2}'`), whose
        string values "true"/"false" and numbers become booleans and numbers (transformers' rule for
        dict arguments given as JSON, which LF applies)."""
        if isinstance(value, str):
            if not value.strip().startswith("{"):
                raise ValueError('write a mapping or a JSON object string like \'{"address": "auto"}\'')
            try:
                return _typed_strings(json.loads(value))
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"not valid JSON ({err.msg}); write a mapping like {{address: auto}}"
                ) from None
        return value

    @field_validator("fp8_backend", mode="before")
    @classmethod
    def _fp8_backend(cls, value: object) -> object:
        names = {"te": "Transformer Engine", "msamp": "MS-AMP"}
        if value in names:
            raise ValueError(
                f"{value} ({names[value]}, LLaMA-Factory's FP8 backend through Accelerate) is not available in "
                "lmstack; use fp8_backend: auto or torchao"
            )
        return value

    @field_validator("optim")
    @classmethod
    def _known_optim(cls, value: str) -> str:
        if value in FAST_OPTIMS:
            return value
        allowed = optim_names()
        if value not in allowed:
            raise ValueError(f"allowed: {' | '.join(allowed)}{did_you_mean(value, allowed)}")
        return value

    @field_validator("lr_scheduler_kwargs", mode="before")
    @classmethod
    def _json_kwargs(cls, value: object) -> object:
        """transformers reads a JSON string (`--lr_scheduler_kwargs '{"min_lr_rate": 0.1}'`) as a dict."""
        if isinstance(value, str) and value.strip().startswith("{"):
            try:
                return json.loads(value)
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"not valid JSON ({err.msg}); write a mapping like {{min_lr_rate: 0.1}}"
                ) from None
        return value

    @field_validator("report_to", mode="before")
    @classmethod
    def _trackers(cls, value: object) -> str:
        return normalize_report_to(value)

    @model_validator(mode="after")
    def _scheduler_needs_its_kwargs(self) -> TrainingArgs:
        kwargs = self.lr_scheduler_kwargs or {}
        floors = [k for k in ("min_lr", "min_lr_rate") if k in kwargs]
        if self.lr_scheduler_type == "cosine_with_min_lr" and len(floors) != 1:
            raise ValueError(
                "lr_scheduler_type: cosine_with_min_lr needs exactly one floor in lr_scheduler_kwargs: "
                "add `lr_scheduler_kwargs: {min_lr_rate: 0.1}` (a fraction of learning_rate) or "
                "`lr_scheduler_kwargs: {min_lr: 1.0e-6}`" + (f"; got {kwargs}" if kwargs else "")
            )
        if self.lr_scheduler_type == "warmup_stable_decay" and "num_decay_steps" not in kwargs:
            raise ValueError(
                "lr_scheduler_type: warmup_stable_decay needs the length of its decay phase: add "
                "`lr_scheduler_kwargs: {num_decay_steps: N}` (optionally num_stable_steps; lmstack does not "
                "yet fill LF's default split)"
            )
        return self


class GeneratingArgs(Section):
    do_sample: bool = Field(True, description="Sample (true) or greedy (false).")
    temperature: float = Field(0.95, gt=0, description="Sampling temperature.")
    top_p: float = Field(0.7, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int = Field(50, ge=0, description="Top-k sampling.")
    num_beams: int = Field(1, gt=0, description="Beam count.")
    max_new_tokens: int = Field(1024, gt=0, description="Max generated tokens.")
    repetition_penalty: float = Field(1.0, gt=0, description="Repetition penalty.")
    skip_special_tokens: bool = Field(True, description="Drop special tokens from decoded text.")


class ExportArgs(Section):
    export_dir: str | None = Field(None, description="Where `lmstack export` writes the merged model.")
    export_size: float = Field(5, gt=0, description="Max GB per safetensors shard (fractions allowed).")
    export_device: Literal["cpu", "auto"] = Field("cpu", description="Device used for merging.")
    export_overwrite: bool = Field(False, description="Allow writing into a non-empty export_dir.")


SECTIONS: dict[str, type[Section]] = {
    "model": ModelArgs,
    "data": DataArgs,
    "finetuning": FinetuningArgs,
    "training": TrainingArgs,
    "generating": GeneratingArgs,
    "export": ExportArgs,
}


class Config(BaseModel):
    """The whole run: one section per group; `cfg.flat()` gives the user's flat view back."""

    model_config = ConfigDict(extra="forbid")
    model: ModelArgs
    data: DataArgs
    finetuning: FinetuningArgs
    training: TrainingArgs
    generating: GeneratingArgs
    export: ExportArgs

    def flat(self, redact: bool = True) -> dict:
        out: dict = {}
        for name in SECTIONS:
            for key, value in getattr(self, name).model_dump(mode="python").items():
                if isinstance(value, SecretStr):
                    value = "***" if redact else value.get_secret_value()
                out[key] = value
        return out


def field_owner() -> dict[str, str]:
    """flat field name -> section name (each flat name belongs to exactly one section)."""
    owners: dict[str, str] = {}
    for section, cls in SECTIONS.items():
        for key in cls.model_fields:
            assert key not in owners, f"field {key} defined twice"
            owners[key] = section
    return owners
