"""A causal LM with a scalar value head: the reward model of `stage: rm` and the critic of `stage: ppo`.

Saved as the backbone's own files (LoRA adapter or full weights) plus `value_head.safetensors` beside
them (keys `v_head.summary.weight` / `v_head.summary.bias`, LLaMA-Factory's names).
`load_reward_model(path)` loads an rm output dir back and scores text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

VALUE_HEAD_FILE = "value_head.safetensors"


class ValueHeadModel(nn.Module):
    """`backbone` (a causal LM, PEFT-wrapped or not) + Linear(hidden, 1) on the last hidden state."""

    main_input_name = "input_ids"  # what the Trainer counts as input tokens

    def __init__(self, backbone: Any):
        super().__init__()
        self.backbone = backbone
        self.v_head = nn.Linear(backbone.config.get_text_config().hidden_size, 1)
        nn.init.zeros_(self.v_head.bias)
        nn.init.normal_(self.v_head.weight, std=1.0 / (backbone.config.get_text_config().hidden_size + 1))

    @property
    def config(self) -> Any:
        return self.backbone.config

    def values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Per-token values, shape (batch, seq)."""
        positions = None if attention_mask is None else (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        out = self.backbone(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions,  # correct under left padding too
            output_hidden_states=True,
            use_cache=False,
            logits_to_keep=1,  # the LM logits are not needed
        )
        hidden = out.hidden_states[-1]
        return self.v_head(hidden.to(self.v_head.weight.dtype)).squeeze(-1)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **_: Any) -> Any:
        """Sequence score = the value at the last real token; `.logits` has shape (batch, 1)."""
        from transformers.modeling_outputs import SequenceClassifierOutput

        values = self.values(input_ids, attention_mask)
        return SequenceClassifierOutput(logits=last_token(values, attention_mask).unsqueeze(-1))

    # what trainers call on a model
    def gradient_checkpointing_enable(self, **kwargs: Any) -> None:
        self.backbone.gradient_checkpointing_enable(**kwargs)

    def add_model_tags(self, tags: Any) -> None:
        if hasattr(self.backbone, "add_model_tags"):
            self.backbone.add_model_tags(tags)

    def save_pretrained(self, output_dir: str | Path, **kwargs: Any) -> None:
        from safetensors.torch import save_file

        self.backbone.save_pretrained(output_dir, **kwargs)
        head = {
            "v_head.summary.weight": self.v_head.weight.detach().float().cpu().contiguous(),
            "v_head.summary.bias": self.v_head.bias.detach().float().cpu().contiguous(),
        }
        save_file(head, str(Path(output_dir) / VALUE_HEAD_FILE))

    def load_value_head(self, path: str | Path) -> None:
        from safetensors.torch import load_file

        state = load_file(str(Path(path) / VALUE_HEAD_FILE))
        with torch.no_grad():
            self.v_head.weight.copy_(state["v_head.summary.weight"])
            self.v_head.bias.copy_(state["v_head.summary.bias"])


def last_token(values: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """The value at each row's last attended position (any padding side)."""
    if attention_mask is None:
        return values[:, -1]
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    last = (attention_mask.long() * positions).argmax(dim=1)
    return values.gather(1, last.unsqueeze(1)).squeeze(1)


class RewardModel:
    """A loaded reward model: `score(texts)` / `score_ids(ids)` -> one float per sequence."""

    def __init__(self, model: ValueHeadModel, tokenizer: Any):
        self.model = model.eval()
        self.tokenizer = tokenizer

    @torch.no_grad()
    def score_ids(self, sequences: list[list[int]]) -> list[float]:
        device = next(self.model.parameters()).device
        width = max(len(s) for s in sequences)
        pad = self.tokenizer.pad_token_id or 0
        ids = torch.full((len(sequences), width), pad, dtype=torch.long, device=device)
        mask = torch.zeros_like(ids)
        for i, s in enumerate(sequences):
            ids[i, : len(s)] = torch.tensor(s, device=device)
            mask[i, : len(s)] = 1
        return self.model(input_ids=ids, attention_mask=mask).logits.squeeze(-1).float().tolist()

    def score(self, texts: list[str]) -> list[float]:
        return self.score_ids([self.tokenizer.encode(t, add_special_tokens=False) for t in texts])


def load_value_head_model(
    path: str | Path, dtype: Any = torch.float32, device: str = "cpu"
) -> ValueHeadModel:
    """An rm output dir (adapter + value head, or full weights + value head) -> a ValueHeadModel."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if not (path / VALUE_HEAD_FILE).is_file():
        raise FileNotFoundError(
            f"{path}: no {VALUE_HEAD_FILE}; give the output_dir of an lmstack `stage: rm` run"
        )
    adapter_cfg = path / "adapter_config.json"
    if adapter_cfg.is_file():
        from peft import PeftModel

        base_path = json.loads(adapter_cfg.read_text())["base_model_name_or_path"]
        base = AutoModelForCausalLM.from_pretrained(base_path, dtype=dtype)
        backbone = PeftModel.from_pretrained(base, str(path)).merge_and_unload()
    else:
        backbone = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    model = ValueHeadModel(backbone)
    model.load_value_head(path)
    return model.to(device)


def load_reward_model(path: str | Path, device: str = "cpu") -> RewardModel:
    """Load an lmstack rm output dir and its tokenizer: `load_reward_model(dir).score(["text", ...])`."""
    from transformers import AutoTokenizer

    model = load_value_head_model(path, device=device)
    for p in model.parameters():
        p.requires_grad_(False)
    return RewardModel(model, AutoTokenizer.from_pretrained(str(path)))
