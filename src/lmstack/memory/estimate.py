"""Compose the formula functions of ``memory.py`` into one per-GPU estimate for one setup."""

from __future__ import annotations

from dataclasses import dataclass

from lmstack.memory import fp8_estimate
from lmstack.memory import memory as mem
from lmstack.memory.model_spec import ModelSpec

FINETUNING_TYPES = ("full", "freeze", "lora")
OPTIMIZERS = ("adamw", "galore", "apollo", "badam", "muon")  # use_galore | use_apollo | use_badam | use_muon
ATTENTIONS = ("flash", "sdpa", "eager")
# lm: the causal-LM loss (HF / Liger / lmstack's chunked CE); trl_logprob: TRL's fused log-prob head;
# full_logits: [tokens x vocab] logits + fp32 log-softmax (ORPO/CPO, lmstack's PPO); full_logits_no_nll:
# the same without the NLL term over the chosen half (SimPO, pref_ftx 0); value_head: rm
LOSS_PATHS = ("lm", "trl_logprob", "full_logits", "full_logits_no_nll", "value_head")
REFERENCES = ("none", "adapter_off", "copy")
FSDP_SHARDING = {"FULL_SHARD": 3, "SHARD_GRAD_OP": 2}  # FSDP mode -> equivalent ZeRO stage


@dataclass(frozen=True)
class Setup:
    """One concrete training setup (everything decided; nothing left to search)."""

    finetuning_type: str = "full"
    lora_rank: int = 8
    lora_target: str | tuple[str, ...] = "all"
    quantization_bit: int | None = None
    pure_bf16: bool = False
    freeze_trainable_layers: int = 2
    # use_llama_pro (freeze): the freeze_trainable_layers = k trained layers are the expanded blocks, every
    # (N / k)-th layer, the last one included (models/adapters.llama_pro_layers)
    llama_pro: bool = False
    # freeze_extra_modules (freeze): the non-layer modules trained besides the layers, as LF names them
    # (models/adapters.apply_freeze); the planner sizes embed_tokens, lm_head and norm (freeze_extra_params)
    freeze_extra_modules: tuple[str, ...] = ()
    num_gpus: int = 1
    nodes: int = 1
    deepspeed_stage: int | None = None
    offload_optimizer: bool = False
    offload_param: bool = False
    fsdp: str | None = None  # None | "FULL_SHARD" | "SHARD_GRAD_OP"
    micro_batch: int = 1
    # rows one optimizer step sees per GPU (micro_batch x gradient_accumulation_steps); 0: micro_batch. Above
    # micro_batch, the gradients of earlier micro-batches stay alive through the next forward.
    optimizer_batch: int = 0
    seq_len: int = 2048
    gradient_checkpointing: bool = False
    checkpoint_offload: bool = False  # use_unsloth_gc: the checkpointed layer inputs wait in CPU RAM
    checkpoint_layers: int | None = (
        None  # with checkpointing: the first k decoder layers recompute; None = all
    )
    attention: str = "sdpa"
    fused_ce: bool = False
    optimizer: str = "adamw"  # OPTIMIZERS
    # torch's multi-tensor AdamW (optim: adamw_torch): its step holds sqrt(exp_avg_sq) for every parameter at
    # once (memory.FOREACH_ADAM_TEMP_BYTES); the fused kernel (adamw_torch_fused) holds none. Under ZeRO/FSDP
    # the same optimizer steps its partition: not modelled (the recorded ZeRO runs peak elsewhere)
    adam_foreach: bool = False
    optimizer_rank: int = 16  # galore_rank / apollo_rank
    liger: bool | None = None  # Liger's kernel set (RMSNorm/SwiGLU/RoPE); None = same as fused_ce
    # classic AMP: fp32 weights in the model (master_weights: model); else bf16 compute weights with
    # the fp32 masters in the optimizer (master_weights: optimizer, DeepSpeed, FSDP MixedPrecision)
    fp32_model_weights: bool = False
    fp32_adapters: bool = False  # PEFT's default fp32 LoRA weights (lmstack casts them to a bf16 base)
    # --- the stage (plan/stage_memory.py): which rows, loss path and extra models the trainer has
    stage: str = "sft"
    rows_per_example: int = 1  # 2: chosen + rejected concatenated in one batch (dpo, orpo, simpo, rm)
    loss_path: str = "lm"  # LOSS_PATHS
    reference: str = "none"  # REFERENCES: "adapter_off" (LoRA, no copy) | "copy" (a frozen model)
    kl_batch: bool = False  # kto: a no-grad forward over the mismatched (prompt, answer) KL batch
    generated_rows: int = 0  # grpo/rloo/ppo: sequences sampled at once (KV cache rows)
    prompt_len: int = 0  # grpo/rloo/ppo: prompt tokens; seq_len = prompt_len + completion tokens
    reward_model_params: int = 0  # ppo: a separate reward model held in bf16
    packed: bool = True  # rows of one width (packing): the smaller fragmentation margin
    expandable_segments: bool = False  # plan.allocator: the caching allocator grows segments in place
    # fp8: true (plan.fp8.scope, plan/fp8_estimate.py): "frozen-base" (LoRA: the frozen base's Linear layers
    # stored in FP8) | "float8-training" (full: torchao's Float8Linear) | None (bf16 GEMMs)
    fp8: str | None = None

    @property
    def classic_amp(self) -> bool:
        """fp32 weights in the model (master_weights: model): the whole model, frozen layers included, is fp32
        and so is its residual stream; LoRA keeps its base in bf16 whatever the scheme."""
        return self.fp32_model_weights and self.finetuning_type != "lora"


@dataclass(frozen=True)
class Estimate:
    gpu: mem.MemoryBreakdown
    cpu_gib: float  # CPU memory per node for offloaded states and activations (0 without offload)
    offloaded_activations_gib: float = 0.0  # of which: offloaded checkpointing's layer inputs, per node
    weight_rows: tuple[tuple[str, float], ...] = ()  # the weights split by storage (FP8 / bf16), GiB per GPU


@dataclass
class _States:
    """Per-GPU bytes by category; ``cpu`` collects what offload moves off the GPU."""

    weights: float = 0.0
    grads: float = 0.0
    optim: float = 0.0
    adapters: float = 0.0
    cpu: float = 0.0
    fp8_weights: float = 0.0  # of `weights`: the FP8 frozen base layers (1 B/param + fp32 row scales)


def validate_setup(s: Setup) -> None:
    """Raise ValueError naming the field, the value and the allowed values."""
    if s.finetuning_type not in FINETUNING_TYPES:
        raise ValueError(
            f"finetuning_type: got {s.finetuning_type!r}; allowed: {' | '.join(FINETUNING_TYPES)}"
        )
    if s.attention not in ATTENTIONS:
        raise ValueError(f"attention: got {s.attention!r}; allowed: {' | '.join(ATTENTIONS)}")
    if s.deepspeed_stage not in (None, 0, 1, 2, 3):
        raise ValueError(f"deepspeed stage: got {s.deepspeed_stage!r}; allowed: 0 | 1 | 2 | 3 | null")
    if s.fsdp is not None and s.fsdp not in FSDP_SHARDING:
        raise ValueError(f"fsdp: got {s.fsdp!r}; allowed: {' | '.join(FSDP_SHARDING)} | null")
    if s.fsdp is not None and s.deepspeed_stage is not None:
        raise ValueError("fsdp and deepspeed: both set; pick one (remove `deepspeed:` to use FSDP)")
    if s.quantization_bit is not None and s.finetuning_type != "lora":
        raise ValueError(
            f"quantization_bit: got {s.quantization_bit} with finetuning_type {s.finetuning_type!r}; "
            "quantized training needs finetuning_type: lora (QLoRA)"
        )
    if s.optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer: got {s.optimizer!r}; allowed: {' | '.join(OPTIMIZERS)}")
    if s.optimizer != "adamw" and s.finetuning_type == "lora":
        raise ValueError(f"use_{s.optimizer}: a full-parameter optimizer, not for finetuning_type: lora")
    if s.offload_param and s.deepspeed_stage != 3:
        raise ValueError("offload_param: needs deepspeed stage 3 (parameter offload is a ZeRO-3 feature)")
    if s.offload_optimizer and not s.deepspeed_stage:
        raise ValueError("offload_optimizer: needs deepspeed stage 1, 2 or 3")
    if s.loss_path not in LOSS_PATHS:
        raise ValueError(f"loss_path: got {s.loss_path!r}; allowed: {' | '.join(LOSS_PATHS)}")
    if s.reference not in REFERENCES:
        raise ValueError(f"reference: got {s.reference!r}; allowed: {' | '.join(REFERENCES)}")
    if s.rows_per_example < 1:
        raise ValueError(f"rows_per_example: got {s.rows_per_example}; must be >= 1")
    if s.fp8 is not None:
        from lmstack.memory.fp8_rules import SCOPES

        if s.fp8 not in SCOPES:
            raise ValueError(f"fp8: got {s.fp8!r}; allowed: {' | '.join(SCOPES)} | null")
        if s.fp8 == "frozen-base" and s.finetuning_type != "lora":
            raise ValueError(
                f"fp8: frozen-base is LoRA's FP8 base; got finetuning_type {s.finetuning_type!r}"
            )
    if s.checkpoint_offload and not s.gradient_checkpointing:
        raise ValueError(
            "checkpoint_offload: offloads the checkpointed layer inputs; needs gradient_checkpointing"
        )
    if s.checkpoint_layers is not None and (not s.gradient_checkpointing or s.checkpoint_layers < 1):
        raise ValueError(
            f"checkpoint_layers: got {s.checkpoint_layers}; needs gradient_checkpointing and at least 1 layer"
        )
    if s.num_gpus < 1 or s.micro_batch < 1 or s.seq_len < 1 or s.nodes < 1:
        raise ValueError("num_gpus, nodes, micro_batch and seq_len must all be >= 1")


def _trainable_frozen(spec: ModelSpec, s: Setup) -> tuple[int, int, int]:
    """(trainable base params, frozen base params, adapter params)."""
    if s.finetuning_type == "full":
        return spec.num_params, 0, 0
    if s.finetuning_type == "freeze":
        # LF's freeze_trainable_layers: k > 0 trains the last k layers, -k the first k
        trainable = spec.layer_params * min(abs(s.freeze_trainable_layers), spec.num_layers)
        trainable += freeze_extra_params(spec, s)
        return trainable, spec.num_params - trainable, 0
    target = s.lora_target if isinstance(s.lora_target, str) else list(s.lora_target)
    return 0, spec.num_params, spec.lora_params(s.lora_rank, target)


def freeze_extra_params(spec: ModelSpec, s: Setup) -> int:
    """The parameters freeze_extra_modules trains (apply_freeze matches module names; a tied head is the
    embedding's one tensor, listed once under embed_tokens, so `lm_head` alone trains nothing there): the
    embedding, the untied head, the final norm (h). Other names are not sized (PlanRequest.unmodelled)."""
    if s.finetuning_type != "freeze":
        return 0
    extra = set(s.freeze_extra_modules)
    params = spec.embed_params if "embed_tokens" in extra else 0
    if "lm_head" in extra and not spec.tie_word_embeddings:
        params += spec.lm_head_params
    return params + (spec.hidden_size if "norm" in extra else 0)


def _freeze_trains_embedding(s: Setup) -> bool:
    """A trained embedding puts every decoder layer on the backward's path (each one records its graph)."""
    return s.finetuning_type == "freeze" and "embed_tokens" in s.freeze_extra_modules


def head_trainable(spec: ModelSpec, s: Setup) -> bool:
    """The output head trains: a full fine-tune, or freeze-tuning that trains it (lm_head untied, or the tied
    embedding)."""
    if s.finetuning_type == "full":
        return True
    extra = set(s.freeze_extra_modules) if s.finetuning_type == "freeze" else set()
    return ("lm_head" in extra and not spec.tie_word_embeddings) or (
        "embed_tokens" in extra and spec.tie_word_embeddings
    )


def _unsharded(s: Setup) -> bool:
    """No ZeRO partitioning (stage 0 or none) and no FSDP: every rank holds whole states and one optimizer."""
    return s.deepspeed_stage in (None, 0) and s.fsdp is None


def _fp8_base(s: Setup) -> bool:
    """The frozen base is stored in FP8 (a quantized base, refused with fp8, keeps its own storage)."""
    return s.fp8 == "frozen-base" and s.finetuning_type == "lora" and s.quantization_bit is None


def _frozen_weight_bytes(spec: ModelSpec, frozen: int, s: Setup) -> float:
    if _fp8_base(s):
        return sum(fp8_estimate.frozen_weight_bytes(spec))
    if s.quantization_bit is None or s.finetuning_type != "lora":
        # classic AMP loads the whole model in fp32 and freeze-tuning casts nothing back (models/adapters.py)
        return (mem.FP32_BYTES if s.classic_amp else mem.BF16_BYTES) * frozen
    linear = spec.linear_params
    return mem.quantized_weight_bytes(linear, spec.num_params - linear, s.quantization_bit)


def _optimizer_states(spec: ModelSpec, s: Setup, trainable: int, k: int) -> tuple[float, float]:
    """(grad bytes, optimizer bytes) of the memory-saving optimizers, before partitioning.

    GaLore/APOLLO: master copy for all + projected moments for the linear matrices (low_rank_state_elements);
    Muon: master + one momentum for the linear matrices, Adam m+v for the rest; BAdam: only the active
    block (one decoder layer) has grads, an fp32 copy and Adam m+v (weights stay bf16).
    """
    if s.optimizer == "badam":
        block = min(spec.layer_params, trainable)
        return mem.BF16_BYTES * block, (mem.FP32_BYTES + 2 * mem.FP32_BYTES) * block
    moments = 2 * mem.FP32_BYTES if k == mem.ADAM_K_MIXED else 2 * mem.BF16_BYTES
    master, element = k - moments, moments // 2
    share = trainable / max(spec.num_params, 1)  # freeze-tuning: the trainable share of the matrices
    linear = spec.linear_params * share
    if s.optimizer == "muon":
        projected = mem.MUON_STATES * linear
    else:
        projected = share * sum(
            g.count * mem.low_rank_state_elements(*_matrix_shape(g), s.optimizer_rank)
            for g in spec.linear_groups
        )
    optim = master * trainable + moments * (trainable - linear) + element * projected
    return mem.BF16_BYTES * trainable, optim


def _matrix_shape(group) -> tuple[int, int]:
    """(rows, cols) of one matrix of a LinearGroup from its sums of in*out and in+out."""
    product, total = group.weight_params / group.count, group.in_plus_out / group.count
    small = (total - max(total * total - 4 * product, 0.0) ** 0.5) / 2
    return round(small), round(total - small)


def model_states(spec: ModelSpec, s: Setup) -> _States:
    """Weights/grads/optimizer/adapters per GPU after ZeRO/FSDP partitioning and offload."""
    trainable, frozen, adapter = _trainable_frozen(spec, s)
    stage = FSDP_SHARDING[s.fsdp] if s.fsdp else (s.deepspeed_stage or 0)
    deepspeed = s.deepspeed_stage is not None and s.deepspeed_stage > 0
    # DeepSpeed's bf16 optimizer keeps fp32 master weights whatever pure_bf16 says.
    k = mem.ADAM_K_PURE_BF16 if (s.pure_bf16 and not deepspeed) else mem.ADAM_K_MIXED
    n = s.num_gpus
    st = _States()
    w_train = mem.BF16_BYTES * trainable
    w_frozen = _frozen_weight_bytes(spec, frozen, s)
    w_fp8 = fp8_estimate.frozen_weight_bytes(spec)[0] if _fp8_base(s) else 0.0  # of w_frozen
    grads = mem.BF16_BYTES * trainable
    fp32_grads = mem.DS_FP32_GRAD_PARTITION_BYTES * trainable if deepspeed else 0.0
    optim = k * trainable
    if s.optimizer != "adamw":
        grads, optim = _optimizer_states(spec, s, trainable, k)
    ad_w, ad_g, ad_o = (
        adapter * b for b in (mem.ADAPTER_WEIGHT_BYTES, mem.ADAPTER_GRAD_BYTES, mem.ADAPTER_OPTIM_BYTES)
    )
    if stage >= 1:
        optim, fp32_grads, ad_o = optim / n, fp32_grads / n, ad_o / n
    if stage >= 2:
        ad_g /= n
        if not deepspeed:  # FSDP SHARD_GRAD_OP / FULL_SHARD shard the bf16 grads
            grads /= n
    live = 0.0
    if stage >= 3:
        w_train, w_frozen, ad_w, w_fp8 = w_train / n, w_frozen / n, ad_w / n, w_fp8 / n
        live = mem.ZERO3_LIVE_GATHER_BYTES * spec.largest_layer_params
        if deepspeed:  # ZeRO-3 reduces grads straight into the fp32 partition
            grads = 0.0
    if s.offload_optimizer:
        st.cpu += optim + fp32_grads + ad_o
        if stage <= 2:
            st.cpu += grads
        optim = fp32_grads = ad_o = grads = 0.0
    if s.offload_param:
        st.cpu += w_train + w_frozen
        w_train = w_frozen = w_fp8 = 0.0
    if s.classic_amp and stage == 0 and not s.offload_optimizer:
        # classic AMP: fp32 weights (4 B) and grads (4 B), Adam m+v (8 B) -- the same 16 B, split so
        w_train, grads, optim = 2 * w_train, 2 * grads, optim - mem.FP32_BYTES * trainable
    if n > 1 and stage == 0:  # DDP's gradient buckets: a second copy of the gradients
        grads *= 2
    st.weights = w_train + w_frozen + live
    st.fp8_weights = w_fp8
    st.grads = grads + fp32_grads
    st.optim = optim
    st.adapters = ad_w + ad_g + ad_o
    return st


def cpu_bytes_per_node(st: _States, s: Setup) -> float:
    """Offloaded bytes of every local rank, times DeepSpeed's 1.5 buffer factor."""
    if not st.cpu:
        return 0.0
    per_node = st.cpu * max(s.num_gpus // s.nodes, 1) * mem.DS_CPU_BUFFER_FACTOR
    return per_node


def _liger(s: Setup) -> bool:
    """Liger's kernel set is on (an unset `liger` follows fused_ce, which Liger's fused CE implies)."""
    return s.fused_ce if s.liger is None else s.liger


def activation_factor(s: Setup) -> float:
    """Measured multipliers of the bf16 formula (memory.py): stack, precision scheme, adapters."""
    factor = mem.BF16_ACTIVATION_CALIBRATION
    if s.finetuning_type == "lora" and s.fp32_adapters:
        factor *= mem.PEFT_LORA_ACTIVATION_FACTOR
    if s.classic_amp:
        factor *= mem.FP32_RESIDUAL_ACTIVATION_FACTOR
    if not _liger(s):
        factor *= mem.STOCK_HF_ACTIVATION_FACTOR
    return factor


def train_tokens(s: Setup) -> int:
    """Tokens of one micro-batch as the model sees it (dpo/rm: chosen + rejected rows)."""
    return s.micro_batch * s.rows_per_example * s.seq_len


def _layer_bytes_per_token(spec: ModelSpec, s: Setup) -> float:
    """One decoder layer's full activations per token (eager attention: its s x s scores too)."""
    per_layer = mem.activation_bytes_per_token_layer(spec.hidden_size, spec.kv_dim, spec.intermediate_size)
    if s.attention == "eager":
        per_layer += mem.eager_attention_bytes_per_token_layer(spec.num_heads, s.seq_len)
    return per_layer


def _recompute_layer_bytes(spec: ModelSpec, s: Setup) -> float:
    return train_tokens(s) * _layer_bytes_per_token(spec, s) * activation_factor(s)


def _recompute_backward_per_token(spec: ModelSpec, s: Setup) -> int:
    """What a recomputed layer's backward allocates at its start on top of it, per token (transformers' own
    SwiGLU: 4i + 4h, memory.stock_recompute_backward_bytes_per_token); Liger's kernels allocate none of it."""
    if _liger(s):
        return 0
    return mem.stock_recompute_backward_bytes_per_token(spec.hidden_size, spec.intermediate_size)


def _activation_layers(spec: ModelSpec, s: Setup) -> int:
    """Layers whose activations are kept (freeze-tuning: none below the first trainable one). With
    checkpointing every layer records: train/common.enable_gradient_checkpointing makes the embedding output
    require grad (enable_input_require_grads) for every method but full, so each frozen layer keeps its
    checkpointed input, or its activations where it is not checkpointed (traced, tests/unit/plan/
    test_recompute_and_accumulation_margin.py; a frozen layer saves less than a trainable one: counted as one, on the safe side). The
    first layers trained (freeze_trainable_layers < 0): every layer above them records."""
    if (
        s.finetuning_type == "freeze" and not s.gradient_checkpointing and s.freeze_trainable_layers > 0
        and not _freeze_trains_embedding(s)
    ):  # fmt: skip
        k = min(s.freeze_trainable_layers, spec.num_layers)
        # LLaMA-Pro: the first expanded block is layer N / k - 1, every layer from it up records
        return spec.num_layers - spec.num_layers // k + 1 if s.llama_pro else k
    return spec.num_layers


def recomputed_layers(spec: ModelSpec, s: Setup) -> int:
    """Decoder layers that recompute in the backward: 0 without checkpointing, the first checkpoint_layers
    of them with partial checkpointing, all otherwise."""
    if not s.gradient_checkpointing:
        return 0
    return spec.num_layers if s.checkpoint_layers is None else min(s.checkpoint_layers, spec.num_layers)


def kept_recomputed(spec: ModelSpec, s: Setup) -> tuple[int, int]:
    """(layers keeping their activations, layers recomputed) among the layers that store activations (the
    last _activation_layers of the stack: freeze-tuning without checkpointing stores none below its first
    trainable layer)."""
    layers = _activation_layers(spec, s)
    recomputed = max(0, recomputed_layers(spec, s) - (spec.num_layers - layers))
    return layers - recomputed, recomputed


def every_layer_checkpointed(spec: ModelSpec, s: Setup) -> bool:
    """Full checkpointing (offloaded or not): every decoder layer that stores activations recomputes, none
    keeps them, so only their inputs are alive between the forward and each layer's recompute."""
    return s.gradient_checkpointing and not kept_recomputed(spec, s)[0]


def offloaded_activations(spec: ModelSpec, s: Setup) -> float:
    """CPU bytes of one rank's offloaded layer inputs (0 unless checkpoint_offload)."""
    if not s.checkpoint_offload:
        return 0.0
    return (
        train_tokens(s)
        * kept_recomputed(spec, s)[1]
        * mem.checkpointed_bytes_per_token_layer(input_hidden(spec, s))
    )


def input_hidden(spec: ModelSpec, s: Setup) -> int:
    """The checkpointed layer inputs' width in bf16 units, the `hidden` memory's checkpointing formulas count
    2 B of: the hidden size, twice it under classic AMP, whose residual stream (and so every layer's input)
    is fp32."""
    return spec.hidden_size * (mem.FP32_BYTES // mem.BF16_BYTES if s.classic_amp else 1)


def frozen_recording_layers(spec: ModelSpec, s: Setup) -> int:
    """Frozen decoder layers that record a graph without checkpointing: freeze-tuning with the first k layers
    trained (freeze_trainable_layers = -k) runs its backward through the N - k frozen layers above them;
    with the last k trained the frozen layers below build no graph (_activation_layers leaves them out);
    LLaMA-Pro's k expanded blocks are spread over the stack, the frozen layers between them record."""
    if s.finetuning_type != "freeze" or s.gradient_checkpointing:
        return 0
    trained = min(abs(s.freeze_trainable_layers), spec.num_layers)
    if s.freeze_trainable_layers > 0 and not _freeze_trains_embedding(s):
        return _activation_layers(spec, s) - trained if s.llama_pro else 0
    return spec.num_layers - trained  # the first k trained, or a trained embedding below every layer


def frozen_layers_saving(spec: ModelSpec, s: Setup) -> float:
    """What the recording frozen layers keep less than the trained-layer figure counts for them: the traced
    per-token discount (memory.frozen_layer_discount_bytes_per_token), less, under classic AMP, the bf16 copy
    of each frozen weight that autocast casts anew every forward (it caches only weights that require grad)
    and the matmul keeps for its input gradient (2 B/param, traced in the same test)."""
    frozen = frozen_recording_layers(spec, s)
    if not frozen:
        return 0.0
    per_token = mem.frozen_layer_discount_bytes_per_token(
        spec.hidden_size, spec.intermediate_size, s.classic_amp, _liger(s)
    )
    full = train_tokens(s) * _layer_bytes_per_token(spec, s) * activation_factor(s)
    saving = min(train_tokens(s) * per_token, full)  # never below nothing
    copies = mem.BF16_BYTES * spec.layer_params if s.classic_amp else 0.0
    return frozen * (saving - copies)


def activations(spec: ModelSpec, s: Setup) -> float:
    """Activation bytes per GPU (ZeRO/FSDP do not split activations)."""
    per_layer = _layer_bytes_per_token(spec, s)
    tokens, factor = train_tokens(s), activation_factor(s)
    if not s.gradient_checkpointing:
        every = mem.activation_bytes(
            tokens, _activation_layers(spec, s), per_layer, spec.hidden_size, False, factor
        )
        return every - frozen_layers_saving(spec, s)
    kept, recomputed = kept_recomputed(spec, s)
    h = spec.hidden_size
    start = 0 if _liger(s) else mem.stock_backward_start_bytes_per_token(h, spec.intermediate_size)
    recompute = _recompute_backward_per_token(spec, s)
    checkpointed = mem.partial_checkpoint_bytes(
        tokens,
        kept,
        recomputed,
        per_layer,
        input_hidden(spec, s),
        factor,
        s.checkpoint_offload,
        start,
        recompute,
    )
    return checkpointed + (outside_layers_bytes(spec, s) if every_layer_checkpointed(spec, s) else 0.0)


def outside_layers_bytes(spec: ModelSpec, s: Setup) -> float:
    """With every layer checkpointed, what stays alive outside the decoder layers next to their inputs (traced
    on the H200, plan_accuracy.json `snap_r8_*_ckpt`): the embedding output (one more 2h per token than the
    layers' inputs) and, for packed rows under SDPA, the block-diagonal bool mask of every row (rows x seq^2
    bytes). The same [rows, 1, seq, seq] mask for a padded batch (unpacked rows, more than one: the largest
    batch pads to its longest row) under SDPA and for every batch under eager attention, which builds it in the
    embeddings' dtype (tests/unit/plan/test_reference_copy_and_recorded_layers.py); flash/flex build none. Without full checkpointing the
    activation calibration was fitted with them in."""
    rows = s.micro_batch * s.rows_per_example
    mask_bytes = 0
    if s.attention == "eager":
        mask_bytes = mem.FP32_BYTES if s.classic_amp else mem.BF16_BYTES
    elif s.attention == "sdpa" and (s.packed or rows > 1):
        mask_bytes = 1  # bool
    mask = mask_bytes * rows * s.seq_len * s.seq_len
    return train_tokens(s) * mem.checkpointed_bytes_per_token_layer(input_hidden(spec, s)) + mask


def _step_transient(spec: ModelSpec, s: Setup, freed: float) -> float:
    """What the optimizer step allocates after the activations are freed; it raises the peak only where it
    exceeds them. Optimizer-held fp32 masters (train/master_weights.py) convert the bf16 grads to fp32;
    torch's multi-tensor AdamW then holds sqrt(exp_avg_sq) of every parameter it steps."""
    single_optimizer = _unsharded(s) and s.optimizer == "adamw"
    if not single_optimizer or s.finetuning_type == "lora":  # adapters: a few MiB, no step term
        return 0.0
    trainable, _, _ = _trainable_frozen(spec, s)
    masters = not s.fp32_model_weights and not s.pure_bf16
    # the sqrt is in the moments' dtype: bf16 under pure_bf16 (no masters), fp32 otherwise
    sqrt = mem.BF16_BYTES if s.pure_bf16 else mem.FOREACH_ADAM_TEMP_BYTES
    step = (mem.FP32_BYTES * trainable if masters else 0.0) + (sqrt * trainable if s.adam_foreach else 0.0)
    return max(0.0, step - freed)


# The loss heads whose transient peaks in the backward's first op, before any parameter gradient exists:
# TRL's full-logits losses (ORPO, SimPO: the [tokens x V] logits, their fp32 copy and gradient) and the
# value head (rm). Traced on the H200 (torch.cuda.memory._record_memory_history, plan_accuracy.json's
# `snap_r4_orpo_0.5b_full_mb2` and `snap_r4_rm_0.5b_full_mb4`): at the peak every forward activation is
# alive and no decoder gradient is (the Trainer frees them after each step); only the trained head's
# gradient joins the logits' transient.
# TRL's fused log-prob head (DPO, KTO) too: traced on the H200 (`snap_r8_dpo_1.5b_full_mb2_ckpt`), the
# trained head's fp32 gradient is its own allocation in the head's backward (trl_logprob_bytes counts it) and
# the decoder gradients only fill in as the backward frees the activations. The full DPO 1.5B without
# checkpointing agrees (r5_dpo_1.5b_full_mb2: 38.46 GiB measured; the forward's end with no decoder gradient
# is 38.5, every gradient summed on top 44.3).
BACKWARD_START_HEADS = ("full_logits", "full_logits_no_nll", "value_head", "trl_logprob")
# the heads whose trained [V, h] gradient is not already in their loss bytes (trl_logprob_bytes has its own)
_HEAD_GRADIENT_OUTSIDE_LOSS = ("full_logits", "full_logits_no_nll")


def peaks_at_backward_start(s: Setup) -> bool:
    """gradients_at_peak's case: a BACKWARD_START_HEADS loss on a full fine-tune in one process without
    ZeRO/FSDP, no gradient accumulation, no generation (PPO's and GRPO's loops were never traced)."""
    single = s.num_gpus == 1 and _unsharded(s)
    no_accumulation = s.optimizer_batch <= s.micro_batch
    return (
        s.loss_path in BACKWARD_START_HEADS and s.finetuning_type == "full" and single and no_accumulation
        and not s.generated_rows
    )  # fmt: skip


def gradients_at_peak(spec: ModelSpec, s: Setup, grads: float, forward: float) -> float:
    """The gradient bytes that add to the peak above the `forward` bytes that the backward frees (the
    activations and the loss head; the stage's weights and buffers stay alive to its end). Summed (all of
    `grads`) unless the peak is provably at the start of the backward (peaks_at_backward_start; DDP's buckets
    and ZeRO's partitions keep gradient storage alive, accumulation keeps the gradients). There the peak is
    the larger of the backward's start (the forward's bytes + the head's gradient) and its end (every
    gradient and the stage's weights, the activations freed): as the backward walks down the layers each one
    frees its activations and allocates its gradients, so the peak is at one of the two ends."""
    if not peaks_at_backward_start(s):
        return grads
    head = 0.0
    if (
        s.loss_path in _HEAD_GRADIENT_OUTSIDE_LOSS
    ):  # the tied or separate [V, h] head's gradient, weights' dtype
        head = (
            (mem.FP32_BYTES if s.fp32_model_weights else mem.BF16_BYTES) * spec.vocab_size * spec.hidden_size
        )
    return max(head, grads - forward)


def _loss_head_bytes(spec: ModelSpec, s: Setup) -> float:
    """The loss head's own peak: logits / chunked CE (lm), TRL's fused log-probs, full logits, value head."""
    tokens = train_tokens(s)
    full = head_trainable(spec, s)
    if s.loss_path == "trl_logprob":
        return mem.trl_logprob_bytes(tokens, spec.vocab_size, spec.hidden_size, full)
    if s.loss_path in ("full_logits", "full_logits_no_nll"):
        logits = mem.logits_bytes(tokens, spec.vocab_size, fused=False)
        if s.loss_path == "full_logits_no_nll":
            logits -= mem.PREF_NLL_BYTES_PER_CHOSEN * (tokens // 2) * spec.vocab_size
        return logits
    if s.loss_path == "value_head":
        # the margin was fitted on a bf16 model; classic AMP's residual stream is fp32, twice the bytes (the
        # traced full rm run, snap_r4_rm_0.5b_full_mb4: 0.82 GiB above the bf16 margin's 0.79)
        widen = mem.FP32_BYTES / mem.BF16_BYTES if s.classic_amp else 1.0
        hidden_states = (
            widen * mem.VALUE_HEAD_MARGIN_BYTES * tokens * spec.hidden_size * (spec.num_layers + 1)
        )
        return mem.VALUE_HEAD_INPUT_BYTES * tokens * spec.hidden_size + hidden_states
    if s.fused_ce and not _liger(s):  # lmstack's chunked linear CE (models/kernels.py)
        return mem.chunked_ce_bytes(
            tokens, spec.vocab_size, spec.hidden_size, full, every_layer_checkpointed(spec, s)
        )
    return mem.logits_bytes(tokens, spec.vocab_size, s.fused_ce, zero3=s.deepspeed_stage == 3)


def recompute_phase_bytes(spec: ModelSpec, s: Setup) -> float | None:
    """With every layer recomputed (full checkpointing; offloaded or not): what the backward's recompute
    holds above the checkpointed inputs -- one layer's full activations and its backward's first allocations.
    The loss head and the no-grad reference forwards of the stages run before the backward and are freed by
    the time the first layer recomputes, so they never coexist with it: only what they add above it counts.
    None otherwise (no checkpointing; partial checkpointing, whose kept layers the loss adds to). The value
    head (rm) keeps the summed rows: its margin was fitted on runs without checkpointing."""
    if not every_layer_checkpointed(spec, s) or s.loss_path == "value_head":
        return None
    return _recompute_layer_bytes(spec, s) + train_tokens(s) * _recompute_backward_per_token(spec, s)


def _loss_and_headroom(spec: ModelSpec, s: Setup) -> tuple[float, float]:
    """(the loss head's bytes on top of the activations, the backward's headroom over the loss head): all of
    the head's peak and 0, or with full checkpointing (recompute_phase_bytes) only what the head adds above
    the recompute it never meets and how far the recompute rises above the head."""
    head = _loss_head_bytes(spec, s)
    recompute = recompute_phase_bytes(spec, s)
    if recompute is None:
        return head, 0.0
    return max(0.0, head - recompute), max(0.0, recompute - head)


def loss_bytes(spec: ModelSpec, s: Setup) -> float:
    """The loss head's bytes on top of the activations (_loss_and_headroom)."""
    return _loss_and_headroom(spec, s)[0]


def accumulation_terms(spec: ModelSpec, s: Setup) -> tuple[tuple[str, float], ...]:
    """The explicit margin of an accumulating micro-batch under classic AMP without ZeRO/FSDP (memory.
    ACCUMULATING_CLASSIC_AMP_MARGIN_BYTES: what the traced runs showed and the activation model misses), per
    weight whose bf16 copy autocast keeps for the backward: autocast caches the weights that require grad,
    and freeze-tuning's frozen layers build no graph (or one layer at a time, recomputed), so there only the
    trainable layers and the head the loss backpropagates through carry it."""
    if not s.classic_amp or s.optimizer_batch <= s.micro_batch or not _unsharded(s):
        return ()
    trainable, _, _ = _trainable_frozen(spec, s)
    weights = trainable if s.finetuning_type == "full" else trainable + spec.vocab_size * spec.hidden_size
    margin = mem.ACCUMULATING_CLASSIC_AMP_MARGIN_BYTES * weights
    return (("margin: accumulating under classic AMP (2 B/param)", margin),)


def estimate(spec: ModelSpec, s: Setup) -> Estimate:
    """Predicted peak memory of one GPU for setup ``s`` plus CPU memory for offload."""
    from lmstack.memory.stage_memory import stage_terms, step_freed_bytes

    validate_setup(s)
    st = model_states(spec, s)
    acts = activations(spec, s)
    logits, headroom = _loss_and_headroom(spec, s)  # headroom: full checkpointing's recompute over the loss
    accumulation = accumulation_terms(spec, s)  # activations the model misses: freed before the step too
    stage = stage_terms(spec, s, acts + logits, _recompute_layer_bytes(spec, s), headroom)
    grads = gradients_at_peak(spec, s, st.grads, acts + logits)
    # what the sum counts that the optimizer step no longer holds (the activations, the loss head, the stage's
    # working sets, the accumulation margin), less the gradients gradients_at_peak left out: at the step every
    # gradient is alive again
    freed = acts + logits + sum(v for _, v in accumulation) + step_freed_bytes(stage) - (st.grads - grads)
    optim = st.optim + _step_transient(spec, s, freed)
    terms = stage + fp8_estimate.transient_terms(spec, s, train_tokens(s))
    terms += accumulation
    frag = mem.FRAGMENTATION_FACTOR if s.packed else mem.UNPACKED_FRAGMENTATION_FACTOR
    if s.expandable_segments:
        frag = mem.EXPANDABLE_FRAGMENTATION_FACTOR
    pending = 0.0
    if s.checkpoint_offload:  # validate_setup: only with checkpointing
        kept, recomputed = kept_recomputed(spec, s)
        pending = mem.offload_pending_bytes(train_tokens(s), recomputed, kept, input_hidden(spec, s))
    gpu = mem.breakdown(
        st.weights, grads, optim, acts, logits, st.adapters, terms=terms, fragmentation=frag,
        reserved_extra=pending,
    )  # fmt: skip
    parked = offloaded_activations(spec, s) * max(s.num_gpus // s.nodes, 1) / mem.GIB
    return Estimate(
        gpu=gpu,
        cpu_gib=cpu_bytes_per_node(st, s) / mem.GIB + parked,
        offloaded_activations_gib=parked,
        weight_rows=_weight_rows(st),
    )


def _weight_rows(st: _States) -> tuple[tuple[str, float], ...]:
    """The weights split by storage (GiB) when part of them is FP8; () otherwise."""
    if not st.fp8_weights:
        return ()
    return (
        ("FP8 base layers (1 B/param + fp32 row scales)", st.fp8_weights / mem.GIB),
        ("bf16 (embeddings, head, norms, kept layers)", (st.weights - st.fp8_weights) / mem.GIB),
    )
