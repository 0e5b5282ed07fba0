"""Optimizers the Trainer does not build from `optim` alone: LoRA+ learning-rate groups, GaLore,
APOLLO, BAdam, Adam-mini and Muon (as LLaMA-Factory configures them), and the Trainer callbacks some of them need.

The rules on combining them live in `method_rules.py` (run in preflight).
`create_optimizer(cfg, model, args)` returns the optimizer for `Trainer(optimizers=(opt, None))`, or
None when the Trainer's own `optim` handling is enough. The Trainer builds the LR schedule on top.
Published implementations do the maths: peft (LoRA+), galore-torch, apollo-torch, badam, adam-mini,
torch.optim.Muon.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from lmstack.config.errors import ConfigError
from lmstack.config.schema import Config

logger = logging.getLogger(__name__)


def create_optimizer(cfg: Config, model: Any, args: Any) -> Any:
    """The optimizer for `Trainer(optimizers=(opt, None))`, or None for the Trainer's default."""
    ft = cfg.finetuning
    if ft.loraplus_lr_ratio is not None:
        return _loraplus(cfg, model, args)
    if ft.use_galore or ft.use_apollo:
        return _low_rank(cfg, model, "galore" if ft.use_galore else "apollo")
    if ft.use_badam:
        return _badam(cfg, model, args)
    if ft.use_adam_mini:
        return _adam_mini(cfg, model)
    if ft.use_muon:
        return _muon(cfg, model)
    return None


def _adam_mini(cfg: Config, model: Any) -> Any:
    """Adam-mini (the `adam-mini` package, as LLaMA-Factory builds it): Adam's first moment per weight,
    one second-moment value per block: a head for q/k, an output neuron for v/o/MLP, a token row for the
    embedding and head; the model's hidden size and head counts tell it where the heads are."""
    from adam_mini import Adam_mini

    t = cfg.training
    config = getattr(model.config, "text_config", None) or model.config
    optimizer = Adam_mini(
        named_parameters=model.named_parameters(),
        lr=t.learning_rate,
        betas=(t.adam_beta1, t.adam_beta2),
        eps=t.adam_epsilon,
        weight_decay=t.weight_decay,
        dim=config.hidden_size,
        n_heads=config.num_attention_heads,
        n_kv_heads=getattr(config, "num_key_value_heads", None),
        verbose=False,
    )
    logger.info("Adam-mini: %d parameter blocks", len(optimizer.param_groups))
    return optimizer


def _adam_kwargs(cfg: Config) -> dict:
    t = cfg.training
    return {"lr": t.learning_rate, "betas": (t.adam_beta1, t.adam_beta2), "eps": t.adam_epsilon}


def _decay_split(params: list[tuple[str, Any]], weight_decay: float) -> list[dict]:
    """Matrices decay, vectors (biases, norms) do not."""
    decay = [p for _, p in params if p.ndim >= 2]
    rest = [p for _, p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def _loraplus(cfg: Config, model: Any, args: Any) -> Any:
    from peft.optimizers import create_loraplus_optimizer
    from transformers import Trainer

    optimizer_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    kwargs.pop("lr", None)
    optimizer = create_loraplus_optimizer(
        model,
        optimizer_cls,
        lr=cfg.training.learning_rate,
        loraplus_lr_ratio=cfg.finetuning.loraplus_lr_ratio,
        loraplus_lr_embedding=cfg.finetuning.loraplus_lr_embedding,
        weight_decay=cfg.training.weight_decay,
        **kwargs,
    )
    logger.info(
        "LoRA+: lora_B learning rate = %g x %g", cfg.finetuning.loraplus_lr_ratio, cfg.training.learning_rate
    )
    return optimizer


def _target_names(cfg: Config, model: Any, target: str) -> list[str]:
    from lmstack.models.adapters import find_all_linear_modules

    if target.strip() == "all":
        return find_all_linear_modules(model)
    return [t.strip() for t in target.split(",") if t.strip()]


def _low_rank(cfg: Config, model: Any, kind: str) -> Any:
    """GaLore / APOLLO: the weights of the targeted linear layers get projected optimizer states."""
    import torch

    ft = cfg.finetuning
    targets = _target_names(cfg, model, getattr(ft, f"{kind}_target"))
    head = model.get_output_embeddings()
    low_rank_ids = set()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and module is not head and name.split(".")[-1] in targets:
            if module.weight.requires_grad:
                low_rank_ids.add(id(module.weight))
    if not low_rank_ids:
        raise ConfigError(
            f"{kind}_target: {getattr(ft, f'{kind}_target')!r} matches no trainable linear layer; "
            f"linear layers are: {', '.join(_target_names(cfg, model, 'all'))}"
        )
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    others = [(n, p) for n, p in trainable if id(p) not in low_rank_ids]
    low_rank = [p for _, p in trainable if id(p) in low_rank_ids]
    extra = _low_rank_group_keys(cfg, kind)
    groups = _decay_split(others, cfg.training.weight_decay)
    groups.append({"params": low_rank, "weight_decay": cfg.training.weight_decay, **extra})
    optimizer_cls, kwargs = _low_rank_class(cfg, kind)
    logger.info(
        "%s: %d matrices projected to rank %d (%s)",
        kind,
        len(low_rank),
        extra["rank"],
        optimizer_cls.__name__,
    )
    if not getattr(ft, f"{kind}_layerwise"):
        return optimizer_cls(groups, **kwargs)
    return _layerwise(groups, optimizer_cls, kwargs, cfg.training.max_grad_norm)


def _low_rank_group_keys(cfg: Config, kind: str) -> dict:
    ft = cfg.finetuning
    if kind == "galore":
        return {
            "rank": ft.galore_rank,
            "update_proj_gap": ft.galore_update_interval,
            "scale": ft.galore_scale,
            "proj_type": ft.galore_proj_type,
        }
    return {
        "rank": ft.apollo_rank,
        "proj": ft.apollo_proj,
        "proj_type": ft.apollo_proj_type,
        "update_proj_gap": ft.apollo_update_interval,
        "scale": ft.apollo_scale,
        "scale_type": ft.apollo_scale_type,
    }


def _low_rank_class(cfg: Config, kind: str) -> tuple[Any, dict]:
    kwargs = _adam_kwargs(cfg)
    if kind == "apollo":
        from apollo_torch import APOLLOAdamW

        return APOLLOAdamW, {**kwargs, "scale_front": cfg.finetuning.apollo_scale_front}
    import galore_torch

    optim = cfg.training.optim
    if optim == "adafactor":
        return galore_torch.GaLoreAdafactor, {
            "lr": kwargs["lr"],
            "relative_step": False,
            "scale_parameter": False,
        }
    if optim in ("adamw_8bit", "adamw_bnb_8bit"):
        return galore_torch.GaLoreAdamW8bit, kwargs
    return galore_torch.GaLoreAdamW, {**kwargs, "no_deprecation_warning": True}


def _layerwise(groups: list[dict], optimizer_cls: Any, kwargs: dict, max_grad_norm: float) -> Any:
    """One optimizer per parameter, stepped as soon as its gradient is ready; the Trainer gets a no-op
    stand-in, and transformers' get_scheduler gives each parameter its own schedule."""
    from transformers.trainer_pt_utils import LayerWiseDummyOptimizer

    per_param = {}
    for group in groups:
        settings = {k: v for k, v in group.items() if k != "params"}
        for p in group["params"]:
            per_param[p] = optimizer_cls([{"params": [p], **settings}], **kwargs)

    def step_now(param: Any) -> None:
        if param.grad is not None:
            per_param[param].step()
            per_param[param].zero_grad()

    for p in per_param:
        p.register_post_accumulate_grad_hook(step_now)
    if max_grad_norm:
        logger.warning(
            "max_grad_norm: %s has no effect with a layer-wise optimizer (no global norm)", max_grad_norm
        )
    return LayerWiseDummyOptimizer(optimizer_dict=per_param, lr=kwargs["lr"])


def _badam(cfg: Config, model: Any, args: Any) -> Any:
    """Layer-mode BAdam: AdamW over one decoder layer at a time; fp32 copies of that block only."""
    import torch
    from badam import BlockOptimizer

    ft = cfg.finetuning
    named = list(model.named_parameters())
    checkpointing = getattr(model, "is_activation_checkpointing", None)  # transformers >= 5.2x name
    if checkpointing is None:
        checkpointing = getattr(model, "is_gradient_checkpointing", False)
    if checkpointing:
        model.enable_input_require_grads()  # the frozen embedding must not cut a checkpointed block's graph
    base = torch.optim.AdamW(_decay_split(named, cfg.training.weight_decay), **_adam_kwargs(cfg))
    optimizer = BlockOptimizer(
        base_optimizer=base,
        named_parameters_list=named,
        block_prefix_list=None,
        switch_block_every=ft.badam_switch_interval,
        start_block=ft.badam_start_block,
        switch_mode=ft.badam_switch_mode,
        verbose=ft.badam_verbose,
    )
    # badam 1.4 tests `(global_step + 1) % interval` after counting the step, so the first block would
    # get interval - 1 steps; counting from 1 gives every block exactly badam_switch_interval steps
    optimizer.global_step = 1
    logger.info("BAdam: %d blocks, switching every %d steps", optimizer.block_num, ft.badam_switch_interval)
    return optimizer


def muon_split(model: Any) -> tuple[list, list]:
    """(Muon params, AdamW params): Muon takes the trainable 2-D weights except the embedding and head."""
    skip = {id(model.get_input_embeddings().weight)}
    head = model.get_output_embeddings()
    if head is not None:
        skip.add(id(head.weight))
    muon, adamw = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (muon if p.ndim == 2 and id(p) not in skip else adamw).append((name, p))
    return muon, adamw


def _muon(cfg: Config, model: Any) -> Any:
    muon, adamw = muon_split(model)
    logger.info("Muon: %d matrices with Muon, %d tensors with AdamW", len(muon), len(adamw))
    return MuonWithAdamW(muon, adamw, cfg)


def _muon_cls() -> Any:
    import torch

    if not hasattr(torch.optim, "Muon"):
        raise ConfigError(
            f"use_muon: needs torch.optim.Muon (torch >= 2.9); this is torch {torch.__version__}"
        )
    return torch.optim.Muon


def _new_muon(params: list, lr: float, weight_decay: float) -> Any:
    import inspect

    muon = _muon_cls()
    kwargs = {"lr": lr, "weight_decay": weight_decay}
    if "adjust_lr_fn" in inspect.signature(muon).parameters:
        kwargs["adjust_lr_fn"] = (
            "match_rms_adamw"  # Muon's step matches AdamW's RMS: one learning_rate for both
        )
    else:
        logger.warning("this torch's Muon has no adjust_lr_fn: learning_rate applies to Muon unscaled")
    return muon(params, **kwargs)


def _make_muon_with_adamw() -> Any:
    import torch

    class _MuonWithAdamW(torch.optim.Optimizer):
        """torch.optim.Muon for the hidden matrices, torch.optim.AdamW for everything else, exposed as one
        optimizer: its param_groups are the two inner optimizers' live groups, so LR schedules reach both
        (also after load_state_dict, which replaces the inner group dicts)."""

        def __init__(self, muon: list, adamw: list, cfg: Config):
            t = cfg.training
            self.inner: list = []
            super().__init__([p for _, p in muon + adamw], {"lr": t.learning_rate})
            self.muon = _new_muon([p for _, p in muon], t.learning_rate, t.weight_decay) if muon else None
            self.adamw = torch.optim.AdamW(_decay_split(adamw, t.weight_decay), **_adam_kwargs(cfg))
            self.inner = [o for o in (self.muon, self.adamw) if o is not None]

        @property
        def param_groups(self) -> list:
            if not self.inner:  # during Optimizer.__init__
                return self.__dict__.setdefault("_own_groups", [])
            return [g for o in self.inner for g in o.param_groups]

        @param_groups.setter
        def param_groups(self, groups: list) -> None:
            self.__dict__["_own_groups"] = groups

        @torch.no_grad()
        def step(self, closure=None):
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            for optimizer in self.inner:
                optimizer.step()
            return loss

        def zero_grad(self, set_to_none: bool = True) -> None:
            for optimizer in self.inner:
                optimizer.zero_grad(set_to_none=set_to_none)

        def state_dict(self) -> dict:
            return {"muon": self.muon.state_dict() if self.muon else None, "adamw": self.adamw.state_dict()}

        def load_state_dict(self, state_dict: dict) -> None:
            if self.muon is not None:
                self.muon.load_state_dict(state_dict["muon"])
            self.adamw.load_state_dict(state_dict["adamw"])

    return _MuonWithAdamW


def MuonWithAdamW(muon: list, adamw: list, cfg: Config) -> Any:  # noqa: N802 (class factory)
    return _make_muon_with_adamw()(muon, adamw, cfg)


def method_callbacks(cfg: Config) -> list:
    """Trainer callbacks some methods need: PiSSA conversion, BAdam with gradient checkpointing."""
    from transformers import TrainerCallback

    callbacks = []
    if cfg.finetuning.pissa_convert:
        from lmstack.models.adapters import PISSA_CONVERTED, PISSA_INIT

        class PissaConvert(TrainerCallback):
            """Saves the initial PiSSA adapter at the start and, at the end, the trained adapter converted
            to a plain LoRA that applies to the original base (output_dir/pissa_converted)."""

            def on_train_begin(self, args, state, control, model=None, **kwargs):
                if state.is_world_process_zero and state.global_step == 0:
                    _save_plain(model, os.path.join(args.output_dir, PISSA_INIT))

            def on_train_end(self, args, state, control, model=None, **kwargs):
                if state.is_world_process_zero:
                    _save_plain(
                        model,
                        os.path.join(args.output_dir, PISSA_CONVERTED),
                        path_initial_model_for_weight_conversion=os.path.join(args.output_dir, PISSA_INIT),
                    )

        callbacks.append(PissaConvert())
    return callbacks


def _save_plain(model: Any, path: str, **kwargs: Any) -> None:
    """save_pretrained with init_lora_weights=True in the written config (the base it applies to is the
    original one), restoring the PiSSA setting afterwards."""
    config = model.peft_config["default"]
    init = config.init_lora_weights
    config.init_lora_weights = True
    try:
        model.save_pretrained(path, **kwargs)
    finally:
        config.init_lora_weights = init
    logger.info("wrote %s", path)
