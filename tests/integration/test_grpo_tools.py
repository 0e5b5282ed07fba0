"""A multi-turn tool rollout on the tiny model (tool_funcs): a tiny model taught to emit the qwen template's
tool call calls the Python tool, its answer comes back as the template's observation turn, and those
inserted tokens are masked (TRL counts and trains only the model's own tokens)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmstack.config.errors import ConfigError
from lmstack.train.run import train

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "stages"


@pytest.fixture(scope="module")
def tool_model(tiny_model, tmp_path_factory) -> Path:
    """The tiny model after a short full SFT on the one tool-call answer of rl_tools (it then emits it)."""
    out = tmp_path_factory.mktemp("tool_sft") / "out"
    train(
        None,
        {
            "model_name_or_path": str(tiny_model),
            "template": "qwen",
            "stage": "sft",
            "finetuning_type": "full",
            "dataset": "rl_tools",
            "dataset_dir": str(FIXTURES),
            "cutoff_len": 512,
            "output_dir": str(out),
            "per_device_train_batch_size": 1,
            "learning_rate": 5e-3,
            "lr_scheduler_type": "constant",
            "max_steps": 30,
            "save_strategy": "no",
            "report_to": "none",
            "disable_tqdm": True,
            "seed": 0,
        },
    )
    return out


@pytest.fixture
def fixtures_module(monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))
    import stage_rewards

    stage_rewards.TOOL_CALLS.clear()
    stage_rewards.COMPLETIONS_SEEN.clear()
    return stage_rewards


def tool_run(model: Path, tmp_path: Path, **over) -> dict:
    return {
        "model_name_or_path": str(model),
        "template": "qwen",
        "stage": "grpo",
        "finetuning_type": "lora",
        "dataset": "rl_tools",
        "dataset_dir": str(FIXTURES),
        "cutoff_len": 512,
        "output_dir": str(tmp_path / "grpo"),
        "reward_funcs": "stage_rewards:records_completions,length",
        "tool_funcs": "stage_rewards:add",
        "max_tool_calling_iterations": 1,
        "max_new_tokens": 160,
        "top_k": 1,  # greedy: the taught call comes out as taught
        "per_device_train_batch_size": 2,
        "num_generations": 2,
        "max_steps": 1,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        **over,
    }


def test_tool_rollout_calls_the_tool_and_masks_its_answer(tool_model, tmp_path, fixtures_module):
    from transformers import AutoTokenizer

    from lmstack.templates import get_template
    from lmstack.train.tool_rollout import ToolRollout

    run = tool_run(tool_model, tmp_path)
    train(None, run)
    assert fixtures_module.TOOL_CALLS == [(2, 3), (2, 3)]  # one call per rollout, arguments parsed
    seen = fixtures_module.COMPLETIONS_SEEN
    assert len(seen) == 2 and all("<tool_response>\n5\n</tool_response>" in text for text, _ in seen)

    tok = AutoTokenizer.from_pretrained(tool_model)
    template = get_template("qwen", tok)
    template.fix_tokenizer(tok)
    inserted = ToolRollout(template, tok, {}, 1, 160).observation_ids(["5"])
    assert tok.decode(inserted) == (
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    state = json.loads((Path(run["output_dir"]) / "trainer_state.json").read_text())
    step = next(h for h in state["log_history"] if "loss" in h)
    assert step["tools/call_frequency"] == 1.0 and step["tools/failure_frequency"] == 0.0
    # TRL counts (and trains on) the model's tokens only: the inserted observation is left out
    total = sum(n for _, n in seen) / len(seen)
    assert step["completions/mean_length"] == pytest.approx(total - len(inserted))
    assert (
        "tools add (at most 1)"
        in json.loads((Path(run["output_dir"]) / "run_manifest.json").read_text())["plan"]["decisions"]["rl"]
    )


def test_tools_the_prompts_do_not_describe_are_refused(tiny_model, tmp_path, fixtures_module):
    run = tool_run(tiny_model, tmp_path, dataset="rl_math", reward_funcs="length")
    with pytest.raises(ConfigError, match="tool_funcs: no prompt describes the tool 'add'"):
        train(None, run)
    with pytest.raises(ConfigError, match="tool_funcs: cannot import no_such_module"):
        train(None, {**run, "tool_funcs": "no_such_module:add"})
