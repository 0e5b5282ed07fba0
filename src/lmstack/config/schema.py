"""Typed configuration. Users write flat LLaMA-Factory field names; internally they are grouped into
sections. Defaults live here and only here, so no reader can disagree with another about one."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from lmstack.config.schema_base import Section, leaf_types
from lmstack.config.schema_finetuning import FinetuningArgs
from lmstack.config.schema_training import (
    ADAMW_OPTIMS,
    FAST_OPTIMS,
    TRACKERS,
    TRACKERS_LATER,
    TrainingArgs,
    normalize_report_to,
    optim_names,
)

__all__ = [  # the sections and names other modules import from here (each defined in its own module)
    "ADAMW_OPTIMS",
    "FAST_OPTIMS",
    "SECTIONS",
    "TRACKERS",
    "TRACKERS_LATER",
    "Config",
    "DataArgs",
    "ExportArgs",
    "FinetuningArgs",
    "GeneratingArgs",
    "ModelArgs",
    "Section",
    "TrainingArgs",
    "field_owner",
    "leaf_types",
    "normalize_report_to",
    "optim_names",
]


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
