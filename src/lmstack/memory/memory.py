"""Per-GPU training memory: pure formula functions (bytes unless a name says GiB).

Sources: model states from the ZeRO paper (Rajbhandari et al. 2020) and DeepSpeed's memory
estimators; activations from Korthikanti et al. 2022, re-derived for Llama/Qwen blocks; logits and
overheads measured (bench/results/). Every tunable factor is a named constant below.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

GIB = 1024**3
GB = 1e9

# --- model states (REFERENCE 7.1) -----------------------------------------------------
BF16_BYTES = 2
FP32_BYTES = 4
ADAM_K_MIXED = 12  # ZeRO paper K=12: fp32 master + Adam m + v (4+4+4)
ADAM_K_PURE_BF16 = 4  # LF pure_bf16: bf16 m + v, no master copy (2+2)
# DeepSpeed's bf16/ZeRO optimizer also keeps an fp32 gradient partition; that is why its
# estimators say 4P + 16P/N (stage 2) and 18P/N (stage 3) instead of the paper's 2+14 and 16.
DS_FP32_GRAD_PARTITION_BYTES = 4
# PEFT keeps adapters in fp32 by default (autocast_adapter_dtype=True): 4 B weights,
# 4 B grads, 8 B Adam m+v -> 16 B per adapter parameter (REFERENCE 7.1 "adapters x16").
ADAPTER_WEIGHT_BYTES = 4
ADAPTER_GRAD_BYTES = 4
ADAPTER_OPTIM_BYTES = 8
# bitsandbytes NF4 with double quantization: 4-bit codes, one 8-bit absmax per 64-weight
# block, one fp32 scale per 256 absmax values (QLoRA paper, 4.127 bits -> 0.516 B/param).
NF4_BITS = 4
NF4_BLOCK = 64
NF4_ABSMAX_BITS = 8
NF4_SECOND_BLOCK = 256
NF4_SECOND_SCALE_BITS = 32
INT8_BYTES = 1.0  # LLM.int8: 1 B/param (+ per-row fp32 scales, negligible)
# FP8 frozen base (models/fp8.py Float8FrozenLinear): float8_e4m3fn weights, 1 B/param, and one fp32 scale
# per output row ([out, 1]); the bf16 copy is dropped. The same sizes for every transient FP8 copy (an
# activation: one scale per token; a weight requantized per input column: one scale per column).
FP8_BYTES = 1
FP8_SCALE_BYTES = FP32_BYTES
# GaLore (Zhao et al. 2024) / APOLLO (Zhu et al. 2025): Adam's m and v of a projected m x n matrix
# (m <= n) live in an r x n space, plus the m x r projector -> r*(2n + m) elements instead of 2mn.
# Muon keeps one momentum buffer per hidden-matrix element (no second moment).
MUON_STATES = 1
# DeepSpeed ZeRO-3 estimator: 4 x largest_layer_params of live, gathered bf16 params+grads.
ZERO3_LIVE_GATHER_BYTES = 4
# DeepSpeed estimators multiply CPU needs by this buffer factor (additional_buffer_factor).
DS_CPU_BUFFER_FACTOR = 1.5

# --- activations (REFERENCE 7.2) ------------------------------------------------------
# Korthikanti eager-attention term: 5*a*s bytes per token per layer (2 B scores, 2 B softmax
# output, 1 B dropout mask); FlashAttention/SDPA store none of it.
EAGER_SCORE_BYTES = 5
# Measured on the H200 (bench/results/plan_accuracy.json, transformers 5.17, Liger kernels,
# flex_attention on packed rows, bf16 residual stream): activations = 1.085 x the bf16 formula
# (0.5B LoRA 1.09, 7B LoRA 1.08, 0.5B full ZeRO-2/FSDP 1.07).
BF16_ACTIVATION_CALIBRATION = 1.085
# Classic AMP (fp32 weights in the model, autocast): the residual stream, norms' inputs and the
# weight casts stay fp32; measured 1.30 x the formula for 0.5B full SFT = 1.20 x the bf16 case.
FP32_RESIDUAL_ACTIVATION_FACTOR = 1.20
# HF+PEFT LoRA with fp32 adapters measured 1.5-1.7x the activation formula (REFERENCE 7.2);
# lmstack keeps adapters in the bf16 base's dtype, so this applies to fp16/fp32 runs only.
PEFT_LORA_ACTIVATION_FACTOR = 1.6
# Stock HF blocks (no Liger): fp32 RMSNorm copies, rotary tensors, unfused SiLU*mul; REFERENCE 7.4
# says ~1.3, and the H200 runs without Liger agree (7B LoRA 1.26, 0.5B full 1.32 over the Liger case).
STOCK_HF_ACTIVATION_FACTOR = 1.3

# --- offloaded checkpointing (use_unsloth_gc, models/offload_ckpt.py) --------------------
# Each layer's bf16 input waits in pinned CPU RAM; in the backward the GPU holds the layer being
# recomputed, its input brought back, and the input of the layer below in flight (one prefetch).
OFFLOAD_PREFETCH_LAYERS = 1
# Pinned host <-> device copies: PCIe Gen4/Gen5 x16 reach ~25 GB/s in practice (an estimate, not measured
# here); each layer input crosses twice per step (to the CPU in the forward, back in the backward).
PCIE_GB_PER_S = 25.0

# --- logits / loss (REFERENCE 7.3) ----------------------------------------------------
UNFUSED_LOGITS_BYTES = 10  # bf16 logits 2 + fp32 upcast 4 + logits grad 4, per element
# Under DeepSpeed ZeRO-3 the same HF loss held 2 B more per element: one more bf16 copy of the logits
# (their gradient in the head's dtype while the gathered head reduces). Fitted on one H200 run
# (0.5b_full_mb4_z3: 33.2 GiB measured, 30.8 predicted with 10 B) -- a margin, not a derivation.
UNFUSED_LOGITS_BYTES_ZERO3 = 12
FUSED_CE_CHUNK_TOKENS = 1024  # Liger FLCE materialises one chunk of logits (its chunks are smaller)
# lmstack's own chunked linear CE (models/kernels.py, DEFAULT_CHUNK tokens per chunk). By its code a
# chunk's bf16 product and fp32 copy (2 + 4 B), later the fp32 softmax-gradient and its bf16 copy
# (4 + 2 B): 6 B x chunk x V; the H200 runs of the current implementation (one 2048-token chunk alive,
# 0.5B LoRA/full without Liger, bench/results/plan_runs_ce_h200.json) measured ~9 B x chunk x V. When the
# head trains: the fp32 head-gradient accumulator plus each chunk's bf16 [V, h] product and its fp32 copy
# (4 + 2 + 4 B x V x h). The earlier implementation (4096-token chunks, two alive; 6 B and 4 B fitted)
# is what bench/plan_check.py models for runs recorded with that implementation.
LMSTACK_CE_CHUNK_TOKENS = 2048
LMSTACK_CE_BYTES = 9
# With every layer checkpointed the head meets only the layers' inputs, and there the H200 trace shows the code's
# own 6 B (plan_accuracy.json `snap_r8_freeze_0.5b_mb8_ckpt`: the chunk's fp32 copy 1.16 GiB and its bf16
# gradient 0.58 GiB, 2048 x 151936, nothing else of the head's size): the fitted 9 B's other 3 B are what the
# activation model misses at the end of a forward that keeps its activations. Beside the chunk, per token: the
# final norm's fp32 input (4h) and bf16 output (2h), the CE's copy of the labelled rows (2h) and their gradient
# (2h), traced there at 0.12 GiB for 16384 tokens (h = 896).
LMSTACK_CE_TRACED_BYTES = 6
LMSTACK_CE_SIDE_BYTES_PER_HIDDEN = 10
LMSTACK_CE_LIVE_CHUNKS = 1
LMSTACK_CE_HEAD_BYTES = 10
FUSED_CE_BYTES = 4  # fp32 per chunk element

# --- the stages' own terms (estimate's stage_terms; each from the code path that runs) -------
# TRL 1.16's fused log-prob head (trl/kernels/chunked_logprob.py, used by DPOTrainer, KTOTrainer,
# GRPOTrainer, RLOOTrainer): no [tokens x vocab] logits; one bf16 projection tile of
# TOKEN_CHUNK_SIZE x chunk_size (4096 x 32768) at a time, the label positions' hidden states kept for
# the backward (bf16), their gradient accumulated in fp32, and for a trained head its fp32 gradient
# (plus the bf16 copy it is cast back to).
TRL_LOGPROB_TOKEN_TILE = 4096
TRL_LOGPROB_VOCAB_TILE = 32768
TRL_LOGPROB_HIDDEN_BYTES = BF16_BYTES + FP32_BYTES  # saved hidden[mask] + its fp32 gradient
TRL_LOGPROB_HEAD_GRAD_BYTES = FP32_BYTES + BF16_BYTES
# A no-grad forward (DPO/KTO's reference, KTO's KL batch) holds one layer's working set at a time, not what
# the layer saves for a backward: its peak, less the layer's input, traced on CPU through the real model
# (tests/unit/plan/test_stage_memory.py) was 0.74-0.79x of one layer's kept activations at LLM-like widths
# (intermediate 8-12x hidden; full and LoRA) and 0.83x at 2x: 0.8 kept. The recorded H200 runs with a
# reference forward moved by 0.1-0.7 points each (round 7's checkpointed DPO 1.5B LoRA +5.8% -> +2.5%).
NO_GRAD_FORWARD_LAYER_SHARE = 0.8
# KV cache while generating (grpo/rloo/ppo rollouts): K and V, bf16, per token per layer per KV dim.
KV_CACHE_BYTES = 2 * BF16_BYTES
# Sampling keeps the last position's logits in fp32 and their softmax/top-p copy: 2 x 4 B per vocab entry.
SAMPLING_LOGITS_BYTES = 2 * FP32_BYTES
# The value head (rm, ppo critic) runs in fp32 on the last hidden states: their fp32 copy is kept.
VALUE_HEAD_INPUT_BYTES = FP32_BYTES
# rm: a margin, not a modelled term. The H200 run rm_0.5b_lora_mb4 (bench/results/plan_accuracy.json)
# peaked 0.78 GiB above the SFT-shaped model + the value head's fp32 input (12.24 vs 11.46 GiB at 8,192
# tokens); the value head's backbone call returns every layer's hidden states (output_hidden_states), so
# the margin scales as tokens x hidden x (layers + 1): 4.54 B each measured, 4.6 B kept (one run: a fit).
VALUE_HEAD_MARGIN_BYTES = 4.6
# ORPO's NLL term (TRL's ORPOTrainer; CPO with cpo_alpha > 0): cross-entropy over the chosen half's logits
# upcast to fp32 -- 4 B x (tokens / 2) x V of UNFUSED_LOGITS_BYTES' 10 B. SimPO without pref_ftx has none:
# measured on the H200, simpo_0.5b_lora_mb4 peaked 2.3 GiB (= 2 B x tokens x V) under orpo_0.5b_lora_mb4.
PREF_NLL_BYTES_PER_CHOSEN = FP32_BYTES

# torch.optim.AdamW's multi-tensor step (foreach, its default on a GPU; transformers' optim: adamw_torch):
# _foreach_sqrt(exp_avg_sqs) allocates one fp32 tensor per parameter, all at once, before the update. The
# H200 memory trace of 0.5b_full_mb4_s2048_ckpt (plan_accuracy.json snap run) shows it at the peak
# (torch/optim/adam.py _multi_tensor_adam, 1.84 GiB = 4 B x 494M params) next to the fp32 master grads;
# r5_sft_1.5b_full_mb4_ckpt peaked at 34.57 GiB where weights + masters + moments + bf16 and fp32 grads
# + this temporary are 34.5 (predicted 28.75 without it).
FOREACH_ADAM_TEMP_BYTES = FP32_BYTES

# Gradient accumulation under classic AMP (fp32 weights in the model, autocast; what master_weights: auto
# runs when micro-batches accumulate): a margin, not a derived term. Traced on the H200
# (plan_accuracy.json, snap_r6_sft_0.5b_full_mb4_ga4 against snap_sft_0.5b_full_mb4_amp, the same step
# without accumulation): an accumulating micro-batch peaks where the one-step run does (the chunked loss at
# the end of the forward), plus exactly the earlier micro-batches' fp32 gradients. The planner counts those
# gradients in both runs; without accumulation that over-count (they are not allocated yet at that peak)
# covers what its activation model misses under classic AMP with transformers' own kernels (the traced
# activations were 1.16x the planner's, autocast's bf16 weight copies among them), so the one-step run was
# +2.8% and the accumulating ones -4.8% (SFT, 0.5B, 8,192 tokens) and -6.3% (ORPO, 4,096 tokens). Both
# misses were ~2.6 B per parameter at two token counts: this margin is 2 B per parameter (the bf16 copy of
# each weight that autocast saves for the backward), which leaves them at -1.2% and -1.8%.
ACCUMULATING_CLASSIC_AMP_MARGIN_BYTES = BF16_BYTES

# --- overhead (REFERENCE 7.4): margins for what the planner does not model term by term ------
CUDA_CONTEXT_GIB = 1.0  # CUDA context + cuBLAS/NCCL workspaces: 0.5-1.5 GB measured range
# caching-allocator reserved vs allocated (web calculators: 5-25%). The H200 runs reserved 1.02-1.04x
# what they allocated when the batches had one shape (packed rows). With padded rows of changing width
# the default allocator reserved 1.74x (plan_accuracy.json sft_unpacked_0.5b_lora_mb8: 24.48 allocated,
# 42.56 reserved; image rows reached 2.7x, vlm.jsonl): the unpacked margin under the default allocator,
# rounded up to 1.75 so the planned reserved figure covers that run (24.43 predicted x 1.75 = 42.75).
# Expandable segments (plan.allocator, on for such runs) grow one segment in place instead of caching
# blocks of every size: their margin is the packed one's (1.03: to be calibrated on the H200).
FRAGMENTATION_FACTOR = 1.05
UNPACKED_FRAGMENTATION_FACTOR = 1.75
EXPANDABLE_FRAGMENTATION_FACTOR = 1.03
# A setup "fits" when its predicted total <= GPU memory x this margin: the estimate's own
# error (REFERENCE 7.4: good estimators are within a few %) plus allocator spikes.
SAFETY_MARGIN = 0.92


@dataclass(frozen=True)
class MemoryBreakdown:
    """Predicted peak memory of one GPU, in GiB.

    ``allocated`` is what ``torch.cuda.max_memory_allocated`` measures (every modelled term, the
    stage's own ``terms`` included); ``reserved`` adds the caching allocator's ``fragmentation``
    margin (``max_memory_reserved``); ``total`` adds the ``cuda_context`` margin as well (what the GPU
    must hold; the fit test uses it). ``overhead`` = fragmentation + cuda_context. ``terms``: the
    stage's named rows (reference forward, KV cache, ...), GiB each, already in ``stage``."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    logits: float
    adapters: float
    overhead: float
    total: float
    stage: float = 0.0
    terms: tuple[tuple[str, float], ...] = ()
    fragmentation: float = 0.0
    cuda_context: float = 0.0

    @property
    def allocated(self) -> float:
        return self.total - self.overhead

    @property
    def reserved(self) -> float:
        return self.allocated + self.fragmentation

    def to_dict(self) -> dict[str, float]:
        out = {k: round(v, 3) for k, v in asdict(self).items() if k != "terms"}
        out["terms"] = {name: round(v, 3) for name, v in self.terms}
        out["allocated"] = round(self.allocated, 3)
        out["reserved"] = round(self.reserved, 3)
        return out


def nf4_bytes_per_param() -> float:
    """QLoRA double-quantized NF4 storage: (4 + 8/64 + 32/(64*256)) / 8 = 0.516 B/param."""
    bits = NF4_BITS + NF4_ABSMAX_BITS / NF4_BLOCK + NF4_SECOND_SCALE_BITS / (NF4_BLOCK * NF4_SECOND_BLOCK)
    return bits / 8


def quantized_weight_bytes(linear_params: int, other_params: int, bits: int | None) -> float:
    """Frozen base weights: linear leaves in 4/8-bit, embeddings, lm_head and norms stay bf16."""
    if bits is None:
        return BF16_BYTES * (linear_params + other_params)
    per_param = {4: nf4_bytes_per_param(), 8: INT8_BYTES}.get(bits)
    if per_param is None:
        raise ValueError(f"quantization_bit: got {bits}; allowed: 4 | 8 | null")
    return per_param * linear_params + BF16_BYTES * other_params


def low_rank_state_elements(rows: int, cols: int, rank: int) -> int:
    """GaLore/APOLLO optimizer elements of one rows x cols matrix: r*(2*max + min), r <= min side."""
    small, big = sorted((rows, cols))
    r = min(rank, small)
    return r * (2 * big + small)


def zero_paper_model_states(psi: float, stage: int, n: int, k: int = ADAM_K_MIXED) -> float:
    """ZeRO paper (Rajbhandari et al. 2020, Fig. 1) model-state bytes per GPU, K=12 mixed AdamW.

    stage 0: (2+2+K)Psi; 1: (2+2)Psi + K*Psi/N; 2: 2Psi + (2+K)Psi/N; 3: (2+2+K)Psi/N.
    """
    if stage == 0:
        return (2 + 2 + k) * psi
    if stage == 1:
        return (2 + 2) * psi + k * psi / n
    if stage == 2:
        return 2 * psi + (2 + k) * psi / n
    if stage == 3:
        return (2 + 2 + k) * psi / n
    raise ValueError(f"deepspeed stage: got {stage}; allowed: 0 | 1 | 2 | 3")


def deepspeed_zero2_estimate(
    params: int, gpus: int, gpus_per_node: int, offload: bool
) -> tuple[float, float]:
    """DeepSpeed ``estimate_zero2_model_states_mem_needs``: (gpu bytes, cpu bytes per node).

    no offload: GPU 4P + 16P/N, CPU 4P * gpus_per_node * 1.5;
    optimizer offload: GPU 2P, CPU P * max(4N, 16) * 1.5.
    """
    if offload:
        return 2.0 * params, params * max(4 * gpus, 16) * DS_CPU_BUFFER_FACTOR
    return 4.0 * params + 16.0 * params / gpus, 4.0 * params * gpus_per_node * DS_CPU_BUFFER_FACTOR


def deepspeed_zero3_estimate(
    params: int, largest_layer: int, gpus: int, nodes: int, offload_optimizer: bool, offload_param: bool
) -> tuple[float, float]:
    """DeepSpeed ``estimate_zero3_model_states_mem_needs`` (zero_init=True): (gpu, cpu/node) bytes.

    no offload: 4*LL + 18P/N; optimizer offload: 4*LL + 2P/N (CPU 16P/nodes*1.5);
    param+optimizer offload: 4*LL (CPU 18P/nodes*1.5).
    """
    live = ZERO3_LIVE_GATHER_BYTES * largest_layer
    if offload_optimizer and offload_param:
        return live, params * 18 / nodes * DS_CPU_BUFFER_FACTOR
    if offload_optimizer:
        return live + 2.0 * params / gpus, params * 16 / nodes * DS_CPU_BUFFER_FACTOR
    return live + 18.0 * params / gpus, largest_layer * 4 * (gpus // nodes) * DS_CPU_BUFFER_FACTOR


def activation_bytes_per_token_layer(hidden: int, kv_dim: int, intermediate: int) -> int:
    """Llama/Qwen block, bf16, flash/SDPA attention: 2*(6h + 2*h_kv + 3*i) (REFERENCE 7.2)."""
    return BF16_BYTES * (6 * hidden + 2 * kv_dim + 3 * intermediate)


# A frozen decoder layer that records a graph (freeze-tuning's frozen layers above a trained one) keeps less
# than a trained one: its linears save no input for a weight gradient, its norms' weight products save nothing.
# Traced on the CPU through the run's own code path (tests/unit/plan/test_frozen_layers.py, three widths, exact
# to the byte): a trained stock layer keeps 8h + 2i bytes per token more than a frozen one with bf16 weights
# (the q/k/v and gate/up inputs and the two norm products they come from, 2h each; down_proj's input, 2i) and
# 18h + 2i under classic AMP (fp32 norm products and the bf16 casts of them). Liger's fused norm saves the same
# for both, so only the linears' inputs are counted there (4h + 2i, the smaller, safe-side figure).
FROZEN_LAYER_DISCOUNT_H = {"stock": 8, "stock_classic_amp": 18, "liger": 4}
FROZEN_LAYER_DISCOUNT_I = 2


def frozen_layer_discount_bytes_per_token(
    hidden: int, intermediate: int, classic_amp: bool, liger: bool
) -> int:
    """What a frozen decoder layer that records keeps less than a trained one, per token (see above)."""
    kind = "liger" if liger else ("stock_classic_amp" if classic_amp else "stock")
    return FROZEN_LAYER_DISCOUNT_H[kind] * hidden + FROZEN_LAYER_DISCOUNT_I * intermediate


def eager_attention_bytes_per_token_layer(num_heads: int, seq_len: int) -> int:
    """Eager attention stores the score matrix: 5*a*s bytes per token per layer (Korthikanti)."""
    return EAGER_SCORE_BYTES * num_heads * seq_len


def checkpointed_bytes_per_token_layer(hidden: int) -> int:
    """Per-layer activation checkpointing keeps only each layer's bf16 input: 2*h."""
    return BF16_BYTES * hidden


def activation_bytes(
    tokens: int,
    layers: int,
    full_layer_bytes_per_token: float,
    hidden: int,
    checkpointing: bool,
    factor: float = 1.0,
) -> float:
    """Activations kept for backward over ``layers`` trainable-path layers.

    no checkpointing: tokens * layers * full * factor;
    checkpointing: tokens * (layers * 2h + full * factor) -- one layer is recomputed at a time.
    """
    full = full_layer_bytes_per_token * factor
    if not checkpointing:
        return tokens * layers * full
    return tokens * (layers * checkpointed_bytes_per_token_layer(hidden) + full)


def offloaded_checkpoint_bytes(
    tokens: int, layers: int, full_layer_bytes_per_token: float, hidden: int, factor: float = 1.0
) -> tuple[float, float]:
    """(GPU, CPU) activation bytes with offloaded checkpointing: the GPU keeps one recomputed layer plus
    its input and the prefetched input below it; the layer inputs (layers x tokens x 2h) are in CPU RAM."""
    inputs = checkpointed_bytes_per_token_layer(hidden)
    gpu = tokens * (full_layer_bytes_per_token * factor + (1 + OFFLOAD_PREFETCH_LAYERS) * inputs)
    return gpu, tokens * layers * inputs


# offloaded checkpointing with every layer recomputed: the share of the pending inputs that reaches the
# reserved peak (offload_pending_bytes), fitted on one H200 run
ALL_OFFLOADED_PENDING_SHARE = 0.8


def offload_pending_bytes(tokens: int, offloaded_layers: int, kept_layers: int, hidden: int) -> float:
    """Offloaded checkpointing's reserved-only margin: each recomputed layer's input is freed on the compute
    stream while its device-to-host copy may still run (models/offload_ckpt.py: record_stream), so the
    caching allocator cannot hand that block out again until the copy lands, and the forward allocates past
    it: one more copy of the offloaded inputs is reserved, never allocated. With layers that keep their
    activations the end of the forward is the peak and all of it shows; with every layer recomputed the
    peak is in the backward, where the forward's pending blocks are mostly back in use
    (ALL_OFFLOADED_PENDING_SHARE). Fitted on three H200 runs of the 7B LoRA fp8 8 x 2048 (measured reserved
    14.59 GiB with 28 layers offloaded, 20.96 with 25 offloaded and 3 kept, 82.3 with 1 offloaded; the
    planner's reserved with this term 14.74, 21.16, 84.64)."""
    share = 1.0 if kept_layers else ALL_OFFLOADED_PENDING_SHARE
    return share * tokens * offloaded_layers * checkpointed_bytes_per_token_layer(hidden)


# Partial checkpointing's peak is the start of the backward, where every kept layer's activations are still
# live and the first backward kernels allocate on top of them. With transformers' own blocks (no Liger) two
# places allocate most, whichever is larger is the peak (traced on CPU, tests/unit/plan/
# test_partial_backward_peak.py; at the GPU run's widths below 21,768 B/token traced, 24h = 21,504; autograd's
# formulas are the same on the GPU):
# - the final RMSNorm (fp32 math: x.float(), pow, mean, rsqrt, mul): its saved fp32 input (4h, in no layer's
#   term) and, in its backward, five fp32 [tokens, h] temporaries live at once (traced: the two mul grads,
#   the mean's grad / h, pow's x^1 and its 2x) -> 6 x 4h = 24h B per token;
# - the top layer's SwiGLU backward: the down projection's input grad and the two mul grads (3 x 2i) and the
#   residual grad (2h), less the product that down_proj saved, freed with its node (2i) -> 4i + 2h.
# Liger's RMSNorm/SwiGLU kernels write their grads into existing buffers (dY; the saved gate and up): not
# added (its 7B LoRA partial runs, plan_accuracy.json partial_offload_checks, were +2.3% and +0.8% without it).
# Measured on the H200 (tests/gpu/test_partial_ckpt_gpu.py: 12 layers of Qwen2.5-0.5B's widths, vocab 1024,
# LoRA, no Liger, 8 x 2048, 6 of 12 layers recomputed): 6.13 GiB allocated, 5.77 predicted without this term
# (-5.9%); with it 24h x 16,384 tokens = +0.33 GiB: 6.10 (-0.5%). Offloaded (use_unsloth_gc): 6.00 measured,
# 5.66 -> 5.99. With every layer recomputed the peak is a recompute, after this (activation_bytes).
STOCK_NORM_BACKWARD_FP32_COPIES = 6  # the saved fp32 input + five fp32 temporaries of the backward
STOCK_SWIGLU_BACKWARD_INTERMEDIATE_COPIES = 2  # (3 grads - the freed saved product) x 2i bf16 = 4i
# With every layer recomputed (full checkpointing) the peak is the top layer's recompute: the checkpointed
# inputs, that layer's full activations, and on top its backward's first allocations -- with transformers'
# own SwiGLU the same 4i + 2h as above, plus the gradient of the layer's output that the backward holds
# meanwhile (bf16, 2h): 4i + 4h per token. Traced on CPU (tests/unit/plan/test_partial_backward_peak.py,
# three widths: the peak less the inputs and one layer came to 4i + 4h within 4%); measured on the H200,
# r6_sft_unpacked_7b_lora_mb8_ckpt (plan_accuracy.json, 13,360 tokens, no Liger) peaked 1.06 GiB above the
# planner without it (-5.1%); 4i + 4h = 1.12 GiB (+0.3%). Liger's SwiGLU backward allocates none of it.
STOCK_RECOMPUTE_OUTPUT_GRAD_BYTES = BF16_BYTES  # per hidden unit: the layer output's gradient


def stock_swiglu_backward_bytes_per_token(hidden: int, intermediate: int) -> int:
    """What transformers' own SwiGLU backward allocates at its start, per token: 4i + 2h (derivation above)."""
    return BF16_BYTES * (STOCK_SWIGLU_BACKWARD_INTERMEDIATE_COPIES * intermediate + hidden)


def stock_backward_start_bytes_per_token(hidden: int, intermediate: int) -> int:
    """Bytes per token that the start of the backward adds to the kept activations with transformers' own
    RMSNorm and SwiGLU (no Liger): max(final norm 24h, top layer's SwiGLU 4i + 2h) (derivation above)."""
    norm = STOCK_NORM_BACKWARD_FP32_COPIES * FP32_BYTES * hidden
    return max(norm, stock_swiglu_backward_bytes_per_token(hidden, intermediate))


def stock_recompute_backward_bytes_per_token(hidden: int, intermediate: int) -> int:
    """Bytes per token on top of a recomputed layer when its backward starts, transformers' own SwiGLU (no
    Liger): 4i + 2h + the output's gradient 2h = 4i + 4h (derivation above)."""
    return (
        stock_swiglu_backward_bytes_per_token(hidden, intermediate)
        + STOCK_RECOMPUTE_OUTPUT_GRAD_BYTES * hidden
    )


def partial_checkpoint_bytes(
    tokens: int,
    kept: int,
    recomputed: int,
    full_layer_bytes_per_token: float,
    hidden: int,
    factor: float = 1.0,
    offload: bool = False,
    backward_start_per_token: float = 0.0,
    recompute_backward_per_token: float = 0.0,
) -> float:
    """GPU activation bytes with only ``recomputed`` of the layers checkpointed (the first ones) and ``kept``
    layers (the last ones) keeping their activations: the peak is the start of the backward, kept x full +
    the recomputed layers' inputs (offloaded: in CPU RAM; the GPU holds the input in flight and the
    prefetched one) + what the first backward kernels allocate on top (``backward_start_per_token``:
    stock_backward_start_bytes_per_token without Liger, 0 with it). Later in the backward the kept layers
    are freed before the first recompute, so the recomputed layer never adds to them. ``kept`` = 0 is full
    checkpointing (activation_bytes: its peak is a recompute, with ``recompute_backward_per_token`` on top:
    stock_recompute_backward_bytes_per_token without Liger, 0 with it)."""
    inputs = checkpointed_bytes_per_token_layer(hidden)
    if kept == 0 and offload:
        gpu, _ = offloaded_checkpoint_bytes(tokens, recomputed, full_layer_bytes_per_token, hidden, factor)
        return gpu + tokens * recompute_backward_per_token
    if kept == 0:
        every = activation_bytes(tokens, recomputed, full_layer_bytes_per_token, hidden, True, factor)
        return every + tokens * recompute_backward_per_token
    held = (1 + OFFLOAD_PREFETCH_LAYERS) if offload else recomputed
    per_token = kept * full_layer_bytes_per_token * factor + min(held, recomputed) * inputs
    return tokens * (per_token + backward_start_per_token)


def logits_bytes(
    tokens: int, vocab: int, fused: bool, chunk_tokens: int = FUSED_CE_CHUNK_TOKENS, zero3: bool = False
) -> float:
    """Unfused HF loss: 10 B * tokens * V (12 B under ZeRO-3); fused linear-CE: chunk * V * 4 B (REFERENCE 7.3)."""
    if fused:
        return min(tokens, chunk_tokens) * vocab * FUSED_CE_BYTES
    return (UNFUSED_LOGITS_BYTES_ZERO3 if zero3 else UNFUSED_LOGITS_BYTES) * tokens * vocab


def chunked_ce_bytes(
    tokens: int, vocab: int, hidden: int, head_trainable: bool, over_checkpointed_inputs: bool = False
) -> float:
    """lmstack's chunked linear CE peak: live chunks x bytes x chunk x V (+ the head gradient's V x h).
    `over_checkpointed_inputs`: every decoder layer is checkpointed, so only their inputs are alive at the head:
    the traced bytes (LMSTACK_CE_TRACED_BYTES and the head side's own per-token tensors) instead of the
    fitted LMSTACK_CE_BYTES."""
    chunk = min(tokens, LMSTACK_CE_CHUNK_TOKENS)
    live = 1 if tokens <= LMSTACK_CE_CHUNK_TOKENS else LMSTACK_CE_LIVE_CHUNKS
    head = LMSTACK_CE_HEAD_BYTES * vocab * hidden if head_trainable else 0
    if over_checkpointed_inputs:
        side = LMSTACK_CE_SIDE_BYTES_PER_HIDDEN * tokens * hidden
        return live * LMSTACK_CE_TRACED_BYTES * chunk * vocab + head + side
    return live * LMSTACK_CE_BYTES * chunk * vocab + head


def trl_logprob_bytes(tokens: int, vocab: int, hidden: int, head_trainable: bool) -> float:
    """TRL's fused log-prob head over `tokens` label positions: one bf16 tile, the kept hidden states and
    their fp32 gradient, the fp32 head gradient when the head trains (memory.py constants above)."""
    tile = min(tokens, TRL_LOGPROB_TOKEN_TILE) * min(vocab, TRL_LOGPROB_VOCAB_TILE) * BF16_BYTES
    head = TRL_LOGPROB_HEAD_GRAD_BYTES * vocab * hidden if head_trainable else 0
    return tile + TRL_LOGPROB_HIDDEN_BYTES * tokens * hidden + head


def kv_cache_bytes(sequences: int, length: int, layers: int, kv_dim: int) -> float:
    """K and V of every layer for `sequences` rows of `length` tokens (bf16)."""
    return KV_CACHE_BYTES * sequences * length * layers * kv_dim


def sampling_logits_bytes(sequences: int, vocab: int) -> float:
    """The last position's fp32 logits and their sampling copy, per generated step."""
    return SAMPLING_LOGITS_BYTES * sequences * vocab


def overhead_bytes(other_bytes: float, fragmentation: float = FRAGMENTATION_FACTOR) -> float:
    """CUDA context/workspaces plus allocator fragmentation on everything else."""
    return CUDA_CONTEXT_GIB * GIB + (fragmentation - 1.0) * other_bytes


def breakdown(
    weights: float,
    gradients: float,
    optimizer: float,
    activations: float,
    logits: float,
    adapters: float = 0.0,
    overhead: float | None = None,
    terms: tuple[tuple[str, float], ...] = (),
    fragmentation: float = FRAGMENTATION_FACTOR,
    reserved_extra: float = 0.0,
) -> MemoryBreakdown:
    """Assemble a ``MemoryBreakdown`` (inputs in bytes, fields in GiB). ``terms``: the stage's named
    rows in bytes; ``fragmentation``: the reserved/allocated factor of the margin row; ``reserved_extra``:
    bytes the caching allocator reserves beyond that and never hands out (offload_pending_bytes)."""
    stage = sum(v for _, v in terms)
    parts = weights + gradients + optimizer + activations + logits + adapters + stage
    if overhead is None:
        frag, context = (fragmentation - 1.0) * parts + reserved_extra, CUDA_CONTEXT_GIB * GIB
    else:  # a caller's own overhead figure (Megatron layouts): no split
        frag, context = 0.0, overhead
    return MemoryBreakdown(
        weights=weights / GIB,
        gradients=gradients / GIB,
        optimizer=optimizer / GIB,
        activations=activations / GIB,
        logits=logits / GIB,
        adapters=adapters / GIB,
        overhead=(frag + context) / GIB,
        total=(parts + frag + context) / GIB,
        stage=stage / GIB,
        terms=tuple((name, v / GIB) for name, v in terms),
        fragmentation=frag / GIB,
        cuda_context=context / GIB,
    )
