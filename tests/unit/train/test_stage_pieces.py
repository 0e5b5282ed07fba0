"""The pure pieces of the pt/rm/dpo/kto/ppo/grpo stages: packing, preference rows, PPO maths, rewards."""

from __future__ import annotations

import pytest
import torch

from lmstack.config.errors import ConfigError
from lmstack.data.encode import IGNORE_INDEX, DropExample, EncodeOptions
from lmstack.data.encode_pref import encode_kto, encode_pairwise, encode_prompt_only, split_row
from lmstack.data.tokenized import TokenizedDataset
from lmstack.models.value_head import last_token
from lmstack.train import ppo
from lmstack.train.rlhf import import_reward_func
from lmstack.train.stage_data import split_long_texts


def test_split_long_texts_keeps_every_token_and_never_joins_texts(caplog):
    texts = [list(range(1, 6)), list(range(10, 17)), list(range(20, 29))]  # 5 + 7 + 9 = 21 tokens
    data = TokenizedDataset.from_samples([{"input_ids": t, "labels": t} for t in texts])
    with caplog.at_level("INFO"):
        pieces = split_long_texts(data, 4, "train")
    got = [pieces[i]["input_ids"] for i in range(len(pieces))]
    assert got == [
        [1, 2, 3, 4],
        [5],
        [10, 11, 12, 13],
        [14, 15, 16],
        [20, 21, 22, 23],
        [24, 25, 26, 27],
        [28],
    ]
    assert all(pieces[i]["labels"] == pieces[i]["input_ids"] for i in range(len(pieces)))
    assert "3 texts -> 7 pieces" in caplog.text and "none dropped" in caplog.text
    assert split_long_texts(None, 4, "eval") is None


@pytest.fixture
def template(tiny_tokenizer):
    from lmstack.templates import get_template

    t = get_template("qwen", tiny_tokenizer)
    t.fix_tokenizer(tiny_tokenizer)
    return t


def example(answers: list[str], kto_tag=None) -> dict:
    return {
        "prompt": [{"role": "user", "content": "What is 2 + 2?"}],
        "response": [{"role": "assistant", "content": a} for a in answers],
        "system": None,
        "tools": None,
        "kto_tag": kto_tag,
    }


def test_pairwise_rows_share_the_masked_prompt(tiny_tokenizer, template):
    opts = EncodeOptions(stage="dpo", cutoff_len=256)
    row, truncated = encode_pairwise(example(["It is 4.", "FIVE!!"]), tiny_tokenizer, template, opts)
    assert not truncated
    prompt, chosen = split_row(row["chosen_input_ids"], row["chosen_labels"])
    prompt_r, rejected = split_row(row["rejected_input_ids"], row["rejected_labels"])
    assert prompt == prompt_r and prompt == template.encode_prompt(tiny_tokenizer, example([])["prompt"])
    assert tiny_tokenizer.decode(chosen).startswith("It is 4.") and "<|im_end|>" in tiny_tokenizer.decode(
        chosen
    )
    assert tiny_tokenizer.decode(rejected).startswith("FIVE!!")
    assert row["chosen_labels"][len(prompt) :] == chosen  # the answer is trained, its trailer included


def test_pairwise_truncation_cuts_both_answers_and_is_counted(tiny_tokenizer, template):
    opts = EncodeOptions(stage="dpo", cutoff_len=24)
    long = "a long answer " * 20
    row, truncated = encode_pairwise(example([long, "short."]), tiny_tokenizer, template, opts)
    assert truncated
    assert len(row["chosen_input_ids"]) <= 24 and len(row["rejected_input_ids"]) <= 24


def test_kto_rows_carry_the_tag_and_need_one(tiny_tokenizer, template):
    opts = EncodeOptions(stage="kto", cutoff_len=256)
    row, _ = encode_kto(example(["It is 4."], kto_tag=False), tiny_tokenizer, template, opts)
    assert row["kto_tag"] is False and IGNORE_INDEX in row["labels"]
    with pytest.raises(DropExample, match="kto_tag"):
        encode_kto(example(["It is 4."]), tiny_tokenizer, template, opts)


def test_prompt_only_rows_end_with_the_assistant_opener(tiny_tokenizer, template):
    row, _ = encode_prompt_only(example(["ignored"]), tiny_tokenizer, template, EncodeOptions("ppo", 256))
    assert tiny_tokenizer.decode(row["input_ids"]).endswith("<|im_start|>assistant\n")


def test_last_token_handles_left_and_right_padding():
    values = torch.arange(12.0).reshape(2, 6)
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]])  # left-padded prompt + answer; right pad
    assert last_token(values, mask).tolist() == [4.0, 9.0]


def test_gae_returns_and_whitened_advantages():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.zeros(1, 3)
    mask = torch.ones(1, 3)
    advantages, returns = ppo.gae(rewards, values, mask)
    lam = ppo.LAM
    assert torch.allclose(returns, torch.tensor([[lam**2, lam, 1.0]]))
    assert abs(advantages.mean().item()) < 1e-5  # whitened


def test_ppo_policy_loss_clips_the_ratio():
    exp = {
        "mask": torch.ones(1, 2),
        "advantages": torch.tensor([[1.0, -1.0]]),
        "logp": torch.zeros(1, 2),
        "values": torch.zeros(1, 2),
        "returns": torch.zeros(1, 2),
    }
    idx = torch.tensor([0])
    far = torch.log(torch.tensor([[2.0, 0.5]]))  # ratios 2 and 0.5: both beyond 1 +- 0.2
    policy_loss, value_loss = ppo.ppo_losses(exp, idx, far, torch.zeros(1, 2))
    # A=+1, ratio 2 -> clipped to 1.2: -1.2; A=-1, ratio 0.5 -> max(0.5, 0.8) = 0.8
    assert policy_loss.item() == pytest.approx((-1.2 + 0.8) / 2)
    assert value_loss.item() == 0.0


def test_adaptive_kl_follows_the_target():
    assert ppo.adapt_kl(0.2, kl=12.0, target=6.0, n_steps=100) > 0.2
    assert ppo.adapt_kl(0.2, kl=1.0, target=6.0, n_steps=100) < 0.2
    assert ppo.adapt_kl(0.2, kl=600.0, target=6.0, n_steps=10000) == pytest.approx(0.2 * 1.2)  # clipped


def test_running_moments_match_numpy():
    stats = ppo.RunningMoments()
    a, b = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([10.0, 20.0])
    stats.update(a)
    stats.update(b)
    both = torch.cat([a, b])
    assert stats.mean == pytest.approx(both.mean().item(), rel=1e-6)
    assert stats.std == pytest.approx(both.std(unbiased=False).item(), rel=1e-6)


def test_reward_funcs_import_errors_name_the_field(tmp_path):
    path = tmp_path / "r.py"
    path.write_text("def f(prompts, completions, completion_ids, **kw):\n    return [1.0] * len(prompts)\n")
    assert import_reward_func(f"{path}:f")(prompts=["a"], completions=["b"], completion_ids=[[1]]) == [1.0]
    for spec, message in [
        ("nocolon", "is not 'pkg.module:function'"),
        (f"{tmp_path}/missing.py:f", "not found"),
        (f"{path}:g", "has no function 'g'"),
        ("lmstack_no_such_mod:f", "cannot import"),
    ]:
        with pytest.raises(ConfigError, match=f"reward_funcs: .*{message}|reward_funcs: {message}"):
            import_reward_func(spec)


def test_a_frozen_reference_copy_loads_in_the_compute_dtype_not_the_policys_fp32(tiny_model, tiny_tokenizer):
    """A full DPO under classic AMP loads the policy in fp32 (its master weights) and computes in bf16; the
    frozen reference only computes, so it loads in bf16 like LF's non-trainable loads: half the memory of
    the fp32 copy it was (the H200 trace snap_r8_dpo_1.5b_full_mb2_ckpt: 11.50 GiB for a 1.5B pair)."""
    from lmstack.config.load import build_config
    from lmstack.plan.runplan import RunPlan
    from lmstack.plan.whatif import gpu_context
    from lmstack.train.rlhf import reference_model

    cfg = build_config(dict(model_name_or_path=str(tiny_model), stage="dpo", finetuning_type="full", bf16=True,
                            template="qwen", output_dir="o", per_device_train_batch_size=2))  # fmt: skip
    plan = RunPlan.resolve(cfg, gpu_context(1, 80))
    assert (plan.precision.load, plan.precision.compute) == ("fp32", "bf16")  # classic AMP's policy
    ref = reference_model(plan, tiny_tokenizer)
    assert {p.dtype for p in ref.parameters()} == {torch.bfloat16}
    assert not any(p.requires_grad for p in ref.parameters()) and not ref.training
    assert plan.model_spec().load_dtype == "fp32"  # the policy keeps its fp32 weights
