"""Model shape facts the planner needs, read from ``config.json`` without loading weights.

The exact parameter count comes from instantiating the real transformers class on the meta
device (``accelerate.init_empty_weights``): no memory is allocated and the count matches
``sum(p.numel() for p in model.parameters())`` of the loaded model (tied weights counted once).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Module names PEFT/LF never adapt with ``lora_target: all`` (the output head).
OUTPUT_HEAD_NAMES = ("lm_head", "embed_out", "output_layer")


# the composite vision-language model types (models/vision.py COMPOSITE's keys; a unit test holds them equal):
# counted with AutoModelForImageTextToText so the vision tower is counted too
VISION_MODEL_TYPES = frozenset(
    {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "llava", "qwen2_audio", "gemma3", "internvl"}
)
# of those, the ones AutoModelForImageTextToText does not map: their own class (its audio tower counted)
OWN_CLASS = {"qwen2_audio": "Qwen2AudioForConditionalGeneration"}


@dataclass(frozen=True)
class LinearGroup:
    """All linear leaves that share one leaf name (e.g. every ``q_proj`` in the model)."""

    name: str
    count: int
    weight_params: int  # sum of in*out over the group
    in_plus_out: int  # sum of (in + out) over the group: LoRA adds rank * this


@dataclass(frozen=True)
class ModelSpec:
    """Architecture numbers of a decoder-only causal LM (all counts exact, from the meta model)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool
    num_params: int
    largest_layer_params: int  # biggest single module's own params (DeepSpeed's definition)
    model_type: str
    decoder_layer_class: str
    embed_params: int = 0  # input token embedding
    lm_head_params: int = 0  # 0 when tied to the embedding
    linear_groups: tuple[LinearGroup, ...] = ()

    @property
    def kv_dim(self) -> int:
        """h_kv = KV heads x head_dim (the K and V width of grouped-query attention)."""
        return self.num_kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """Average parameters of one decoder layer (everything except embeddings and head)."""
        rest = self.num_params - self.embed_params - self.lm_head_params
        return rest // max(self.num_layers, 1)

    @property
    def linear_params(self) -> int:
        """Parameters in linear leaves except the output head (what 4/8-bit quantization packs)."""
        return sum(g.weight_params for g in self.linear_groups)

    def lora_params(self, rank: int, target: str | Iterable[str] = "all") -> int:
        """Exact LoRA adapter parameters: rank * (in + out) for every targeted linear leaf.

        ``target='all'`` means every linear leaf except the output head (LF / PEFT
        ``all-linear``); otherwise a list of leaf names such as ``["q_proj", "v_proj"]``.
        """
        if rank <= 0:
            raise ValueError(f"lora_rank: got {rank}; must be a positive integer (e.g. 8, 16, 64)")
        groups = {g.name: g for g in self.linear_groups}
        if target == "all":
            chosen = list(groups.values())
        else:
            names = [target] if isinstance(target, str) else list(target)
            names = [n.strip() for name in names for n in name.split(",") if n.strip()]
            unknown = [n for n in names if n not in groups]
            if unknown:
                raise ValueError(f"lora_target: got {unknown}; allowed: all | {' | '.join(sorted(groups))}")
            chosen = [groups[n] for n in names]
        return rank * sum(g.in_plus_out for g in chosen)

    @classmethod
    def from_pretrained_dir(cls, path: str | Path) -> ModelSpec:
        """Read ``<path>/config.json``: a Llama-family decoder is counted from its fields alone (no torch,
        no transformers: `lmstack plan` stays fast); anything else with AutoConfig on the meta device."""
        spec = from_config_json(Path(path) / "config.json")
        if spec is not None:
            return spec
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(str(path))
        return cls.from_config(cfg)

    @classmethod
    def from_config(cls, cfg: Any) -> ModelSpec:
        """Build the spec from a transformers config object (no weights, meta device only)."""
        from accelerate import init_empty_weights
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        vision = (
            getattr(cfg, "model_type", None) in VISION_MODEL_TYPES
        )  # Qwen2-VL / LLaVA: the vision tower counted too
        with init_empty_weights():
            kind = getattr(cfg, "model_type", None)
            if kind in OWN_CLASS:
                import transformers

                model = getattr(transformers, OWN_CLASS[kind])._from_config(cfg)
            else:
                model = (AutoModelForImageTextToText if vision else AutoModelForCausalLM).from_config(cfg)
        # transformers 5 skips weight tying inside init_empty_weights: tie afterwards, or a
        # tied lm_head is counted twice (e.g. Qwen2.5-0.5B would read 630M instead of 494M).
        model.tie_weights()
        return cls._from_model(text_cfg, model)

    @classmethod
    def _from_model(cls, cfg: Any, model: Any) -> ModelSpec:
        hidden = int(cfg.hidden_size)
        heads = int(cfg.num_attention_heads)
        kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(cfg, "head_dim", None) or hidden // heads)
        inter = getattr(cfg, "intermediate_size", None) or getattr(cfg, "n_inner", None) or 4 * hidden
        embed = model.get_input_embeddings()
        head = model.get_output_embeddings()
        embed_params = embed.weight.numel() if embed is not None else 0
        tied = head is not None and embed is not None and head.weight is embed.weight
        head_params = 0 if (head is None or tied) else sum(p.numel() for p in head.parameters())
        layers = getattr(cfg, "num_hidden_layers", None)
        return cls(
            vocab_size=int(cfg.vocab_size),
            hidden_size=hidden,
            intermediate_size=int(inter),
            num_layers=int(layers),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            tie_word_embeddings=bool(tied),
            num_params=sum(p.numel() for p in model.parameters()),
            largest_layer_params=max(
                sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()
            ),
            model_type=str(getattr(cfg, "model_type", "unknown")),
            decoder_layer_class=_decoder_layer_class(model),
            embed_params=embed_params,
            lm_head_params=head_params,
            linear_groups=_linear_groups(model),
        )


def _decoder_layer_class(model: Any) -> str:
    names = sorted(getattr(model, "_no_split_modules", None) or [])
    if names:
        return str(names[0])
    for module in model.modules():
        if type(module).__name__.endswith(("DecoderLayer", "Block")):
            return type(module).__name__
    return "unknown"


def _linear_in_out(module: Any) -> tuple[int, int] | None:
    """(in, out) for nn.Linear and transformers' Conv1D (GPT-2 family); None otherwise."""
    import torch

    if isinstance(module, torch.nn.Linear):
        return int(module.in_features), int(module.out_features)
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        return int(module.weight.shape[0]), int(module.weight.shape[1])
    return None


def _linear_groups(model: Any) -> tuple[LinearGroup, ...]:
    acc: dict[str, list[int]] = {}
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in OUTPUT_HEAD_NAMES or any(True for _ in module.children()):
            continue
        shape = _linear_in_out(module)
        if shape is None:
            continue
        entry = acc.setdefault(leaf, [0, 0, 0])
        entry[0] += 1
        entry[1] += shape[0] * shape[1]
        entry[2] += shape[0] + shape[1]
    return tuple(LinearGroup(n, c, w, io) for n, (c, w, io) in sorted(acc.items()))


# Decoders whose parameters follow one layout (embedding; per layer q/k/v/o + gate/up/down + two RMSNorms;
# final norm; an untied head): model_type -> (decoder layer class, q/k/v carry a bias, q/k RMSNorm per head)
LLAMA_FAMILY = {
    "llama": ("LlamaDecoderLayer", False, False),
    "mistral": ("MistralDecoderLayer", False, False),
    "qwen2": ("Qwen2DecoderLayer", True, False),
    "qwen3": ("Qwen3DecoderLayer", False, True),
}
REQUIRED_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


def from_config_json(path: Path) -> ModelSpec | None:
    """The exact ModelSpec of a Llama-family decoder from its config.json, counted the way the meta model
    counts it (tests/unit/plan/test_model_spec.py holds them equal); None for any other model or field set."""
    from lmstack.memory.model_facts import config_json

    d = config_json(path.parent) if path.name == "config.json" else None
    if d is None:
        return None
    family = LLAMA_FAMILY.get(d.get("model_type"))
    if family is None or any(not isinstance(d.get(k), int) for k in REQUIRED_FIELDS):
        return None
    if d.get("quantization_config") or d.get("num_experts") or d.get("num_local_experts"):
        return None
    layer_class, qkv_bias, qk_norm = family
    if d["model_type"] in ("llama", "qwen3"):
        qkv_bias = bool(d.get("attention_bias", False))
    o_bias = d["model_type"] in ("llama", "qwen3") and bool(d.get("attention_bias", False))
    mlp_bias = d["model_type"] == "llama" and bool(d.get("mlp_bias", False))
    vocab, h, inter, layers, heads = (int(d[k]) for k in REQUIRED_FIELDS)
    kv_heads = int(d.get("num_key_value_heads") or heads)
    head_dim = int(d.get("head_dim") or h // heads)
    tied = bool(d.get("tie_word_embeddings", False))
    q, kv = heads * head_dim, kv_heads * head_dim
    shapes = {"q_proj": (h, q, qkv_bias), "k_proj": (h, kv, qkv_bias), "v_proj": (h, kv, qkv_bias),
              "o_proj": (q, h, o_bias), "gate_proj": (h, inter, mlp_bias), "up_proj": (h, inter, mlp_bias),
              "down_proj": (inter, h, mlp_bias)}  # fmt: skip
    groups = tuple(
        LinearGroup(name, layers, layers * i * o, layers * (i + o))
        for name, (i, o, _) in sorted(shapes.items())
    )
    own = {name: i * o + (o if bias else 0) for name, (i, o, bias) in shapes.items()}
    per_layer = sum(own.values()) + 2 * h + (2 * head_dim if qk_norm else 0)
    embed = vocab * h
    head = 0 if tied else vocab * h
    return ModelSpec(
        vocab_size=vocab,
        hidden_size=h,
        intermediate_size=inter,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        tie_word_embeddings=tied,
        num_params=embed + layers * per_layer + h + head,
        largest_layer_params=max(embed, head, *own.values()),
        model_type=str(d["model_type"]),
        decoder_layer_class=layer_class,
        embed_params=embed,
        lm_head_params=head,
        linear_groups=groups,
    )
