"""`lmstack export` on the tiny model (CPU, offline): the merged model equals base + adapters, reloads
with plain transformers, carries the training chat template, shards, and never clobbers a folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from lmstack.cli.main import main
from lmstack.config.errors import ConfigError
from lmstack.infer.export import export
from lmstack.templates import get_template
from lmstack.train.run import train

CONV = [
    {"role": "user", "content": "Give three tips for staying healthy."},
    {"role": "assistant", "content": "Eat well, sleep, move."},
    {"role": "user", "content": "And one more?"},
]
_RUNS: dict[str, Path] = {}


@pytest.fixture
def adapters(base_cfg, tmp_path_factory) -> tuple[Path, Path]:
    """Two LoRA adapters trained for a few steps with different seeds (trained once per module)."""
    if not _RUNS:
        root = tmp_path_factory.mktemp("lora_runs")
        for name, seed in (("a", 0), ("b", 1)):
            run = {
                **base_cfg,
                "output_dir": str(root / name),
                "seed": seed,
                "max_steps": 3,
                "max_samples": 24,
            }
            train(None, run)
            _RUNS[name] = root / name
    return _RUNS["a"], _RUNS["b"]


def ids(tokenizer) -> torch.Tensor:
    return torch.tensor([tokenizer("Hello, how can I help you today?")["input_ids"]])


def logits(model, input_ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=input_ids).logits.float()


def reference(tiny_model, *adapter_paths) -> torch.nn.Module:
    """base + adapters, all active at once through PEFT (no merging)."""
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    if not adapter_paths:
        return base.eval()
    model = PeftModel.from_pretrained(base, adapter_paths[0], adapter_name="a0")
    for i, path in enumerate(adapter_paths[1:], start=1):
        model.load_adapter(path, adapter_name=f"a{i}")
    model.base_model.set_adapter([f"a{i}" for i in range(len(adapter_paths))])
    return model.eval()


def export_cfg(tiny_model, out: Path, **extra) -> dict:
    return {
        "model_name_or_path": str(tiny_model),
        "template": "qwen",
        "finetuning_type": "lora",
        "export_dir": str(out),
        **extra,
    }


def test_export_merges_adapters_in_order_and_reloads_with_plain_transformers(
    adapters, tiny_model, tiny_tokenizer, tmp_path
):
    a, b = adapters
    out = tmp_path / "merged"
    config = tmp_path / "export.yaml"  # the training YAML style, without output_dir
    config.write_text(yaml.safe_dump(export_cfg(tiny_model, out, adapter_name_or_path=f"{a},{b}")))
    assert main(["export", str(config)]) == 0

    x = ids(tiny_tokenizer)
    expected = logits(reference(tiny_model, a, b), x)
    assert not torch.allclose(expected, logits(reference(tiny_model), x), atol=1e-3)  # adapters matter
    assert not torch.allclose(expected, logits(reference(tiny_model, a), x), atol=1e-3)  # both of them
    exported = AutoModelForCausalLM.from_pretrained(out).eval()  # plain transformers, no PEFT
    assert exported.dtype == torch.float32  # infer_dtype auto = the model config's dtype
    torch.testing.assert_close(logits(exported, x), expected, atol=1e-4, rtol=0)
    assert not any("lora" in k for k in load_file(out / "model.safetensors"))

    # the exported chat template renders (and tokenizes to) exactly what training used
    tok = AutoTokenizer.from_pretrained(out)
    qwen = get_template("qwen")
    assert (out / "chat_template.jinja").is_file()
    text = tok.apply_chat_template(CONV, tokenize=False, add_generation_prompt=True)
    assert text == qwen.render(CONV, tokenizer=tok)
    assert text.startswith("<|im_start|>system\nYou are Qwen")  # not the base tokenizer's template
    assert tok(text, add_special_tokens=False)["input_ids"] == qwen.encode_prompt(tok, CONV)
    system_text = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, *CONV], tokenize=False)
    assert system_text == qwen.render(CONV, "Be brief.", tok)

    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert exported.generation_config.eos_token_id in (im_end, [im_end])
    modelfile = (out / "Modelfile").read_text()
    assert 'PARAMETER stop "<|im_end|>"' in modelfile
    assert 'SYSTEM """You are Qwen, created by Alibaba Cloud.' in modelfile
    assert 'TEMPLATE """' in modelfile and "{{ $m.Content }}<|im_end|>" in modelfile

    # greedy generation from the export equals generation from base + adapters with the template
    from lmstack.infer.engine import ChatEngine, load_infer_config

    engine = ChatEngine.from_config(
        load_infer_config(
            None,
            export_cfg(tiny_model, out, adapter_name_or_path=f"{a},{b}", do_sample=False, max_new_tokens=8),
        )
    )
    prompt = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    plain = exported.generate(prompt, max_new_tokens=8, do_sample=False)[0, prompt.shape[1] :]
    ours = engine.generate(CONV)
    assert ours.completion_tokens == len(plain)
    assert ours.text == tok.decode(plain, skip_special_tokens=True)


def test_export_shards_by_export_size(adapters, tiny_model, tiny_tokenizer, tmp_path):
    a, _ = adapters
    out = tmp_path / "sharded"
    export(None, export_cfg(tiny_model, out, adapter_name_or_path=str(a), export_size=0.0005))
    shards = sorted(out.glob("model-*.safetensors"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(shards) > 2
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    for shard in shards:  # a shard over 0.5 MB holds a single tensor bigger than the limit
        assert shard.stat().st_size < 600_000 or len(load_file(shard)) == 1
    x = ids(tiny_tokenizer)
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    torch.testing.assert_close(logits(reloaded, x), logits(reference(tiny_model, a), x), atol=1e-4, rtol=0)


def test_export_refuses_a_non_empty_dir_unless_export_overwrite(adapters, tiny_model, tmp_path):
    a, _ = adapters
    out = tmp_path / "busy"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    cfg = export_cfg(tiny_model, out, adapter_name_or_path=str(a))
    with pytest.raises(ConfigError, match=r"export_dir: .* not empty; set export_overwrite: true"):
        export(None, cfg)
    assert not (out / "model.safetensors").exists()
    export(None, {**cfg, "export_overwrite": True})
    assert (out / "model.safetensors").is_file() and (out / "keep.txt").read_text() == "precious"


def test_full_reexport_casts_and_keeps_the_value_head(tiny_model, tmp_path):
    run = tmp_path / "rm_full_run"  # stands for a full-finetuned reward model's output_dir
    shutil.copytree(tiny_model, run)
    head = {"v_head.summary.weight": torch.randn(1, 128), "v_head.summary.bias": torch.zeros(1)}
    save_file(head, run / "value_head.safetensors")
    out = tmp_path / "export"
    export(
        None,
        {
            "model_name_or_path": str(run),
            "template": "chatml",
            "finetuning_type": "full",
            "infer_dtype": "bfloat16",
            "export_dir": str(out),
        },
    )
    weights = load_file(out / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    copied = load_file(out / "value_head.safetensors")
    assert all(torch.equal(copied[k], v) for k, v in head.items())
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.apply_chat_template(CONV, tokenize=False) == get_template("chatml").render(CONV, tokenizer=tok)


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"export_dir": None}, r"export_dir: required for lmstack export"),
        (
            {"adapter_name_or_path": "no/such/adapter"},
            r"adapter_name_or_path: no/such/adapter has no adapter_config",
        ),
        (
            {"adapter_name_or_path": "x", "finetuning_type": "full"},
            r"adapter_name_or_path: adapters need finetuning_type: lora",
        ),
        ({"infer_dtype": "fp8"}, r"infer_dtype: got 'fp8'; allowed: auto \| float16 \| bfloat16 \| float32"),
        ({"template": "qwne"}, r"template: got 'qwne'.*did you mean 'qwen'"),
        (
            {"export_quantization_bit": 4},
            r"export_quantization_bit: LLaMA-Factory.s .export_quantization_bit: 4. \(GPTQ quantization at export\) is not available in lmstack",
        ),
        ({"quantization_bit": 4}, r"quantization_bit: got 4; chat/api/export load the base unquantized"),
    ],
)
def test_export_config_errors_name_the_field(tiny_model, tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message):
        export(None, {**export_cfg(tiny_model, tmp_path / "out"), **extra})
    assert not (tmp_path / "out").exists()


def test_lora_reward_model_export_keeps_the_value_head_beside_the_adapter(adapters, tiny_model, tmp_path):
    a, _ = adapters
    rm_run = tmp_path / "rm_lora_run"  # an rm LoRA output_dir: adapter files + value_head.safetensors
    shutil.copytree(a, rm_run)
    head = {"v_head.summary.weight": torch.randn(1, 128), "v_head.summary.bias": torch.ones(1)}
    save_file(head, rm_run / "value_head.safetensors")
    out = tmp_path / "export"
    export(None, export_cfg(tiny_model, out, adapter_name_or_path=str(rm_run)))
    copied = load_file(out / "value_head.safetensors")
    assert all(torch.equal(copied[k], v) for k, v in head.items())


def test_template_unset_keeps_the_tokenizer_chat_template(tiny_model, tiny_tokenizer, tmp_path, caplog):
    out = tmp_path / "export"
    cfg = {"model_name_or_path": str(tiny_model), "finetuning_type": "full", "export_dir": str(out)}
    with caplog.at_level("WARNING", logger="lmstack.infer.export"):
        export(None, cfg)
    assert "no Ollama Modelfile" in caplog.text and not (out / "Modelfile").exists()
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.apply_chat_template(CONV, tokenize=False) == tiny_tokenizer.apply_chat_template(
        CONV, tokenize=False
    )


def test_shipped_export_and_inference_examples_run(adapters, tiny_model, tmp_path):
    a, _ = adapters
    repo = Path(__file__).resolve().parents[2]
    paths = {"model_name_or_path": str(tiny_model), "adapter_name_or_path": str(a)}
    out = tmp_path / "merged"
    export(repo / "examples/merge_lora/quickstart_lora_sft.yaml", {**paths, "export_dir": str(out)})
    assert (out / "model.safetensors").is_file() and (out / "Modelfile").is_file()

    from lmstack.infer.engine import ChatEngine, load_infer_config

    cfg = load_infer_config(repo / "examples/inference/quickstart_lora_sft.yaml", paths)
    assert (cfg.generating.temperature, cfg.generating.max_new_tokens) == (0.7, 256)
    reply = ChatEngine.from_config(cfg).generate(CONV, max_new_tokens=4)
    assert reply.completion_tokens <= 4


def test_export_on_the_lora_training_yaml_merges_the_adapter_trained_in_output_dir(
    adapters, base_cfg, tiny_model, tiny_tokenizer, tmp_path, capsys
):
    a, _ = adapters
    out = tmp_path / "merged"
    run = {**base_cfg, "output_dir": str(a), "seed": 0, "max_steps": 3, "max_samples": 24}  # run a's YAML
    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump({**run, "export_dir": str(out)}))
    assert main(["export", str(config)]) == 0  # logs to stderr
    x = ids(tiny_tokenizer)
    expected = logits(reference(tiny_model, a), x)
    assert not torch.allclose(expected, logits(reference(tiny_model), x), atol=1e-3)
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    torch.testing.assert_close(logits(exported, x), expected, atol=1e-4, rtol=0)
    line = f"adapter_name_or_path is unset: using the LoRA adapter trained in output_dir {a}"
    assert line in capsys.readouterr().err


def test_export_on_a_full_training_yaml_reexports_the_weights_trained_in_output_dir(
    base_cfg, tiny_model, tmp_path
):
    run = {**base_cfg, "finetuning_type": "full", "max_steps": 3, "max_samples": 24}
    train(None, run)
    out = tmp_path / "export"
    export(None, {**run, "export_dir": str(out)})
    exported = load_file(out / "model.safetensors")
    trained = load_file(Path(run["output_dir"]) / "model.safetensors")
    base = load_file(tiny_model / "model.safetensors")
    assert exported.keys() == trained.keys()
    assert all(torch.equal(exported[k], trained[k]) for k in trained)
    assert not all(torch.equal(exported[k], base[k]) for k in base)  # not the base model
