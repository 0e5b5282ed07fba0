"""The planner rules for the reference copy, the recorded layers and the mask: the cases where they once
gave a wrong number.

1. FSDP keeps the frozen reference copy in its load dtype: TRL's prepare_fsdp shards the copy as it is and
   MixedPrecision only casts the gathered copies to bf16. decide.precision loads a full/freeze model in fp32
   under FSDP (the masters are FSDP's), so the copy, loaded like the policy then, was fp32 (it loads in the
   compute dtype since). DeepSpeed's engine casts its copy to bf16 (TRL prepare_deepspeed).
2. LLaMA-Pro's expanded blocks are scattered through the stack (every (N/k)-th layer): every layer above the
   first one records a graph, the frozen ones between them too.
3. With every layer checkpointed, a padded (unpacked) SDPA batch and every eager batch carry a [rows, 1, seq,
   seq] mask next to the layers' inputs, as packed SDPA rows do.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from dataclasses import replace

import pytest
import torch

from lmstack.config.load import build_config
from lmstack.memory import memory as mem
from lmstack.memory import plan
from lmstack.memory.estimate import Setup, outside_layers_bytes, train_tokens
from lmstack.memory.stage_memory import REFERENCE_COPY_ROW
from lmstack.plan.whatif import plan_for, request_from_config


def _flat(path: str, **kw) -> dict:
    flat = dict(model_name_or_path=path, output_dir="o", bf16=True, cutoff_len=1024, finetuning_type="full",
                per_device_train_batch_size=4, gradient_checkpointing=False, flash_attn="sdpa")  # fmt: skip
    flat.update(kw)
    return flat


def _planned(path: str, gpus: int = 1, **kw):
    return plan(request_from_config(build_config(_flat(path, **kw)), gpus, 139.8))


# ---- 1. the reference copy under FSDP -------------------------------------------------------------------------
_FSDP_KEEPS_DTYPE = textwrap.dedent(
    """
    import os, socket, torch, torch.distributed as dist
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    ref = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))  # loaded in fp32
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for layer in ref:
        fully_shard(layer, mp_policy=policy)
    fully_shard(ref, mp_policy=policy)
    ref.eval()
    with torch.no_grad():
        out = ref(torch.randn(4, 64))
    print(str(out.dtype), sorted({str(p.dtype) for p in ref.parameters()}))
    dist.destroy_process_group()
    """
)


def test_fsdp_shards_the_reference_in_its_fp32_load_dtype_and_computes_in_bf16():
    """What FSDP stores of a module loaded in fp32 under a bf16 MixedPrecision policy (FSDP2 on CPU, gloo, one
    rank): fp32 shards; only the gathered compute copies are bf16."""
    run = subprocess.run(
        [sys.executable, "-c", _FSDP_KEEPS_DTYPE], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-2000:]
    out, params = run.stdout.strip().split(" ", 1)
    assert out == "torch.bfloat16" and params == "['torch.float32']"


def test_a_full_dpo_under_fsdp_shards_its_bf16_reference_copy(qwen, monkeypatch):
    """decide.precision loads the policy in fp32 under FSDP; train/rlhf.load_frozen_model loads the copy in the
    compute dtype (bf16), and FSDP FULL_SHARD splits it over the ranks as it is: 2 B/param / n. The runs made
    before the copy loaded in bf16 had it like the policy, fp32: 4 B/param / n (REFERENCE_COPY_LIKE_THE_POLICY).
    DeepSpeed's engine casts its copy to bf16 either way."""
    from lmstack.memory import stage_memory

    path = qwen("0.5b")
    n_params = 494_032_768
    fsdp = build_config(_flat(path, stage="dpo", fsdp="full_shard auto_wrap"))
    assert plan_for(fsdp, 2, 139.8, None, None).precision.load == "fp32"
    row = dict(_planned(path, 2, stage="dpo", fsdp="full_shard auto_wrap").configured.estimate.gpu.terms)
    assert row[REFERENCE_COPY_ROW] == pytest.approx(2 * n_params / 2 / mem.GIB, rel=1e-3)
    monkeypatch.setattr(stage_memory, "REFERENCE_COPY_LIKE_THE_POLICY", True)
    before = dict(_planned(path, 2, stage="dpo", fsdp="full_shard auto_wrap").configured.estimate.gpu.terms)
    assert before[REFERENCE_COPY_ROW] == pytest.approx(4 * n_params / 2 / mem.GIB, rel=1e-3)
    monkeypatch.setattr(stage_memory, "REFERENCE_COPY_LIKE_THE_POLICY", False)
    # LoRA with ref_model: the base and its copy stay bf16 (decide.precision keep_half)
    lora = _planned(path, 2, stage="dpo", fsdp="full_shard auto_wrap", finetuning_type="lora", ref_model=path)
    assert dict(lora.configured.estimate.gpu.terms)[REFERENCE_COPY_ROW] == pytest.approx(
        2 * n_params / 2 / mem.GIB, rel=1e-3
    )
    # ZeRO-3: DeepSpeed's engine casts the copy to bf16 and partitions it
    z3 = _planned(path, 2, stage="dpo", deepspeed="examples/deepspeed/ds_z3_config.json")
    assert dict(z3.configured.estimate.gpu.terms)[REFERENCE_COPY_ROW] == pytest.approx(
        2 * n_params / 2 / mem.GIB, rel=1e-3
    )


def test_searched_fsdp_rows_shard_the_reference_and_shard_grad_op_keeps_its_gathered_copy(qwen):
    """The recommendation's FSDP rows of a single-process DPO config: FULL_SHARD splits the bf16 copy over the
    ranks; SHARD_GRAD_OP keeps the whole gathered bf16 copy beside its shards (no reshard after a forward
    without a backward)."""
    result = _planned(qwen("0.5b"), 2, stage="dpo")
    from lmstack.memory.recommend import candidate_strategies, search

    rows = search(result.request, candidate_strategies(result.request))
    n_params = 494_032_768
    full_shard = [c for c in rows if c.strategy.fsdp == "FULL_SHARD"]
    assert full_shard
    for c in full_shard:
        assert dict(c.estimate.gpu.terms)[REFERENCE_COPY_ROW] == pytest.approx(
            2 * n_params / 2 / mem.GIB, rel=1e-3
        )
    for c in (c for c in rows if c.strategy.fsdp == "SHARD_GRAD_OP"):
        assert dict(c.estimate.gpu.terms)[REFERENCE_COPY_ROW] == pytest.approx(
            (2 * n_params / 2 + 2 * n_params) / mem.GIB, rel=1e-3
        )


# ---- 2. LLaMA-Pro's scattered expanded blocks -----------------------------------------------------------------
LAYERS = 4  # the probe (conftest.kept_per_token) runs 2 rows of 256 tokens


def test_llama_pro_records_the_frozen_layers_between_its_expanded_blocks(tmp_path, kept_per_token):
    """4 layers, 2 expanded blocks (layers 1 and 3): layers 1, 2 and 3 record, against 2 and 3 with the last 2
    trained -- one more layer, a frozen one (a trained layer less the traced discount)."""
    from lmstack.tiny import build_tiny_model

    hidden, intermediate = 256, 512
    path = build_tiny_model(tmp_path / "m", data_dir=None, hidden_size=hidden, intermediate_size=intermediate,
                            num_hidden_layers=LAYERS)  # fmt: skip
    last1 = kept_per_token(path, freeze_trainable_layers=1)
    last2 = kept_per_token(path, freeze_trainable_layers=2)
    pro2 = kept_per_token(path, freeze_trainable_layers=2, use_llama_pro=True)
    trained_layer = last2 - last1
    discount = mem.frozen_layer_discount_bytes_per_token(hidden, intermediate, False, False)
    assert pro2 - last2 == pytest.approx(trained_layer - discount, rel=0.01)


def test_the_planner_counts_llama_pros_recording_frozen_layers(qwen):
    """Qwen2.5-0.5B (24 layers) with 4 expanded blocks (layers 5, 11, 17, 23): 19 layers record, 15 of them
    frozen; the planner counted the last 4 only, as for freeze_trainable_layers: 4."""
    from lmstack.memory.estimate import _layer_bytes_per_token, activation_factor

    path = qwen("0.5b")
    last = _planned(path, finetuning_type="freeze", freeze_trainable_layers=4)
    pro = _planned(path, finetuning_type="freeze", freeze_trainable_layers=4, use_llama_pro=True)
    spec, s = pro.request.spec, pro.configured.setup
    tokens = train_tokens(s)
    full = tokens * _layer_bytes_per_token(spec, s) * activation_factor(s)
    frozen = full - tokens * mem.frozen_layer_discount_bytes_per_token(
        spec.hidden_size, spec.intermediate_size, False, False
    )
    gap = (pro.configured.estimate.gpu.activations - last.configured.estimate.gpu.activations) * mem.GIB
    assert gap == pytest.approx(15 * frozen, rel=1e-6)
    # the trained states are the same 4 layers
    assert pro.configured.estimate.gpu.optimizer == pytest.approx(last.configured.estimate.gpu.optimizer)


# ---- 3. the attention mask next to the checkpointed inputs ----------------------------------------------------
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_padded_batch_hands_every_layer_a_rows_by_seq_squared_mask(tiny_model, attention):
    """The real model on a padded batch (unpacked rows of different lengths): masking_utils builds one
    [rows, 1, seq, seq] mask for every layer -- bool under SDPA, the weights' dtype under eager."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        tiny_model, dtype=torch.bfloat16, attn_implementation=attention
    )
    rows, seq = 3, 64
    ids = torch.randint(3, model.config.vocab_size, (rows, seq))
    attention_mask = torch.ones(rows, seq, dtype=torch.long)
    attention_mask[1, 40:] = 0
    attention_mask[2, 20:] = 0
    seen = []
    model.model.layers[0].register_forward_pre_hook(
        lambda _, args, kwargs: seen.append(kwargs["attention_mask"]), with_kwargs=True
    )
    with torch.no_grad():
        model(input_ids=ids, attention_mask=attention_mask)
    mask = seen[0]
    assert tuple(mask.shape) == (rows, 1, seq, seq)
    assert mask.element_size() == (1 if attention == "sdpa" else mem.BF16_BYTES)


def test_full_checkpointing_counts_the_mask_of_a_padded_or_eager_batch(specs):
    spec = specs["qwen2.5-0.5b"]
    s = Setup(finetuning_type="lora", micro_batch=8, seq_len=2048, gradient_checkpointing=True, packed=False)
    inputs = train_tokens(s) * 2 * spec.hidden_size
    assert outside_layers_bytes(spec, s) == pytest.approx(inputs + 8 * 2048**2)  # bool, padded rows
    assert outside_layers_bytes(spec, replace(s, micro_batch=1)) == pytest.approx(inputs / 8)  # no padding
    eager = replace(s, attention="eager")
    assert outside_layers_bytes(spec, eager) == pytest.approx(inputs + 2 * 8 * 2048**2)
    assert outside_layers_bytes(spec, replace(eager, packed=True)) == pytest.approx(inputs + 2 * 8 * 2048**2)
    assert outside_layers_bytes(spec, replace(s, attention="flash")) == pytest.approx(inputs)
