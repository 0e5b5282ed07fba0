"""HF <-> megatron-core weights for the dense Qwen2 / Qwen3 / Llama families (our own mapping).

A megatron-core GPTModel (local layer spec) holds per layer:
- ``self_attention.linear_qkv``: q, k and v fused and grouped by query group: for each KV group g, the
  rows of its ``heads_per_group`` query heads, then its k head, then its v head. Tensor parallelism
  splits the groups: rank r holds groups [r*G/tp, (r+1)*G/tp) (G = num_key_value_heads).
- ``self_attention.linear_proj`` = o_proj, split along its input (column) dimension.
- ``mlp.linear_fc1`` = [gate_proj; up_proj]; under TP each rank holds [its gate shard; its up shard].
- ``mlp.linear_fc2`` = down_proj, split along its input dimension.
- ``embedding.word_embeddings`` and ``output_layer`` split along the vocabulary (rows).
- Qwen3's q_norm / k_norm are ``self_attention.q_layernorm`` / ``k_layernorm`` (not split).
Pipeline parallelism numbers the layers locally on each stage: global layer = offset + local index.
torch and megatron are imported inside the functions: importing this module loads neither.
"""

from __future__ import annotations

from dataclasses import dataclass

FAMILIES = ("qwen2", "qwen3", "llama")


@dataclass(frozen=True)
class Shape:
    """The facts of an HF config the mapping needs."""

    layers: int
    hidden: int
    heads: int
    groups: int  # num_key_value_heads
    head_dim: int
    ffn: int
    vocab: int
    eps: float
    rope_theta: float
    qkv_bias: bool
    qk_norm: bool
    tied: bool


def shape_of(hf_config) -> Shape:
    """The mapping's facts from a transformers config; refuses a family the mapping does not cover."""
    family = hf_config.model_type
    if family not in FAMILIES:
        raise ValueError(
            f"model_type: got {family!r}; the Megatron backend maps {' | '.join(FAMILIES)} (dense) only"
        )
    heads = hf_config.num_attention_heads
    rope = getattr(hf_config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return Shape(
        layers=hf_config.num_hidden_layers,
        hidden=hf_config.hidden_size,
        heads=heads,
        groups=getattr(hf_config, "num_key_value_heads", None) or heads,
        head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
        ffn=hf_config.intermediate_size,
        vocab=hf_config.vocab_size,
        eps=hf_config.rms_norm_eps,
        rope_theta=float(theta),
        qkv_bias=family == "qwen2" or bool(getattr(hf_config, "attention_bias", False)),
        qk_norm=family == "qwen3",
        tied=bool(getattr(hf_config, "tie_word_embeddings", False)),
    )


def transformer_config(s: Shape, tp: int = 1, pp: int = 1, dtype=None, **extra):
    """megatron-core's TransformerConfig of an HF shape (RMSNorm, SwiGLU, no linear biases, RoPE)."""
    import torch
    import torch.nn.functional as F  # noqa: N812
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = dtype or torch.float32
    return TransformerConfig(
        num_layers=s.layers, hidden_size=s.hidden, num_attention_heads=s.heads,
        num_query_groups=s.groups, kv_channels=s.head_dim, ffn_hidden_size=s.ffn,
        layernorm_epsilon=s.eps, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, add_qkv_bias=s.qkv_bias, qk_layernorm=s.qk_norm,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dtype, pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, use_cpu_initialization=True, **extra,
    )  # fmt: skip


def build_gpt(s: Shape, config, pre_process: bool = True, post_process: bool = True):
    """The megatron-core GPTModel of this shape (parallel state already initialised)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    spec = get_gpt_layer_local_spec(qk_layernorm=s.qk_norm, normalization="RMSNorm")
    return GPTModel(
        config, spec, vocab_size=s.vocab, max_sequence_length=4096, pre_process=pre_process,
        post_process=post_process, share_embeddings_and_output_weights=s.tied,
        position_embedding_type="rope", rotary_base=int(s.rope_theta),
    )  # fmt: skip


def _qkv_fused(s: Shape, q, k, v):
    """[q; k; v] (HF rows) -> megatron's group-interleaved rows (works for weights and biases)."""
    import torch

    per = s.heads // s.groups
    rest = q.shape[1:]
    q = q.reshape(s.groups, per * s.head_dim, *rest)
    k = k.reshape(s.groups, s.head_dim, *rest)
    v = v.reshape(s.groups, s.head_dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def _qkv_split(s: Shape, fused):
    """The inverse of _qkv_fused: megatron's rows -> (q, k, v) in HF's layout."""
    per = s.heads // s.groups
    rest = fused.shape[1:]
    g = fused.reshape(s.groups, (per + 2) * s.head_dim, *rest)
    q, k, v = g.split([per * s.head_dim, s.head_dim, s.head_dim], dim=1)
    return (q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest))


def _shard(t, dim: int, tp: int, rank: int):
    return t.chunk(tp, dim=dim)[rank].clone()


def layer_to_megatron(s: Shape, hf: dict, i: int, tp: int, rank: int) -> dict:
    """One decoder layer: HF tensors (``model.layers.{i}.``) -> this TP rank's megatron tensors."""
    import torch

    p = f"model.layers.{i}."
    att = p + "self_attn."
    qkv = _qkv_fused(s, hf[att + "q_proj.weight"], hf[att + "k_proj.weight"], hf[att + "v_proj.weight"])
    gate, up = hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]
    out = {
        "input_layernorm.weight": hf[p + "input_layernorm.weight"],
        "self_attention.linear_qkv.weight": _shard(qkv, 0, tp, rank),
        "self_attention.linear_proj.weight": _shard(hf[att + "o_proj.weight"], 1, tp, rank),
        "pre_mlp_layernorm.weight": hf[p + "post_attention_layernorm.weight"],
        "mlp.linear_fc1.weight": torch.cat([_shard(gate, 0, tp, rank), _shard(up, 0, tp, rank)]),
        "mlp.linear_fc2.weight": _shard(hf[p + "mlp.down_proj.weight"], 1, tp, rank),
    }
    if s.qkv_bias:
        bias = _qkv_fused(s, hf[att + "q_proj.bias"], hf[att + "k_proj.bias"], hf[att + "v_proj.bias"])
        out["self_attention.linear_qkv.bias"] = _shard(bias, 0, tp, rank)
    if s.qk_norm:
        out["self_attention.q_layernorm.weight"] = hf[att + "q_norm.weight"]
        out["self_attention.k_layernorm.weight"] = hf[att + "k_norm.weight"]
    return out


def layer_to_hf(s: Shape, shards: list[dict], i: int) -> dict:
    """One decoder layer: every TP rank's megatron tensors (rank order) -> HF tensors."""
    import torch

    def cat(name: str, dim: int):
        return torch.cat([sh[name] for sh in shards], dim=dim)

    p, att = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
    first = shards[0]
    q, k, v = _qkv_split(s, cat("self_attention.linear_qkv.weight", 0))
    halves = [sh["mlp.linear_fc1.weight"].chunk(2) for sh in shards]
    out = {
        p + "input_layernorm.weight": first["input_layernorm.weight"],
        att + "q_proj.weight": q, att + "k_proj.weight": k, att + "v_proj.weight": v,
        att + "o_proj.weight": cat("self_attention.linear_proj.weight", 1),
        p + "post_attention_layernorm.weight": first["pre_mlp_layernorm.weight"],
        p + "mlp.gate_proj.weight": torch.cat([h[0] for h in halves]),
        p + "mlp.up_proj.weight": torch.cat([h[1] for h in halves]),
        p + "mlp.down_proj.weight": cat("mlp.linear_fc2.weight", 1),
    }  # fmt: skip
    if s.qkv_bias:
        qb, kb, vb = _qkv_split(s, cat("self_attention.linear_qkv.bias", 0))
        out.update({att + "q_proj.bias": qb, att + "k_proj.bias": kb, att + "v_proj.bias": vb})
    if s.qk_norm:
        out[att + "q_norm.weight"] = first["self_attention.q_layernorm.weight"]
        out[att + "k_norm.weight"] = first["self_attention.k_layernorm.weight"]
    return out


def stage_layers(s: Shape, pp: int, pp_rank: int) -> range:
    """The global layers a pipeline stage holds (megatron's even split; PP must divide the layers)."""
    if s.layers % pp:
        raise ValueError(f"pipeline_model_parallel_size: got {pp}; it must divide num_hidden_layers {s.layers}")
    n = s.layers // pp
    return range(pp_rank * n, (pp_rank + 1) * n)


def to_megatron(s: Shape, hf: dict, tp: int = 1, tp_rank: int = 0, pp: int = 1, pp_rank: int = 0) -> dict:
    """An HF state dict -> the state dict of one (TP rank, PP stage) megatron-core GPTModel."""
    out: dict = {}
    for local, i in enumerate(stage_layers(s, pp, pp_rank)):
        for name, t in layer_to_megatron(s, hf, i, tp, tp_rank).items():
            out[f"decoder.layers.{local}.{name}"] = t
    first, last = pp_rank == 0, pp_rank == pp - 1
    if first:
        out["embedding.word_embeddings.weight"] = _shard(hf["model.embed_tokens.weight"], 0, tp, tp_rank)
    if last:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
        if not s.tied or not first:  # a tied model's last stage (PP > 1) holds its copy as output_layer
            head = hf["model.embed_tokens.weight" if s.tied else "lm_head.weight"]
            out["output_layer.weight"] = _shard(head, 0, tp, tp_rank)
    return out


def to_hf(s: Shape, stages: list[list[dict]]) -> dict:
    """Every rank's megatron state dict, ``stages[pp_rank][tp_rank]`` -> one HF state dict."""
    import torch

    pp = len(stages)
    out: dict = {}
    for pp_rank, shards in enumerate(stages):
        for local, i in enumerate(stage_layers(s, pp, pp_rank)):
            pre = f"decoder.layers.{local}."
            mine = [{k[len(pre) :]: v for k, v in sh.items() if k.startswith(pre)} for sh in shards]
            out.update(layer_to_hf(s, mine, i))
    first, last = stages[0], stages[-1]
    out["model.embed_tokens.weight"] = torch.cat([sh["embedding.word_embeddings.weight"] for sh in first])
    out["model.norm.weight"] = last[0]["decoder.final_layernorm.weight"]
    if not s.tied:
        out["lm_head.weight"] = torch.cat([sh["output_layer.weight"] for sh in last])
    return {k: v.contiguous() for k, v in out.items()}


def load_into(model, weights: dict) -> None:
    """Loads mapped weights into a GPTModel, strictly: every parameter set, none left over
    (megatron's ``_extra_state`` entries are not weights and are skipped)."""
    own = {k for k in model.state_dict() if not k.endswith("_extra_state")}
    missing, extra = own - weights.keys(), weights.keys() - own
    if missing or extra:
        raise ValueError(f"megatron weights: missing {sorted(missing)[:5]}, unexpected {sorted(extra)[:5]}")
    model.load_state_dict(weights, strict=False)


def weights_of(model) -> dict:
    """A GPTModel's weights (no ``_extra_state``), detached on CPU."""
    return {k: v.detach().cpu() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
