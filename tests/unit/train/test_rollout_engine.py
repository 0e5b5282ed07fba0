"""The rollout engine of grpo / rloo (plan.rl.rollout_engine; train/rollout_engine.py): the plan's choice
and its refusals, and the continuous-batching rollouts equal to TRL's model.generate ones on the tiny
model with a LoRA adapter (greedy), the adapter applied in place (its weights keep their dtype, the
answers are the adapter's, not the base model's)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmstack.config.errors import ConfigError
from lmstack.config.load import build_config
from lmstack.launch.context import LaunchContext
from lmstack.plan.runplan import RunPlan

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "stages"
MAX_NEW = 10


def _plan(model: str, tmp_path: Path, ctx: LaunchContext | None = None, **fields) -> RunPlan:
    flat = {
        "model_name_or_path": model,
        "template": "qwen",
        "stage": "grpo",
        "finetuning_type": "lora",
        "dataset": "rl_prompts",
        "dataset_dir": str(FIXTURES),
        "output_dir": str(tmp_path / "out"),
        "reward_funcs": "length",
        "per_device_train_batch_size": 6,
        "num_generations": 2,
        "max_new_tokens": MAX_NEW,
        "report_to": "none",
        **fields,
    }
    return RunPlan.resolve(build_config(flat), ctx or LaunchContext())


def test_plan_picks_continuous_batching_and_a_set_field_wins(tmp_path):
    default = _plan("m", tmp_path)  # measured slower than model.generate on the H200: asked for, not default
    assert default.rl.rollout_engine == "generate" and "measured slower" in default.reasons["rl"]
    p = _plan("m", tmp_path, rollout_engine="continuous_batching")
    assert p.rl.rollout_engine == "continuous_batching"
    assert p.decisions()["rl"].endswith("rollouts continuous_batching")
    assert "paged KV cache" in p.reasons["rl"] and "in place" in p.reasons["rl"]
    forced = _plan("m", tmp_path, rollout_engine="generate")
    assert forced.rl.rollout_engine == "generate" and "rollout_engine: generate" in forced.reasons["rl"]


def test_image_prompts_sample_with_generate_and_continuous_batching_is_refused_for_them(tmp_path):
    from lmstack.tiny import build_tiny_vision_model

    vl = build_tiny_vision_model(tmp_path / "vl", "qwen2_vl")
    p = _plan(str(vl), tmp_path, template="qwen2_vl")
    assert p.rl.rollout_engine == "generate" and "image prompts" in p.reasons["rl"]
    with pytest.raises(ConfigError, match="rollout_engine: continuous_batching does not support image"):
        _plan(str(vl), tmp_path, template="qwen2_vl", rollout_engine="continuous_batching")


def _lora_trainer(plan: RunPlan):
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from trl import GRPOConfig

    from lmstack.train import grpo, rlhf
    from lmstack.train.rewards import length_reward

    torch.manual_seed(0)
    path = plan.cfg.model.model_name_or_path
    tok = AutoTokenizer.from_pretrained(path)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    # a non-zero adapter (B initialised randomly): its answers differ from the base model's
    lora = LoraConfig(r=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    model = get_peft_model(base, lora)
    g = plan.cfg.generating
    args = rlhf.trl_config(
        plan, GRPOConfig, num_generations=2, max_completion_length=g.max_new_tokens, **grpo.rl_kwargs(plan)
    )
    trainer = grpo.TemplatePromptGRPOTrainer(
        model=model,
        reward_funcs=[length_reward(MAX_NEW)],
        args=args,
        train_dataset=Dataset.from_list([{"prompt": "Hello"}] * 6),
        processing_class=tok,
    )
    # greedy, so both engines' answers are comparable token for token
    trainer.generation_config = GenerationConfig(
        max_new_tokens=MAX_NEW,
        do_sample=False,
        eos_token_id=trainer.eos_token_ids,
        pad_token_id=tok.pad_token_id,
    )
    return trainer, tok


def test_continuous_batching_rollouts_equal_generate_with_the_adapter_in_place(tiny_model, tmp_path):
    plan = _plan(str(tiny_model), tmp_path, rollout_engine="continuous_batching")
    trainer, tok = _lora_trainer(plan)
    assert trainer.use_transformers_continuous_batching  # the plan's engine reached TRL's config
    texts = ["Hello there", "What is 2 + 3?", "a", "Name three colours of the rainbow please", "7 x 6", "ok"]
    prompt_ids = [tok(text=t)["input_ids"] for t in texts]
    model = trainer.model
    model.train()
    dtypes = {n: p.dtype for n, p in model.named_parameters()}

    fast, logprobs = trainer._generate_single_turn(prompt_ids, None, {}, 1)
    assert logprobs is None
    assert model.training  # the training mode comes back after the engine's eval()
    assert {n: p.dtype for n, p in model.named_parameters()} == dtypes  # no cast of the adapter
    kept = model.base_model.model._cached_continuous_batching_manager  # the engine is kept for reuse
    fast_again, _ = trainer._generate_single_turn(prompt_ids, None, {}, 1)
    assert model.base_model.model._cached_continuous_batching_manager is kept and fast_again == fast

    trainer.use_transformers_continuous_batching = False  # TRL's padded model.generate path
    plain, _ = trainer._generate_single_turn(prompt_ids, None, {}, 1)
    assert fast == plain
    assert all(0 < len(c) <= MAX_NEW for c in fast)
    with model.disable_adapter():
        base_answers, _ = trainer._generate_single_turn(prompt_ids, None, {}, 1)
    assert base_answers != fast  # the answers are the adapter's
    assert trainer._metrics["train"]["rollout/tokens_per_sec"][-1] > 0


def test_rollouts_cut_at_the_first_end_token():
    from lmstack.train.rollout_engine import _cut_at_end

    assert _cut_at_end([5, 9, 2, 7, 2], {2}) == [5, 9, 2]
    assert _cut_at_end([5, 9], {2}) == [5, 9]


@pytest.mark.gpu
def test_continuous_batching_decodes_with_cuda_graphs_and_matches_generate_on_gpu(tiny_model, tmp_path):
    """On a GPU the kept engine replays its decode steps as CUDA graphs; greedy answers still equal
    model.generate's."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 both ways: the engines differ in kernels only
    plan = _plan(str(tiny_model), tmp_path, LaunchContext.from_env(), rollout_engine="continuous_batching")
    assert plan.device == "cuda"
    trainer, tok = _lora_trainer(plan)
    trainer.model.to("cuda")
    prompt_ids = [tok(text=t)["input_ids"] for t in ["Hello there", "What is 2 + 3?", "7 x 6"]]
    fast, _ = trainer._generate_single_turn(prompt_ids, None, {}, 1)
    manager = trainer.model.base_model.model._cached_continuous_batching_manager
    assert tuple(manager.continuous_batching_config.use_cuda_graph) == (False, True)
    trainer.use_transformers_continuous_batching = False
    plain, _ = trainer._generate_single_turn(prompt_ids, None, {}, 1)
    assert fast == plain


def test_flex_attention_samples_with_generate_and_continuous_batching_is_refused_with_it(tmp_path):
    # transformers' paged engine runs sdpa, eager or flash attention only
    p = _plan("m", tmp_path, flash_attn="flex")
    assert p.rl.rollout_engine == "generate" and "flash_attn: flex" in p.reasons["rl"]
    with pytest.raises(
        ConfigError, match="rollout_engine: continuous_batching does not support flash_attn: flex"
    ):
        _plan("m", tmp_path, flash_attn="flex", rollout_engine="continuous_batching")
