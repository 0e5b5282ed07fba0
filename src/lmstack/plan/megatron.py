"""The Megatron backend's contract: LLaMA-Factory's Megatron-Bridge fields (USE_MEGATRON_BRIDGE=1), LF's rules
on them, and the rules of lmstack's own backend (the HF <-> megatron-core mapping of
models/megatron_weights.py), as one pure function that reports every problem at once, each naming the field,
the value and the fix. `layout_fields` turns a planner layout (memory/parallel.py) into those fields.

LF's rules: stage pt or sft; finetuning_type full or lora; no quantization_bit; no deepspeed; every size
>= 1; TP x PP x CP x EP divides the world size; sequence_parallel needs TP > 1; recompute_granularity is
full or selective. The backend's own: a dense Qwen2 / Qwen3 / Llama model; TP divides the attention heads,
the KV groups and the vocabulary (no vocabulary padding); PP divides the layers. What the backend does not
do is refused by name: expert and context parallelism, a virtual pipeline, fp8 precision, a Megatron-format
checkpoint in, packed sequences, resuming and evaluation.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from lmstack.models.megatron_weights import FAMILIES, Shape

ENV = "USE_MEGATRON_BRIDGE=1"
STAGES = ("pt", "sft")
FINETUNING = ("full", "lora")
RECOMPUTE = (None, "full", "selective")
PRECISIONS = ("bf16_mixed", "fp16_mixed", "fp32")


@dataclass(frozen=True)
class MegatronFields:
    """LF's MegatronBridgeArguments, with LF's defaults."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    context_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    sequence_parallel: bool = False
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    account_for_embedding_in_pipeline_split: bool | None = None
    account_for_loss_in_pipeline_split: bool | None = None
    bias_activation_fusion: bool | None = None
    apply_rope_fusion: bool | None = None
    masked_softmax_fusion: bool | None = None
    cross_entropy_loss_fusion: bool | None = None
    moe_grouped_gemm: bool | None = None
    moe_token_dispatcher_type: str | None = None
    calculate_per_token_loss: bool | None = None
    use_distributed_optimizer: bool = True
    overlap_param_gather: bool = True
    overlap_grad_reduce: bool = True
    use_packed_sequences: bool = False
    mixed_precision: str = "bf16_mixed"
    megatron_pretrained_checkpoint: str | None = None
    export_hf_on_finish: bool = False
    extra_config: str | dict | None = None

    @classmethod
    def from_mapping(cls, values: dict) -> MegatronFields:
        """The Megatron fields of a flat LF config (other keys are left to the rest of the schema)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})

    @property
    def model_parallel(self) -> int:
        return (
            self.tensor_model_parallel_size
            * self.pipeline_model_parallel_size
            * self.context_parallel_size
            * self.expert_model_parallel_size
        )


# fields the backend does not do: (field, value that is accepted, what to do instead)
NOT_BUILT = (
    ("expert_model_parallel_size", 1, "the backend maps dense models only; set 1"),
    ("context_parallel_size", 1, "context parallelism is not built; set 1 and shorten cutoff_len"),
    ("virtual_pipeline_model_parallel_size", None, "the interleaved pipeline is not built; remove it"),
    ("use_packed_sequences", False, "packed Megatron sequences are not built; remove it"),
    ("megatron_pretrained_checkpoint", None, "the backend starts from the HF model_name_or_path; remove it"),
    ("moe_grouped_gemm", None, "the backend maps dense models only; remove it"),
    ("moe_token_dispatcher_type", None, "the backend maps dense models only; remove it"),
    ("extra_config", None, "dotted Megatron overrides are not read; set the LF fields instead"),
)


def _sizes(m: MegatronFields, world: int) -> list[str]:
    errs = []
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                 "expert_model_parallel_size", "context_parallel_size"):  # fmt: skip
        if getattr(m, name) < 1:
            errs.append(f"{name}: got {getattr(m, name)}; it must be >= 1")
    if errs:
        return errs
    if world % m.model_parallel:
        errs.append(
            f"tensor_model_parallel_size x pipeline_model_parallel_size x context_parallel_size x "
            f"expert_model_parallel_size = {m.tensor_model_parallel_size} x {m.pipeline_model_parallel_size} "
            f"x {m.context_parallel_size} x {m.expert_model_parallel_size} = {m.model_parallel} does not "
            f"divide the world size {world}; pick sizes whose product divides it"
        )
    if m.sequence_parallel and m.tensor_model_parallel_size == 1:
        errs.append("sequence_parallel: true needs tensor_model_parallel_size > 1; set it false")
    if m.recompute_granularity not in RECOMPUTE:
        errs.append(f"recompute_granularity: got {m.recompute_granularity!r}; allowed: full | selective")
    if m.mixed_precision not in PRECISIONS:
        errs.append(f"mixed_precision: got {m.mixed_precision!r}; allowed: {' | '.join(PRECISIONS)}")
    return errs


def _run(stage: str, finetuning_type: str, quantization_bit, deepspeed, resume: bool, do_eval: bool):
    errs = []
    if stage not in STAGES:
        errs.append(f"stage: got {stage!r}; {ENV} trains {' | '.join(STAGES)} only")
    if finetuning_type not in FINETUNING:
        errs.append(f"finetuning_type: got {finetuning_type!r}; {ENV} trains {' | '.join(FINETUNING)} only")
    if quantization_bit is not None:
        errs.append(f"quantization_bit: got {quantization_bit}; {ENV} does not quantize; remove it")
    if deepspeed:
        errs.append(f"deepspeed: got {deepspeed!r}; {ENV} shards with Megatron, not DeepSpeed; remove it")
    if resume:
        errs.append(f"resume_from_checkpoint: {ENV} does not resume (no Megatron checkpoints); remove it")
    if do_eval:
        errs.append(f"do_eval / eval_dataset: {ENV} does not evaluate; remove them")
    return errs


def _shape(m: MegatronFields, s: Shape | None, family: str | None) -> list[str]:
    errs = []
    if family is not None and family not in FAMILIES:
        errs.append(f"model_type: got {family!r}; {ENV} maps {' | '.join(FAMILIES)} (dense) only")
    if s is None:
        return errs
    tp, pp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size
    for what, n in (("num_attention_heads", s.heads), ("num_key_value_heads", s.groups),
                    ("vocab_size", s.vocab)):  # fmt: skip
        if tp >= 1 and n % tp:
            errs.append(f"tensor_model_parallel_size: got {tp}; it must divide the model's {what} {n}")
    if pp >= 1 and s.layers % pp:
        errs.append(f"pipeline_model_parallel_size: got {pp}; it must divide num_hidden_layers {s.layers}")
    return errs


def problems(
    m: MegatronFields, *, world: int, stage: str, finetuning_type: str, quantization_bit=None,
    deepspeed=None, resume: bool = False, do_eval: bool = False, shape: Shape | None = None,
    family: str | None = None,
) -> list[str]:  # fmt: skip
    """Every rule the Megatron fields of a run break (empty: the backend takes the run)."""
    errs = _sizes(m, world) + _run(stage, finetuning_type, quantization_bit, deepspeed, resume, do_eval)
    for name, ok, fix in NOT_BUILT:
        if getattr(m, name) != ok:
            errs.append(f"{name}: got {getattr(m, name)!r}; {fix}")
    return errs + _shape(m, shape, family)


def layout_fields(layout) -> dict:
    """The LF Megatron fields of a planner layout (memory/parallel.py's Layout)."""
    return {
        "tensor_model_parallel_size": layout.tp,
        "pipeline_model_parallel_size": layout.pp,
        "sequence_parallel": bool(layout.sequence_parallel and layout.tp > 1),
        "use_distributed_optimizer": bool(layout.distributed_optimizer),
        "recompute_granularity": layout.recompute,
    }


def shape_of_spec(spec) -> Shape:
    """The mapping's facts from the planner's ModelSpec (memory/model_spec.py)."""
    return Shape(
        layers=spec.num_layers, hidden=spec.hidden_size, heads=spec.num_heads, groups=spec.num_kv_heads,
        head_dim=spec.head_dim, ffn=spec.intermediate_size, vocab=spec.vocab_size, eps=1e-6,
        rope_theta=10000.0, qkv_bias=spec.model_type == "qwen2", qk_norm=spec.model_type == "qwen3",
        tied=spec.tie_word_embeddings,
    )  # fmt: skip
