"""HF <-> megatron-core weight mapping on CPU: megatron-core builds its GPTModel on CPU under gloo (TP=2
and PP=2 shard shapes included), so the mapping loads strictly into the real model and comes back equal.
The numerical check (equal losses while training, equal logits after export) is
test_megatron_train_cpu.py on CPU (TP=1, TP=2) and tests/gpu/test_megatron_gpu.py on a GPU."""

from __future__ import annotations

import importlib.util
import os
import socket

import pytest
import torch

# found, not imported: importing megatron.core at collection registers its classes (argparse.Namespace,
# PosixPath, ...) as torch.load weights_only safe globals for the whole test process
if importlib.util.find_spec("megatron.core") is None:
    pytest.skip("megatron-core is not installed", allow_module_level=True)

from lmstack.models import megatron_weights as mw  # noqa: E402


def tiny_hf(family: str, tied: bool = False):
    import transformers

    cls = {"qwen2": "Qwen2", "qwen3": "Qwen3", "llama": "Llama"}[family]
    config = getattr(transformers, cls + "Config")(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(0)
    return getattr(transformers, cls + "ForCausalLM")(config)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank: int, world: int, port: int, family: str, tied: bool, tp: int, pp: int, out: dict) -> None:
    """One gloo rank: build the (tp, pp) GPTModel, load its mapped shard strictly, hand its weights back."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        hf = tiny_hf(family, tied)
        s = mw.shape_of(hf.config)
        tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        model = mw.build_gpt(
            s, mw.transformer_config(s, tp, pp), ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        )
        mw.load_into(model, mw.to_megatron(s, hf.state_dict(), tp, tp_rank, pp, pp_rank))
        out[(pp_rank, tp_rank)] = mw.weights_of(model)
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def run_ranks(family: str, tied: bool, tp: int, pp: int) -> dict:
    import torch.multiprocessing as mp

    world = tp * pp
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(worker, args=(world, free_port(), family, tied, tp, pp, out), nprocs=world, join=True)
        return dict(out)


@pytest.mark.parametrize(
    "family,tied,tp,pp",
    [("qwen2", False, 1, 1), ("qwen3", True, 1, 1), ("llama", False, 1, 1), ("qwen2", False, 2, 1),
     ("qwen3", False, 2, 1), ("qwen2", False, 1, 2)],
)  # fmt: skip  (tied + PP=2 syncs the two embedding copies with a CUDA collective: GPU only)
def test_hf_megatron_hf_round_trip(family, tied, tp, pp):
    """HF -> the real GPTModel's parameters of every (TP, PP) rank -> HF: every tensor comes back equal,
    and the exported state dict loads strictly into the transformers class."""
    hf = tiny_hf(family, tied)
    ranks = run_ranks(family, tied, tp, pp)
    stages = [[ranks[(p, t)] for t in range(tp)] for p in range(pp)]
    back = mw.to_hf(mw.shape_of(hf.config), stages)
    want = {k: v for k, v in hf.state_dict().items() if not (tied and k == "lm_head.weight")}
    assert back.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(back[k], v), k
    again = type(hf)(hf.config)
    again.load_state_dict(back, strict=not tied)
    ids = torch.randint(0, 128, (2, 7))
    assert torch.equal(again(ids).logits, hf(ids).logits)


def test_tp_splits_query_groups():
    """Under TP=2 each rank holds whole KV groups: rank 0's fused qkv rows are group 0's q heads, k, v."""
    hf = tiny_hf("qwen2")
    s = mw.shape_of(hf.config)
    sd = hf.state_dict()
    rank0 = mw.to_megatron(s, sd, tp=2, tp_rank=0)["decoder.layers.0.self_attention.linear_qkv.weight"]
    att = "model.layers.0.self_attn."
    q, k, v = sd[att + "q_proj.weight"], sd[att + "k_proj.weight"], sd[att + "v_proj.weight"]
    assert torch.equal(rank0, torch.cat([q[:16], k[:8], v[:8]]))


def test_family_refused_by_name():
    from transformers import GPT2Config

    with pytest.raises(ValueError, match="model_type: got 'gpt2'"):
        mw.shape_of(GPT2Config())
