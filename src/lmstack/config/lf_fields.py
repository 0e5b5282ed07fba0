"""Every LLaMA-Factory field lmstack's schema does not define, as data, so that every LF field is known:
a YAML written for LF is either run or refused by name, never silently ignored.

Each entry is one of
- `default`: accepted when its value is LF's default and that default is what lmstack already does
  (`use_kt: false`); any other value is refused, naming the value;
- `refused`: any value is refused: the field only configures a feature lmstack does not have.
Both refusals read "LLaMA-Factory's `<field>` (<feature>) is not available in lmstack; remove it".

Sources: LF's own dataclasses (copied as tests/unit/config/LF_FIELDS.md, §1-§5) and the transformers
TrainingArguments fields LF passes to the Trainer (§6 and the rest of transformers' dataclass). The LF
fields lmstack implements live in schema.py and never appear here (tests/unit/config/test_lf_fields.py).
"""

from __future__ import annotations

from typing import Any, NamedTuple

DEFAULT = "default"
REFUSED = "refused"


class LFField(NamedTuple):
    kind: str  # DEFAULT | REFUSED
    feature: str  # what the field switches on, in a few words
    lf_default: Any  # LF's default (the one value a DEFAULT field accepts)
    hint: str = ""  # what to use in lmstack instead, if anything


def D(feature: str, lf_default: Any, hint: str = "") -> LFField:  # noqa: N802 (table shorthand)
    return LFField(DEFAULT, feature, lf_default, hint)


def R(feature: str, lf_default: Any = None, hint: str = "") -> LFField:  # noqa: N802
    return LFField(REFUSED, feature, lf_default, hint)


KT = "KTransformers CPU/AMX offload of MoE experts"
PROF = "the torch profiler"
OLD_RAY = "an older LLaMA-Factory Ray Train option, for where Ray keeps its own run records"
OLD_RAY_HINT = "USE_RAY=1 writes the run to output_dir; Ray's records go to a temporary folder"
SWAN = "SwanLab's Lark (Feishu) notifications"
EVAL = "`llamafactory-cli eval` multiple-choice benchmarks: MMLU, CMMLU, C-Eval"
MEGA = "the Megatron Bridge backend, USE_MEGATRON_BRIDGE=1"
DERIVED = "derived by LF from other fields, not a config key in LF either"
HF = "transformers TrainingArguments option that LF passes to the Trainer"
HUB = "pushing to the Hugging Face Hub from the Trainer"
TRACKIO_SPACE = "trackio logging to a Hugging Face Space (lmstack logs trackio runs locally)"

LF_FIELDS: dict[str, LFField] = {
    # ---- §1.1 BaseModelArguments ----
    "adapter_folder": D("adapter files in a sub-folder of adapter_name_or_path", None),
    "add_tokens": D("adding ordinary tokens to the tokenizer", None),
    "add_special_tokens": D("adding special tokens to the tokenizer", None),
    "new_special_tokens_config": D("new special tokens initialised from descriptions", None),
    "init_special_tokens": D("description-based init of new token embeddings", "noise_init"),
    "rope_scaling": D("RoPE scaling for a longer context", None),
    "shift_attn": D("LongLoRA shifted sparse attention", False),
    "mixture_of_depths": D("Mixture-of-Depths conversion", None),
    "moe_aux_loss_coef": D("a MoE router auxiliary-loss weight", None),
    "upcast_lmhead_output": D("fp32 output-head logits", False),
    "offload_folder": D("a disk offload folder for an automatic device map", "offload"),
    "use_kv_cache": D("generation without the KV cache", True),
    "use_v1_kernels": D("LF v1 kernel plugins, e.g. fused Ascend NPU ops", False),
    "ms_hub_token": D("ModelScope hub downloads", None),
    "om_hub_token": D("Modelers / openMind hub downloads", None),
    # ---- §1.2 QuantizationArguments ----
    "quantization_method": D("quantization backends other than bitsandbytes", "bnb"),
    "quantization_device_map": D("an automatic device map for a 4-bit model at inference", None),
    # ---- §1.3 ProcessorArguments ----
    "use_audio_in_video": R(
        "the audio track of videos (Qwen2.5-Omni / Qwen3-Omni, not built in lmstack)", False
    ),
    # ---- §1.4 ExportArguments ----
    "export_quantization_bit": D("GPTQ quantization at export", None),
    "export_quantization_dataset": D("GPTQ quantization at export", None),
    "export_quantization_nsamples": R("GPTQ quantization at export", 128),
    "export_quantization_maxlen": R("GPTQ quantization at export", 1024),
    "export_legacy_format": D(".bin weights at export", False),
    "export_hub_model_id": D("pushing the export to the Hugging Face Hub", None),
    # ---- §1.7 KTransformersArguments (+ the runtime kt_config) ----
    "use_kt": D(KT, False),
    "kt_cpu_activation": R(KT),
    "kt_weight_path": R(KT),
    "kt_non_expert_weight_path": R(KT),
    "kt_expert_checkpoint_path": R(KT),
    "kt_use_lora_experts": R(KT),
    "kt_lora_expert_num": R(KT),
    "kt_lora_expert_intermediate_size": R(KT),
    "kt_config": R(KT),
    # ---- §1.8 ModelArguments derived fields (init=False in LF) ----
    "compute_dtype": R(DERIVED, hint="bf16 / fp16 / pure_bf16 decide the compute dtype"),
    "device_map": R(DERIVED, hint="lmstack places the model from the launch (torchrun ranks)"),
    "model_max_length": R(DERIVED, hint="cutoff_len sets it"),
    "block_diag_attn": R(DERIVED, False, hint="neat_packing / packing give block-diagonal attention"),
    # ---- §2 DataArguments ----
    "media_dir": D("a separate folder for images/videos/audio", None),
    "eval_num_beams": D("a beam count for generation at evaluation", None),
    "eval_on_each_dataset": D("separate metrics per evaluation dataset", False),
    "tool_format": D("overriding the template's tool-call format", None),
    "data_shared_file_system": D("data prepared once for all nodes on a shared file system", False),
    # ---- §3.4 RLHFArguments ----
    "pref_bco_weight": D("an added BCO loss term in DPO", 0.0),
    "ref_model_quantization_bit": D("a quantized reference model", None),
    "reward_model_quantization_bit": D("a quantized reward model", None),
    "ld_alpha": D("LD-DPO length desensitisation", None),
    # ---- §3.8 SwanLabArguments ----
    "swanlab_lark_webhook_url": R(SWAN),
    "swanlab_lark_secret": R(SWAN),
    # ---- §3.9 FinetuningArguments own fields ----
    "use_mca": D("the Megatron-Core adapter backend, USE_MCA=1", False),
    "use_megatron_bridge": D(MEGA, False),
    "use_hyper_parallel": D("the HyperParallel FSDP/TP backend", False),
    "hyper_parallel_args": D("the HyperParallel FSDP/TP backend", None),
    "hyper_parallel_cp_size": R("the HyperParallel FSDP/TP backend", 1),
    "megatron_bridge_args": R(DERIVED),
    # ---- §4 GeneratingArguments ----
    "max_length": D("a total-length generation cap; LF drops it when max_new_tokens > 0", 1024),
    "length_penalty": D("a beam-search length penalty", 1.0),
    # ---- §5 RayArguments of older LF releases (its TorchTrainer launch); today's four are in schema.py ----
    "ray_run_name": R(OLD_RAY, hint=OLD_RAY_HINT),
    "ray_storage_path": R(OLD_RAY, "./saves", hint=OLD_RAY_HINT),
    "ray_storage_filesystem": R(OLD_RAY, hint=OLD_RAY_HINT),
    "resources_per_worker": R(
        OLD_RAY, {"GPU": 1}, hint="USE_RAY=1 gives each worker one GPU, or one CPU on a CPU cluster"
    ),
    "placement_strategy": D("Ray Train placement strategies other than PACK", "PACK"),
    # ---- §5 ProfilerArguments ----
    "enable_torch_profiler": D(PROF, False),
    "profiler_output_dir": R(PROF),
    "profiler_wait_steps": R(PROF, 1),
    "profiler_warmup_steps": R(PROF, 1),
    "profiler_active_steps": R(PROF, 1),
    "profiler_repeat": R(PROF, 1),
    "profiler_record_shapes": R(PROF, True),
    "profiler_profile_memory": R(PROF, True),
    "profiler_with_stack": R(PROF, True),
    "profile_modules": D("per-module CUDA-event timing", None),
    # ---- §5 EvaluationArguments (`seed` is shared with training) ----
    "task": R(EVAL),
    "task_dir": R(EVAL, "evaluation"),
    "batch_size": R(EVAL, 4, hint="training batches are per_device_train_batch_size"),
    "lang": R(EVAL, "en"),
    "n_shot": R(EVAL, 5),
    "save_dir": R(EVAL),
    "download_mode": R(EVAL, "reuse_dataset_if_exists"),
    # ---- §5 MegatronBridgeArguments ----
    "tensor_model_parallel_size": R(MEGA, 1),
    "pipeline_model_parallel_size": R(MEGA, 1),
    "expert_model_parallel_size": R(MEGA, 1),
    "context_parallel_size": R(MEGA, 1),
    "virtual_pipeline_model_parallel_size": R(MEGA),
    "sequence_parallel": R(MEGA, False),
    "recompute_granularity": R(MEGA),
    "recompute_method": R(MEGA),
    "recompute_num_layers": R(MEGA),
    "account_for_embedding_in_pipeline_split": R(MEGA),
    "account_for_loss_in_pipeline_split": R(MEGA),
    "bias_activation_fusion": R(MEGA),
    "apply_rope_fusion": R(MEGA),
    "masked_softmax_fusion": R(MEGA),
    "cross_entropy_loss_fusion": R(MEGA),
    "moe_grouped_gemm": R(MEGA),
    "moe_token_dispatcher_type": R(MEGA),
    "calculate_per_token_loss": R(MEGA),
    "use_distributed_optimizer": R(MEGA, True),
    "overlap_param_gather": R(MEGA, True),
    "overlap_grad_reduce": R(MEGA, True),
    "use_packed_sequences": R(MEGA, False),
    "mixed_precision": R(MEGA, "bf16_mixed", hint="bf16 / fp16 / pure_bf16 set the precision"),
    "megatron_pretrained_checkpoint": R(MEGA),
    "export_hf_on_finish": R(MEGA, False),
    "extra_config": R(MEGA),
    # ---- §6 and the rest of transformers' (Seq2Seq)TrainingArguments, as LF passes them on ----
    "fsdp_transformer_layer_cls_to_wrap": R(
        "a transformers v4 FSDP option, gone in v5",
        hint="fsdp_config: {transformer_layer_cls_to_wrap: [...]}",
    ),
    "generation_max_length": D("a generation length for predict/eval", None),
    "generation_num_beams": D("a beam count for predict/eval", None),
    "generation_config": D("a generation config file for predict/eval", None),
    "remove_unused_columns": D("dropping dataset columns; LF forces false", False),
    "label_names": D(HF, None),
    "include_num_input_tokens_seen": R(
        HF, "no", hint="num_input_tokens_seen (non-padding tokens) is always logged"
    ),
    "trackio_space_id": D(TRACKIO_SPACE, None),
    "trackio_bucket_id": D(TRACKIO_SPACE, None),
    "trackio_static_space_id": D(TRACKIO_SPACE, None),
    "save_safetensors": D(".bin checkpoints, transformers v4", True),
    "push_to_hub": D(HUB, False),
    "hub_token": D(HUB, None),
    "hub_private_repo": D(HUB, None),
    "hub_model_id": D(HUB, None),
    "hub_strategy": D(HUB, "every_save"),
    "hub_always_push": D(HUB, False),
    "hub_revision": D(HUB, None),
    "optim_args": D("extra optimizer arguments", None),
    "optim_target_modules": D("optimizer target modules", None, hint="galore_target / apollo_target"),
    "average_tokens_across_devices": D(HF, True),
    "label_smoothing_factor": D("label smoothing", 0.0),
    "bf16_full_eval": D("bf16 weights at evaluation", False),
    "fp16_full_eval": D("fp16 weights at evaluation", False),
    "tf32": D("TF32 matmuls", None),
    "activation_checkpointing": D(
        "the Trainer's activation checkpointing", None, hint="gradient_checkpointing"
    ),
    "activation_checkpointing_kwargs": D("the Trainer's activation checkpointing", None),
    "torch_compile_mode": D("a torch.compile mode", None),
    "use_liger_kernel": D("transformers' Liger switch", False, hint="enable_liger_kernel: true"),
    "liger_kernel_config": D("Liger kernel options", None),
    "use_cache": D("the KV cache during training", False),
    "neftune_noise_alpha": D("NEFTune embedding noise", None),
    "torch_empty_cache_steps": D("emptying the CUDA cache every N steps", None),
    "auto_find_batch_size": D(
        "batch-size search on OOM", False, hint="per_device_train_batch_size: auto (the planner picks it)"
    ),
    "logging_strategy": D("logging per epoch or never", "steps", hint="logging_steps"),
    "logging_first_step": D("logging the first step", False),
    "log_on_each_node": D(HF, True),
    "logging_nan_inf_filter": R(HF, True, hint="NaN/Inf losses are logged as they are; see on_nonfinite"),
    "log_level": D("transformers' log level", "passive", hint="lmstack -v"),
    "log_level_replica": D("transformers' log level on replicas", "warning"),
    "eval_delay": D("delayed first evaluation", 0),
    "prediction_loss_only": D(HF, False),
    "eval_on_start": D("an evaluation before training", False),
    "eval_do_concat_batches": D(HF, True),
    "eval_use_gather_object": D(HF, False),
    "eval_accumulation_steps": D(HF, None),
    "include_for_metrics": D("extra inputs for compute_metrics", []),
    "batch_eval_metrics": D("batched compute_metrics", False),
    "save_on_each_node": D("checkpoints saved on every node", False),
    "enable_jit_checkpoint": D(
        "a Trainer checkpoint on SIGTERM", False, hint="lmstack saves on SIGTERM/SIGINT itself"
    ),
    "ignore_data_skip": D(HF, False),
    "restore_callback_states_from_checkpoint": D(HF, False),
    "full_determinism": D("fully deterministic kernels", False),
    "data_seed": D("a data-order seed separate from seed", None),
    "accelerator_config": D("Accelerate options through the Trainer", None),
    "parallelism_config": D("Accelerate N-D parallelism", None),
    "dataloader_drop_last": D(HF, False),
    "dataloader_pin_memory": D(HF, True),
    "dataloader_persistent_workers": D(HF, False),
    "dataloader_prefetch_factor": D(HF, None),
    "dataloader_multiprocessing_context": D(HF, None),
    "dataloader_in_order": D(HF, True),
    "train_sampling_strategy": D("the train sampler", "random", hint="disable_shuffling: true"),
    "length_column_name": D("length-grouped sampling", "length"),
    "ddp_bucket_cap_mb": D(HF, None),
    "ddp_broadcast_buffers": D(HF, None),
    "ddp_static_graph": D(HF, None),
    "ddp_backend": D("a DDP backend other than the default", None),
    "debug": D("transformers' debug options", ""),
    "skip_memory_metrics": D("memory metrics", True),
    "local_rank": D("a launcher-given local rank", -1, hint="torchrun/accelerate set LOCAL_RANK"),
    "sortish_sampler": D("length-sorted sampling", False),
}

# LF's v1 configs (examples/v1/, `model:` holding a model id, nested plugin blocks): keys that never
# occur in LF's flat v0 YAML.
V1_KEYS = frozenset(
    """model model_class init_config peft_config kernel_config quant_config dist_config train_dataset
    micro_batch_size global_batch_size sample_backend""".split()
)


def _same(a: Any, b: Any) -> bool:
    """LF-default equality without Python's True == 1 / False == 0."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    return type(a) is type(b) and a == b


def _word(value: Any) -> str:
    """A value as the user writes it in YAML: true / null / 0.7 / huggingface."""
    from lmstack.config.errors import short

    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return value if isinstance(value, str) and len(value) <= 80 else short(value, 80)


def refusal(name: str, value: Any) -> str | None:
    """None when `name: value` is accepted (a DEFAULT field at LF's default); else the message."""
    from lmstack.config.secrets import SECRET_NAME

    entry = LF_FIELDS[name]
    if entry.kind == DEFAULT and _same(value, entry.lf_default):
        return None
    hint = f"; in lmstack: {entry.hint}" if entry.hint else ""
    if entry.kind == REFUSED:
        return (
            f"{name}: LLaMA-Factory's `{name}` ({entry.feature}) is not available in lmstack; remove it{hint}"
        )
    shown = "***" if SECRET_NAME.search(name) else _word(value)
    return (
        f"{name}: LLaMA-Factory's `{name}: {shown}` ({entry.feature}) is not available in lmstack; remove it "
        f"(LF's default `{name}: {_word(entry.lf_default)}` is what lmstack does){hint}"
    )
