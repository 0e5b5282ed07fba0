"""LoRA variants (DoRA, rsLoRA, PiSSA, LoRA+) and memory-saving optimizers (GaLore, APOLLO, BAdam, Muon)
on the tiny model: each trains, its loss falls, its output reloads to the trained model, and the
variant is provably active. Plus the combination rules and QLoRA's no-GPU error."""

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lmstack.config.errors import ConfigError
from lmstack.train.run import train

IDS = torch.tensor([[5, 17, 99, 300, 2, 41, 7]])


@pytest.fixture
def spy(monkeypatch):
    """Records the model and optimizer that the stage hands to the Trainer (the real objects, still real)."""
    from lmstack.train import optimizers

    seen: dict = {}
    real = optimizers.create_optimizer

    def recording(cfg, model, args):
        seen["model"] = model
        seen["optimizer"] = real(cfg, model, args)
        return seen["optimizer"]

    monkeypatch.setattr(optimizers, "create_optimizer", recording)
    return seen


def losses(out: Path) -> list[float]:
    rows = [json.loads(x) for x in (out / "trainer_log.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def assert_learns(out: Path, drop: float = 0.2) -> None:
    curve = losses(out)
    assert curve[-1] < curve[0] - drop, curve


def logits(model) -> torch.Tensor:
    model.eval()
    device = next(model.parameters()).device
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        return model(IDS.to(device)).logits.float().cpu()


def reload_adapter(tiny_model, path) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    return logits(PeftModel.from_pretrained(base, path))


def reload_adapter_quantized(tiny_model, path, bits: int) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = (
        BitsAndBytesConfig(load_in_8bit=True)
        if bits == 8
        else BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
            bnb_4bit_quant_storage=torch.bfloat16,
        )
    )
    base = AutoModelForCausalLM.from_pretrained(
        tiny_model, dtype=torch.bfloat16, quantization_config=quant, device_map={"": 0}
    )
    return logits(PeftModel.from_pretrained(base, path))


def lora_cfg(base_cfg, **extra) -> dict:
    return {**base_cfg, "max_steps": 6, "lora_rank": 8, "lora_alpha": 16, **extra}


def full_cfg(base_cfg, **extra) -> dict:
    return {**base_cfg, "finetuning_type": "full", "max_steps": 6, "learning_rate": 1e-3, **extra}


# ---- LoRA variants -------------------------------------------------------------------------------


def test_dora_saves_magnitude_vectors_and_reloads(base_cfg, tiny_model, spy):
    cfg = lora_cfg(base_cfg, use_dora=True)
    train(None, cfg)
    out = Path(cfg["output_dir"])
    assert_learns(out)
    weights = load_file(out / "adapter_model.safetensors")
    magnitudes = [k for k in weights if "lora_magnitude_vector" in k]
    n_lora = len([k for k in weights if "lora_A" in k])
    assert n_lora == 14 and len(magnitudes) == n_lora, sorted(weights)
    assert json.loads((out / "adapter_config.json").read_text())["use_dora"] is True
    torch.testing.assert_close(reload_adapter(tiny_model, out), logits(spy["model"]), atol=1e-5, rtol=0)


def test_rslora_scales_by_sqrt_rank_and_reloads(base_cfg, tiny_model, spy):
    cfg = lora_cfg(base_cfg, use_rslora=True)
    train(None, cfg)
    out = Path(cfg["output_dir"])
    assert_learns(out)
    q_proj = spy["model"].base_model.model.model.layers[0].self_attn.q_proj
    assert q_proj.scaling["default"] == pytest.approx(16 / math.sqrt(8))  # plain LoRA: 16 / 8 = 2
    assert json.loads((out / "adapter_config.json").read_text())["use_rslora"] is True
    torch.testing.assert_close(reload_adapter(tiny_model, out), logits(spy["model"]), atol=1e-5, rtol=0)


def test_pissa_init_rewrites_base_and_converts(base_cfg, tiny_model, spy):
    cfg = lora_cfg(base_cfg, pissa_init=True, pissa_iter=-1, pissa_convert=True, learning_rate=2e-3)
    train(None, cfg)
    out = Path(cfg["output_dir"])
    assert_learns(out)
    # step 0: the adapter holds the principal directions (plain LoRA starts with B = 0) ...
    init = load_file(out / "pissa_init" / "adapter_model.safetensors")
    assert all(v.abs().sum() > 0 for k, v in init.items() if "lora_B" in k)
    # ... and the frozen base keeps only the residual
    original = load_file(Path(tiny_model) / "model.safetensors")
    residual = spy["model"].base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
    assert not torch.allclose(residual, original["model.layers.0.self_attn.q_proj.weight"], atol=1e-3)
    trained = logits(spy["model"])
    # exact SVD (pissa_iter: -1) is reproducible: output_dir's adapter reloads onto the original base
    torch.testing.assert_close(reload_adapter(tiny_model, out), trained, atol=1e-4, rtol=0)
    # the converted adapter is a plain LoRA (rank 2r) for the original base
    converted = json.loads((out / "pissa_converted" / "adapter_config.json").read_text())
    assert converted["init_lora_weights"] is True and converted["r"] == 16
    torch.testing.assert_close(
        reload_adapter(tiny_model, out / "pissa_converted"), trained, atol=1e-4, rtol=0
    )


def test_loraplus_gives_lora_b_a_higher_learning_rate(base_cfg, tiny_model, spy):
    cfg = lora_cfg(base_cfg, loraplus_lr_ratio=16.0, learning_rate=2e-3)
    train(None, cfg)
    out = Path(cfg["output_dir"])
    assert_learns(out)
    names = {id(p): n for n, p in spy["model"].named_parameters()}

    def lrs(kind: str) -> set[float]:
        return {
            g["initial_lr"]
            for g in spy["optimizer"].param_groups
            if g["params"] and all(kind in names[id(p)] for p in g["params"])
        }

    (lr_a,), (lr_b,) = lrs("lora_A"), lrs("lora_B")
    assert lr_a == 2e-3 and lr_b == pytest.approx(16 * lr_a)
    torch.testing.assert_close(reload_adapter(tiny_model, out), logits(spy["model"]), atol=1e-5, rtol=0)


def test_create_new_adapter_merges_the_old_one_and_trains_a_fresh_one(base_cfg, tiny_model, tmp_path, spy):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    first = lora_cfg(base_cfg, max_steps=3, output_dir=str(tmp_path / "first"))
    train(None, first)
    second = lora_cfg(
        base_cfg, adapter_name_or_path=first["output_dir"], create_new_adapter=True, learning_rate=2e-3
    )
    train(None, second)
    # the second run starts from the first one's result (merged), not from the base
    assert losses(Path(second["output_dir"]))[0] < losses(Path(first["output_dir"]))[0] - 0.5
    # the model trained in the second run = base + first adapter merged + the new adapter
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, first["output_dir"]).merge_and_unload()
    rebuilt = PeftModel.from_pretrained(merged, second["output_dir"])
    torch.testing.assert_close(logits(rebuilt), logits(spy["model"]), atol=1e-5, rtol=0)
    # ... and the new adapter alone is not the first one continued
    new = load_file(Path(second["output_dir"]) / "adapter_model.safetensors")
    old = load_file(Path(first["output_dir"]) / "adapter_model.safetensors")
    assert not torch.allclose(
        new[next(k for k in new if "lora_A" in k)], old[next(k for k in new if "lora_A" in k)]
    )


# ---- memory-saving optimizers (full fine-tuning) --------------------------------------------------


def assert_full_model_reloads(out: Path, model) -> None:
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(saved[name], value.float(), atol=0, rtol=0, msg=name)


@pytest.mark.parametrize("kind", ["galore", "apollo"])
def test_low_rank_optimizers_project_the_linear_layers(base_cfg, spy, kind):
    from apollo_torch import APOLLOAdamW
    from galore_torch import GaLoreAdamW

    cfg = full_cfg(base_cfg, **{f"use_{kind}": True, f"{kind}_rank": 4, "save_steps": 6})
    train(None, cfg)
    out = Path(cfg["output_dir"])
    assert_learns(out)
    optimizer = spy["optimizer"]
    assert type(optimizer) is {"galore": GaLoreAdamW, "apollo": APOLLOAdamW}[kind]
    assert all(g["lr"] == 0.0 for g in optimizer.param_groups)  # the linear schedule ran to its end
    projected = [s for s in optimizer.state.values() if "projector" in s]
    assert len(projected) == 14  # the 7 linear layers of each of the 2 decoder blocks
    for state in projected:
        assert min(state["exp_avg"].shape) == 4, state["exp_avg"].shape  # states live in the rank-4 space
    assert_full_model_reloads(out, spy["model"])


def test_galore_layerwise_steps_each_parameter_in_backward(base_cfg, tiny_model, spy):
    from galore_torch import GaLoreAdamW
    from transformers.trainer_pt_utils import LayerWiseDummyOptimizer

    cfg = full_cfg(base_cfg, use_galore=True, galore_layerwise=True, galore_rank=4)
    train(None, cfg)
    out = Path(cfg["output_dir"])
    assert_learns(out)
    optimizer = spy["optimizer"]
    assert isinstance(optimizer, LayerWiseDummyOptimizer)
    inner = list(optimizer.optimizer_dict.values())
    assert len(inner) == sum(1 for p in spy["model"].parameters() if p.requires_grad)
    assert all(type(o) is GaLoreAdamW for o in inner)
    assert sum("projector" in s for o in inner for s in o.state.values()) == 14
    assert_full_model_reloads(out, spy["model"])


def test_badam_without_bf16_keeps_the_checkpoints_dtype(base_cfg, tiny_model, tmp_path, spy):
    """LF: use_badam without bf16/fp16 trains in the dtype the checkpoint declares (refused before)."""
    import json

    from lmstack.config.load import build_config
    from lmstack.launch.context import LaunchContext
    from lmstack.plan.runplan import RunPlan

    cfg = full_cfg(base_cfg, use_badam=True, badam_switch_interval=2, max_steps=2)
    train(None, cfg)
    assert all(p.dtype == torch.float32 for p in spy["model"].parameters())  # the tiny model is fp32
    half = tmp_path / "bf16-model"
    half.mkdir()
    config = json.loads((Path(tiny_model) / "config.json").read_text())
    (half / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    plan = RunPlan.resolve(build_config({**cfg, "model_name_or_path": str(half)}), LaunchContext())
    assert (plan.precision.load, plan.precision.autocast) == ("bf16", None)


def test_badam_updates_one_block_per_interval_in_half_precision(base_cfg, tiny_model, spy):
    cfg = full_cfg(
        base_cfg, use_badam=True, bf16=True, badam_switch_interval=2, save_steps=2, learning_rate=2e-3
    )
    train(None, cfg)
    out = Path(cfg["output_dir"])
    assert_learns(out, drop=0.1)
    assert all(p.dtype == torch.bfloat16 for p in spy["model"].parameters())  # no fp32 upcast
    # the linear schedule ran to its end on the groups BAdam copies into its inner AdamW every step
    assert spy["optimizer"].param_groups[0]["lr"] == 0.0
    snapshots = [
        {k: v.to(torch.bfloat16) for k, v in load_file(Path(tiny_model) / "model.safetensors").items()}
    ]
    snapshots += [load_file(out / f"checkpoint-{s}" / "model.safetensors") for s in (2, 4, 6)]
    blocks = []
    for before, after in zip(snapshots, snapshots[1:]):
        changed = {k for k in after if not torch.equal(before[k], after[k])}
        assert changed and all(k.startswith("model.layers.") for k in changed), changed
        layers = {k.split(".")[2] for k in changed}
        assert len(layers) == 1, changed  # exactly one decoder layer moved in this interval ...
        (layer,) = layers
        # ... all its matrices (a norm weight near 1.0 may round back in bf16 at a small late lr)
        assert {k for k in after if k.startswith(f"model.layers.{layer}.") and after[k].ndim == 2} <= changed
        blocks.append(layer)
    assert blocks == ["0", "1", "0"]  # ascending, switching every 2 steps
    assert_full_model_reloads(out, spy["model"])


def test_optim_muon_is_use_muon(base_cfg):
    from lmstack.config.load import build_config
    from lmstack.launch.context import LaunchContext
    from lmstack.plan.runplan import RunPlan
    from lmstack.train.method_rules import check_methods

    cfg = build_config({**base_cfg, "finetuning_type": "full", "optim": "muon"})
    plan = RunPlan.resolve(cfg, LaunchContext())
    check_methods(plan.cfg, plan.world_size, plan.zero_stage)
    assert plan.cfg.finetuning.use_muon and plan.cfg.training.optim == "adamw_torch"  # AdamW for the rest
    assert cfg.training.optim == "muon"  # the user's config itself is left as written


def test_muon_for_hidden_matrices_adamw_for_the_rest(base_cfg, spy):
    cfg = full_cfg(base_cfg, save_steps=6, optim="muon")
    train(None, cfg)
    out = Path(cfg["output_dir"])
    assert_learns(out)
    model, optimizer = spy["model"], spy["optimizer"]
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for g in optimizer.muon.param_groups for p in g["params"]}
    adamw = {names[id(p)] for g in optimizer.adamw.param_groups for p in g["params"]}
    assert type(optimizer.muon) is torch.optim.Muon and type(optimizer.adamw) is torch.optim.AdamW
    assert len(muon) == 14 and all(model.get_parameter(n).ndim == 2 for n in muon)
    assert "model.embed_tokens.weight" in adamw and not muon & adamw
    assert muon | adamw == set(names.values())
    assert any(n.endswith("norm.weight") for n in adamw) and any(n.endswith(".bias") for n in adamw)
    # the Trainer's linear schedule reached both halves (it ends at 0 after the last step)
    assert [g["lr"] for g in optimizer.param_groups] == [0.0] * len(optimizer.param_groups)
    assert all(g["lr"] == 0.0 for o in (optimizer.muon, optimizer.adamw) for g in o.param_groups)
    state = torch.load(out / "checkpoint-6" / "optimizer.pt", weights_only=False)
    assert len(state["muon"]["state"]) == 14 and len(state["adamw"]["state"]) == len(adamw)
    assert_full_model_reloads(out, model)


def test_muon_resume_equals_a_straight_run(base_cfg, tmp_path):
    """Muon+AdamW state round-trips through optimizer.pt: 2 steps + resume 2 = 4 straight steps."""
    cfg = full_cfg(base_cfg, optim="muon", max_steps=4, save_steps=2, lr_scheduler_type="constant")
    straight = {**cfg, "output_dir": str(tmp_path / "straight")}
    train(None, straight)
    split = {**cfg, "output_dir": str(tmp_path / "split")}
    train(None, {**split, "max_steps": 2})
    train(None, {**split, "resume_from_checkpoint": str(tmp_path / "split" / "checkpoint-2")})
    a = load_file(tmp_path / "straight" / "model.safetensors")
    b = load_file(tmp_path / "split" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a), max((a[k] - b[k]).abs().max().item() for k in a)


# ---- combination rules: errors before the model loads -------------------------------------------


@pytest.fixture
def no_model_load(monkeypatch):
    import lmstack.train.sft as sft

    def fail(*a, **k):
        raise AssertionError("the model was loaded before the error")

    monkeypatch.setattr(sft, "load_model", fail)


def _ds(tmp_path, stage: int) -> str:
    path = tmp_path / f"ds_z{stage}.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": stage}}))
    return str(path)


RULES = [
    ({"use_galore": True}, r"use_galore: a full-parameter optimizer, not for finetuning_type: lora"),
    ({"use_muon": True}, r"use_muon: a full-parameter optimizer, not for finetuning_type: lora"),
    (
        {"finetuning_type": "full", "use_galore": True, "use_badam": True},
        r"use_galore and use_badam: use one",
    ),
    ({"finetuning_type": "full", "optim": "muon", "use_apollo": True}, r"use_apollo and use_muon: use one"),
    ({"finetuning_type": "full", "optim": "muon_8bit"}, r"optim: got 'muon_8bit'"),
    ({"finetuning_type": "full", "use_galore": True, "optim": "sgd"}, r"use_galore and optim: 'sgd'"),
    (
        {
            "finetuning_type": "full",
            "use_galore": True,
            "galore_layerwise": True,
            "gradient_accumulation_steps": 2,
        },
        r"galore_layerwise and gradient_accumulation_steps: 2",
    ),
    (
        {
            "finetuning_type": "full",
            "use_apollo": True,
            "apollo_layerwise": True,
            "gradient_accumulation_steps": 4,
        },
        r"apollo_layerwise and gradient_accumulation_steps: 4",
    ),
    ({"finetuning_type": "full", "use_apollo": True, "deepspeed": "Z2"}, r"use_apollo and deepspeed"),
    ({"finetuning_type": "full", "use_galore": True, "deepspeed": "Z3"}, r"use_galore and deepspeed"),
    (
        {"finetuning_type": "freeze", "use_badam": True, "bf16": True},
        r"use_badam and finetuning_type: freeze",
    ),
    (
        {"finetuning_type": "full", "use_badam": True, "bf16": True, "deepspeed": "Z2"},
        r"use_badam and deepspeed: .*ZeRO-3",
    ),
    (
        {"finetuning_type": "full", "use_badam": True, "bf16": True, "badam_mode": "ratio"},
        r"badam_mode: ratio is not supported",
    ),
    ({"finetuning_type": "full", "loraplus_lr_ratio": 16}, r"loraplus_lr_ratio: a LoRA option"),
    (
        {"stage": "kto", "dataset": "kto_en_demo", "finetuning_type": "full", "use_galore": True},
        r"use_galore: not available for stage: kto",
    ),
    ({"finetuning_type": "freeze", "use_dora": True}, r"use_dora: a LoRA option"),
    ({"pissa_convert": True}, r"pissa_convert: .*set pissa_init: true"),
    ({"pissa_init": True, "adapter_name_or_path": "X"}, r"pissa_init: .*set create_new_adapter: true"),
    ({"create_new_adapter": True}, r"create_new_adapter: needs adapter_name_or_path"),
    (
        {"quantization_bit": 4, "finetuning_type": "full"},
        r"quantization_bit: a 4-bit base cannot be trained with finetuning_type: full",
    ),
    ({"quantization_bit": 4, "pissa_init": True}, r"pissa_init: PiSSA rewrites the base weights"),
    ({"quantization_bit": 8, "deepspeed": "Z3"}, r"quantization_bit: 8-bit bases cannot be sharded"),
    (
        {"quantization_bit": 4, "use_cpu": True},
        r"quantization_bit: got 4, but (use_cpu: true is set|no CUDA GPU is visible)",
    ),
]


@pytest.mark.parametrize("change,pattern", RULES, ids=[str(i) for i in range(len(RULES))])
def test_combination_rules(base_cfg, tmp_path, no_model_load, change, pattern):
    change = dict(change)
    if change.get("deepspeed") in ("Z2", "Z3"):
        change["deepspeed"] = _ds(tmp_path, int(change["deepspeed"][1]))
    if change.get("adapter_name_or_path") == "X":
        change["adapter_name_or_path"] = str(tmp_path)
    with pytest.raises(ConfigError, match=pattern):
        train(None, {**base_cfg, **change})


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU message")
def test_qlora_without_gpu_is_a_clear_error(base_cfg, no_model_load):
    with pytest.raises(
        ConfigError, match=r"quantization_bit: got 4, but no CUDA GPU is visible; .*needs a CUDA GPU"
    ):
        train(None, {**base_cfg, "quantization_bit": 4, "bf16": True})


# ---- QLoRA on a GPU ------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [4, 8])
def test_qlora_trains_on_gpu(base_cfg, tiny_model, spy, bits):
    cfg = lora_cfg(base_cfg, quantization_bit=bits, bf16=True, max_steps=8, learning_rate=5e-3)
    train(None, cfg)
    out = Path(cfg["output_dir"])
    assert_learns(out, drop=0.1)
    layer = spy["model"].base_model.model.model.layers[0].self_attn.q_proj.base_layer
    assert type(layer).__name__ == {4: "Linear4bit", 8: "Linear8bitLt"}[bits]
    trainable = [n for n, p in spy["model"].named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)  # only the adapters train on a quantized base
    torch.testing.assert_close(
        reload_adapter_quantized(tiny_model, out, bits), logits(spy["model"]), atol=2e-2, rtol=0
    )


def _launch(base_cfg, tmp_path, cmd_prefix: list[str], env_extra: dict, **over) -> list[float]:
    """Seed 001's worked example in miniature: QLoRA under a sharding launcher, one GPU."""
    import os
    import subprocess
    import sys

    import yaml

    cfg = {**lora_cfg(base_cfg, quantization_bit=4, bf16=True, max_steps=10, learning_rate=5e-3), **over}
    path = tmp_path / "qlora.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **env_extra)
    cmd = [sys.executable, *cmd_prefix, "-m", "lmstack.cli", "train", str(path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (Path(cfg["output_dir"]) / "adapter_model.safetensors").is_file()
    return losses(Path(cfg["output_dir"]))


@pytest.mark.gpu
def test_qlora_under_zero3(base_cfg, tmp_path):
    pytest.importorskip("deepspeed")
    ds = Path(__file__).resolve().parents[2] / "examples/deepspeed/ds_z3_config.json"
    curve = _launch(base_cfg, tmp_path, [], {"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "1"}, deepspeed=str(ds))
    assert curve[-1] < curve[0], curve


@pytest.mark.gpu
def test_qlora_under_fsdp(base_cfg, tmp_path):
    config = Path(__file__).resolve().parents[2] / "examples/accelerate/fsdp_config.yaml"
    prefix = ["-m", "accelerate.commands.launch", "--config_file", str(config), "--num_processes", "1"]
    curve = _launch(base_cfg, tmp_path, prefix, {})
    assert curve[-1] < curve[0], curve
