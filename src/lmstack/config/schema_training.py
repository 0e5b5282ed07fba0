"""The training section of the config (TrainingArguments' fields and lmstack's own run settings), with
the optimizer and tracker names it accepts."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator

from lmstack.config.errors import did_you_mean
from lmstack.config.schema_base import Section, _typed_strings

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
