"""The stages' own memory terms (plan/stage_memory.py), through the real path `lmstack plan` takes: a
YAML config on a config.json-only Qwen2.5 folder -> the run plan on a hypothetical GPU -> the request."""

from __future__ import annotations

import pytest

from lmstack.config.load import build_config
from lmstack.memory import memory as mem
from lmstack.memory import plan
from lmstack.memory.estimate import Setup, estimate
from lmstack.memory.stage_memory import PERSISTENT_ROWS, REFERENCE_COPY_ROW
from lmstack.plan.whatif import request_from_config


def configured(path: str, **kw):
    flat = dict(model_name_or_path=path, output_dir="o", bf16=True, cutoff_len=1024, finetuning_type="lora",
                lora_target="all", per_device_train_batch_size=4, gradient_checkpointing=False, flash_attn="sdpa")  # fmt: skip
    flat.update(kw)
    req = request_from_config(build_config(flat), 1, 139.8)
    return req, plan(req).configured.estimate.gpu


def test_dpo_lora_7b_holds_chosen_and_rejected_and_the_reference_forward(qwen):
    """The H200 miss (DPO LoRA 7B under-predicted by ~25%): the policy runs 2 x micro_batch rows and the
    adapter-off reference forward runs over its held activations; no extra weights, no logits."""
    sft_req, sft = configured(qwen("7b"), stage="sft")
    req, dpo = configured(qwen("7b"), stage="dpo", pref_loss="sigmoid")
    assert (req.rows_per_example, req.loss_path, req.reference) == (2, "trl_logprob", "adapter_off")
    assert dpo.activations == pytest.approx(2 * sft.activations, rel=1e-6)
    terms = dict(dpo.terms)
    assert not any("weights" in name for name in terms)  # adapter off: no second copy
    ref = next(v for name, v in terms.items() if name.startswith("reference forward"))
    layer = 2 * 4 * 1024 * mem.activation_bytes_per_token_layer(3584, 512, 18944) / mem.GIB
    assert ref > layer  # one decoder layer of 8 rows + a log-prob tile
    # TRL's fused log-prob head: a tile and the kept hidden states, never [tokens x vocab] logits
    assert dpo.logits < 0.1 * mem.UNFUSED_LOGITS_BYTES * 8 * 1024 * 152064 / mem.GIB
    assert dpo.allocated > 1.5 * sft.allocated  # the old planner predicted the SFT figure


def test_dpo_full_keeps_a_frozen_reference_copy_in_the_compute_dtype(qwen, monkeypatch):
    """train/rlhf.load_frozen_model loads the copy in the compute dtype (bf16), also under classic AMP, whose
    policy is fp32 (what a DPO full fine-tune runs here: master_weights auto keeps fp32 weights in the model
    for it). The runs recorded before loaded it like the policy, fp32 (the H200 trace snap_r8_dpo_1.5b_full_
    mb2_ckpt: two fp32 copies, 11.50 GiB): stage_memory.REFERENCE_COPY_LIKE_THE_POLICY models them."""
    from lmstack.memory import stage_memory

    req, gpu = configured(qwen("0.5b"), stage="dpo", finetuning_type="full")
    assert plan(req).configured.setup.fp32_model_weights
    assert dict(gpu.terms)[REFERENCE_COPY_ROW] == pytest.approx(2 * 494_032_768 / mem.GIB, rel=1e-3)
    monkeypatch.setattr(stage_memory, "REFERENCE_COPY_LIKE_THE_POLICY", True)
    _, before = configured(qwen("0.5b"), stage="dpo", finetuning_type="full")
    assert dict(before.terms)[REFERENCE_COPY_ROW] == pytest.approx(4 * 494_032_768 / mem.GIB, rel=1e-3)
    _, half = configured(qwen("0.5b"), stage="dpo", finetuning_type="full", pure_bf16=True)
    assert dict(half.terms)[REFERENCE_COPY_ROW] == pytest.approx(2 * 494_032_768 / mem.GIB, rel=1e-3)


def test_a_full_dpo_step_holds_every_gradient_and_the_sqrt_but_not_the_reference_forward(qwen, monkeypatch):
    """With checkpointing the optimizer step is a full DPO's peak: weights, every gradient, the moments and
    the multi-tensor AdamW's sqrt(exp_avg_sq), next to the frozen copy; the reference's no-grad forward and
    the activations are gone by then. Traced on the H200 with the copy in fp32 as it loaded then
    (`snap_r8_dpo_1.5b_full_mb2_ckpt`, 34.57 GiB: 11.50 of weights, 11.50 of moments, 5.75 of the sqrt, 5.75
    of gradients); the planner had summed the reference forward into the step and the copy at bf16 (32.26,
    -6.7%). The copy now loads in bf16: 2 B/param less."""
    from lmstack.memory import stage_memory

    def step_peak():
        req, gpu = configured(qwen("1.5b"), stage="dpo", finetuning_type="full", per_device_train_batch_size=2,
                              gradient_checkpointing=True, optim="adamw_torch")  # fmt: skip
        return req.spec.num_params, gpu.allocated

    n, now = step_peak()
    assert now == pytest.approx((4 + 4 + 8 + mem.FOREACH_ADAM_TEMP_BYTES + 2) * n / mem.GIB, rel=0.01)
    monkeypatch.setattr(stage_memory, "REFERENCE_COPY_LIKE_THE_POLICY", True)
    _, traced = step_peak()
    assert traced == pytest.approx((4 + 4 + 8 + mem.FOREACH_ADAM_TEMP_BYTES + 4) * n / mem.GIB, rel=0.01)
    assert traced == pytest.approx(34.57, rel=0.01)


def test_a_full_dpo_without_accumulation_peaks_before_its_decoder_gradients_exist(qwen):
    """TRL's fused log-prob head on a full fine-tune in one process: the decoder gradients fill in as the
    backward frees the activations (estimate.peaks_at_backward_start), so the peak is the larger of the
    forward's end and the step, never their sum. r5_dpo_1.5b_full_mb2 on the H200: 38.46 GiB measured,
    41.33 predicted with every gradient summed (and the copy at bf16), 38.5 recomputed with the copy in fp32
    as that run loaded it."""
    req, gpu = configured(qwen("1.5b"), stage="dpo", finetuning_type="full", per_device_train_batch_size=2)
    assert gpu.gradients < 0.5 * 4 * req.spec.num_params / mem.GIB
    _, accumulating = configured(qwen("1.5b"), stage="dpo", finetuning_type="full",
                                 per_device_train_batch_size=2, gradient_accumulation_steps=2)  # fmt: skip
    assert accumulating.gradients == pytest.approx(4 * req.spec.num_params / mem.GIB, rel=1e-3)


@pytest.mark.parametrize("loss, ftx", [("orpo", 0.0), ("simpo", 0.5), ("simpo", 0.0)])
def test_orpo_and_simpo_have_no_reference_but_full_logits(qwen, loss, ftx):
    req, gpu = configured(qwen("0.5b"), stage="dpo", pref_loss=loss, pref_ftx=ftx)
    assert req.reference == "none" and not gpu.terms
    tokens = 2 * 4 * 1024
    full = mem.UNFUSED_LOGITS_BYTES * tokens * 151936
    if loss == "simpo" and not ftx:  # CPO with cpo_alpha 0: no NLL over the chosen half's fp32 logits
        assert req.loss_path == "full_logits_no_nll"
        full -= mem.FP32_BYTES * tokens // 2 * 151936
    assert gpu.logits == pytest.approx(full / mem.GIB)


def test_kto_adds_the_kl_batch_and_the_reference_passes(qwen):
    req, gpu = configured(qwen("0.5b"), stage="kto")
    assert req.kl_batch and req.rows_per_example == 1 and req.reference == "adapter_off"
    names = [name for name, _ in gpu.terms]
    assert any(n.startswith("reference forward") and "KL batch" in n for n in names)
    assert any(n.startswith("KL batch forward") for n in names)


def test_rm_scores_two_rows_without_lm_logits(qwen):
    req, gpu = configured(qwen("0.5b"), stage="rm")
    assert (req.rows_per_example, req.loss_path) == (2, "value_head")
    tokens = (
        2 * 4 * 1024
    )  # the value head's fp32 input + the measured margin over every layer's hidden states
    margin = mem.VALUE_HEAD_MARGIN_BYTES * tokens * 896 * (24 + 1)
    assert gpu.logits == pytest.approx((4 * tokens * 896 + margin) / mem.GIB)


def test_grpo_generation_kv_cache_is_a_row_when_it_exceeds_training(qwen):
    req, gpu = configured(qwen("7b"), stage="grpo", reward_funcs="m:f", per_device_train_batch_size=8,
                          gradient_accumulation_steps=16, cutoff_len=512, max_new_tokens=1536,
                          gradient_checkpointing=True, num_generations=8)  # fmt: skip
    assert req.seq_len == 2048 and req.generated_rows == 128 and req.prompt_len == 512
    kv = mem.kv_cache_bytes(128, 2048, 28, 512) / mem.GIB
    row = next(v for name, v in gpu.terms if name.startswith("generation: KV cache of 128 x 2048"))
    assert 0 < row <= kv + mem.sampling_logits_bytes(128, 152064) / mem.GIB
    train = gpu.activations + gpu.logits
    assert row == pytest.approx(kv + mem.sampling_logits_bytes(128, 152064) / mem.GIB - train, rel=1e-6)


def test_grpo_full_with_a_kl_term_loads_a_reference_copy(qwen):
    req, gpu = configured(
        qwen("0.5b"), stage="grpo", reward_funcs="m:f", finetuning_type="full", pref_beta=0.04
    )
    assert req.reference == "copy" and REFERENCE_COPY_ROW in dict(gpu.terms)


def test_ppo_holds_reward_model_reference_and_rollout(qwen):
    req, gpu = configured(qwen("0.5b"), stage="ppo", reward_model="rm_out", max_new_tokens=256)
    terms = dict(gpu.terms)
    assert terms["reward model weights"] == pytest.approx(2 * 494_032_768 / mem.GIB, rel=1e-3)
    assert terms["rollout buffer"] > 0 and req.loss_path == "full_logits"


def test_a_full_fine_tune_whose_loss_head_peaks_at_the_backward_start_does_not_add_its_gradients(specs):
    """TRL's full-logits head (ORPO) and the value head on a full fine-tune, one GPU, no accumulation: the
    peak is the larger of the backward's start (activations + head + the head's gradient) and its end
    (every gradient). Traced on the H200: snap_r4_orpo_0.5b_full_mb2, snap_r4_rm_0.5b_full_mb4."""
    s = specs["qwen2.5-0.5b"]
    orpo = dict(finetuning_type="full", stage="dpo", rows_per_example=2, micro_batch=2, seq_len=1024,
                loss_path="full_logits", fp32_model_weights=True, packed=False)  # fmt: skip
    g = estimate(s, Setup(**orpo)).gpu
    assert g.gradients * mem.GIB == pytest.approx(4 * s.vocab_size * s.hidden_size)  # the tied head's, fp32
    summed = estimate(s, Setup(optimizer_batch=4, **orpo)).gpu  # accumulation: the gradients stay alive
    assert summed.gradients * mem.GIB == pytest.approx(4 * s.num_params)
    ddp = estimate(s, Setup(num_gpus=2, **orpo)).gpu  # DDP's buckets keep gradient storage
    assert ddp.gradients == estimate(s, Setup(num_gpus=2, optimizer_batch=4, **orpo)).gpu.gradients
    sft = estimate(s, Setup(**{**orpo, "loss_path": "lm", "stage": "sft", "rows_per_example": 1})).gpu
    assert sft.gradients * mem.GIB == pytest.approx(4 * s.num_params)  # the summed model elsewhere
    tiny = estimate(s, Setup(**{**orpo, "micro_batch": 1, "seq_len": 8})).gpu  # the end of the backward
    assert (tiny.gradients + tiny.activations + tiny.logits) * mem.GIB == pytest.approx(4 * s.num_params)


def test_an_auto_micro_batch_with_accumulation_keeps_every_gradient_in_the_peak(qwen):
    """per_device_train_batch_size: auto keeps gradient_accumulation_steps (plan/advice.py): every searched
    micro-batch accumulates, so the backward-start rule of the full-logits head does not apply to any row."""
    from lmstack.memory.estimate import model_states

    flat = dict(model_name_or_path=qwen("0.5b"), output_dir="o", bf16=True, cutoff_len=1024, stage="dpo",
                pref_loss="orpo", finetuning_type="full", per_device_train_batch_size="auto",
                gradient_accumulation_steps=4, gradient_checkpointing=False, flash_attn="sdpa")  # fmt: skip
    req = request_from_config(build_config(flat), 1, 139.8)
    assert req.micro_batch is None and req.loss_path == "full_logits"
    rows = [c for c in plan(req).candidates if c.strategy.name == "single" and c.setup.micro_batch > 1]
    assert rows
    for c in rows:
        summed = model_states(req.spec, c.setup).grads / mem.GIB
        assert c.estimate.gpu.gradients == pytest.approx(summed), c.setup.micro_batch


def test_ppo_keeps_every_gradient_and_its_stage_weights_in_the_peak(specs):
    """PPO on a full fine-tune (full-logits head, generation): never traced, so not under the backward-start
    rule -- every gradient is summed, next to the reference copy, the reward model and the rollout buffer."""
    s = specs["qwen2.5-0.5b"]
    ppo = Setup(finetuning_type="full", stage="ppo", loss_path="full_logits", reference="copy", micro_batch=1,
                seq_len=64, prompt_len=32, generated_rows=1, reward_model_params=s.num_params, packed=False)  # fmt: skip
    g = estimate(s, ppo).gpu
    persistent = sum(v for name, v in g.terms if name in PERSISTENT_ROWS)
    grads = 2 * s.num_params / mem.GIB  # bf16 grads (optimizer-held masters)
    assert g.gradients == pytest.approx(grads)  # summed, whatever the activations
    assert g.allocated >= g.weights + grads + g.optimizer + persistent - 1e-6


def test_the_table_says_why_a_backward_start_peak_shows_few_gradients(specs):
    from lmstack.memory.recommend import PlanRequest

    orpo = dict(spec=specs["qwen2.5-0.5b"], finetuning_type="full", stage="dpo", rows_per_example=2,
                micro_batch=2, seq_len=1024, loss_path="full_logits", fp32_model_weights=True,
                gradient_checkpointing=False, gpu_memory_gib=80)  # fmt: skip
    said = [n for n in plan(PlanRequest(**orpo)).notes if n.startswith("grads:")]
    assert len(said) == 1 and "above the start of the backward" in said[0]
    summed = PlanRequest(**{**orpo, "gradient_accumulation_steps": 2})
    assert not [n for n in plan(summed).notes if n.startswith("grads:")]


def test_freeze_tuning_under_classic_amp_holds_its_frozen_layers_in_fp32(specs):
    """master_weights: model loads the whole model in fp32 and freeze-tuning casts nothing back."""
    s = specs["qwen2.5-0.5b"]
    amp = estimate(s, Setup(finetuning_type="freeze", fp32_model_weights=True, freeze_trainable_layers=2)).gpu
    masters = estimate(s, Setup(finetuning_type="freeze", freeze_trainable_layers=2)).gpu
    trainable = 2 * s.layer_params
    assert amp.weights * mem.GIB == pytest.approx(4 * s.num_params, rel=1e-3)
    assert masters.weights * mem.GIB == pytest.approx(2 * s.num_params, rel=1e-3)
    assert trainable < s.num_params / 5


@pytest.mark.parametrize("loss", ["sigmoid", "orpo"])
def test_full_checkpointing_counts_the_loss_head_and_the_reference_only_above_the_recompute(qwen, loss):
    """With every layer recomputed the loss head and the no-grad reference forward run between the policy's
    forward and its backward, next to the checkpointed inputs only; by the first recompute they are freed.
    The peak is the inputs + the larger of (loss head + reference forward) and (one recomputed layer + its
    backward's start). Round 7 on the H200 (plan_accuracy.json), predicted with both summed: DPO 1.5B LoRA
    checkpointed +29.2%, ORPO +7.0%; with this rule +5.8% and -0.2%."""
    from dataclasses import replace

    from lmstack.memory.estimate import (
        _loss_head_bytes,
        _recompute_layer_bytes,
        activations,
        outside_layers_bytes,
        recompute_phase_bytes,
        train_tokens,
    )
    from lmstack.memory.model_spec import ModelSpec
    from lmstack.memory.stage_memory import _no_grad_forward

    path = qwen("1.5b")
    req, gpu = configured(path, stage="dpo", pref_loss=loss, gradient_checkpointing=True)
    s = plan(req).configured.setup
    spec = ModelSpec.from_pretrained_dir(path)
    recompute = recompute_phase_bytes(spec, s)
    assert recompute is not None and recompute > 0
    outside = outside_layers_bytes(spec, s)  # the embedding output (no packed mask: DPO rows are padded)
    inputs = activations(spec, s) - recompute - outside
    assert inputs == pytest.approx(train_tokens(s) * spec.num_layers * 2 * spec.hidden_size)
    inputs += outside
    head = _loss_head_bytes(spec, s)
    # sigmoid: the adapter-off reference forward; orpo: none
    assert (s.reference != "none") == (loss == "sigmoid")
    reference = _no_grad_forward(spec, s, _recompute_layer_bytes(spec, s)) if s.reference != "none" else 0.0
    above_states = (gpu.activations + gpu.logits + gpu.stage) * mem.GIB
    assert above_states == pytest.approx(inputs + max(head + reference, recompute), rel=1e-6)
    # without checkpointing every row is summed as before
    _, plain = configured(path, stage="dpo", pref_loss=loss)
    assert plain.logits * mem.GIB == pytest.approx(
        _loss_head_bytes(spec, replace(s, gradient_checkpointing=False))
    )


@pytest.mark.parametrize("hidden,intermediate", [(128, 1536), (256, 2048)])
def test_a_no_grad_forward_holds_a_share_of_one_layer(tmp_path, hidden, intermediate, live_bytes):
    """The reference forward's working set (stage_memory._no_grad_forward): a no-grad forward through the real
    decoder peaks below one layer's kept activations of the same batch -- within NO_GRAD_FORWARD_LAYER_SHARE
    (0.8) and not far below it, so the share neither under- nor much over-states it."""
    import torch
    from transformers import AutoModelForCausalLM

    from lmstack.tiny import build_tiny_model

    layers, rows, seq = 4, 2, 256
    path = build_tiny_model(tmp_path / "m", data_dir=None, hidden_size=hidden, intermediate_size=intermediate,
                            num_hidden_layers=layers)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa")
    ids = torch.randint(3, model.config.vocab_size, (rows, seq))
    decoder = model.get_decoder()
    kept: list[int] = []
    model.train()
    tracker = live_bytes(model)
    decoder.norm.register_forward_pre_hook(
        lambda _, a: kept.append(tracker.live - a[0].untyped_storage().nbytes())
    )
    with tracker.mode:
        decoder(input_ids=ids)  # with grad: what the layers keep for the backward
    per_layer = kept[0] / layers
    model.eval()
    no_grad = live_bytes(model)
    with no_grad.mode, torch.no_grad():
        decoder(input_ids=ids)
    share = no_grad.peak / per_layer
    print(f"no-grad forward peak / one layer's kept activations: {share:.3f}")
    assert 0.7 * mem.NO_GRAD_FORWARD_LAYER_SHARE <= share <= mem.NO_GRAD_FORWARD_LAYER_SHARE, share
