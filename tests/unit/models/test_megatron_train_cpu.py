"""megatron-core's GPTModel trained on CPU under gloo from the HF mapping: the same losses as the HF model
for a few AdamW steps (float32, tight), at TP=1 and at TP=2 on 2 gloo processes, and the trained weights
exported to an HF folder reload in transformers with the megatron model's logits.

megatron-core 0.16 runs on CPU with three settings, all in `cpu_megatron` below: its hard-coded
`torch.cuda.current_device()` (RoPE frequencies, TP gathers) answered with the CPU device; an explicit
causal mask (its default mask is built with device="cuda"); and its no-op RNG tracker (the CUDA RNG
tracker needs CUDA; with dropout 0 no random numbers are drawn). The GPU test runs it without any."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

# found, not imported: importing megatron.core at collection registers its classes (argparse.Namespace,
# PosixPath, ...) as torch.load weights_only safe globals for the whole test process
if importlib.util.find_spec("megatron.core") is None:
    pytest.skip("megatron-core is not installed", allow_module_level=True)

from tests.unit.models.test_megatron_weights import free_port, tiny_hf  # noqa: E402

from lmstack.models import megatron_weights as mw  # noqa: E402

STEPS, BATCH, SEQ = 4, 2, 12


def cpu_megatron(tp: int) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    torch.cuda.current_device = lambda: torch.device("cpu")
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def batches():
    """One batch, every step: its loss must fall, so the step that trains is checked too."""
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (BATCH, SEQ), generator=g)] * STEPS


def mcore_forward(model, ids, labels=None):
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    mask = torch.triu(torch.ones(1, 1, ids.shape[1], ids.shape[1], dtype=torch.bool), 1)  # True = hidden
    return model(ids, pos, attention_mask=mask, labels=labels)


def mcore_loss(model, ids):
    """Mean next-token loss, as HF's: megatron's labels are the already shifted targets."""
    return mcore_forward(model, ids, torch.roll(ids, -1, dims=1))[:, :-1].mean()


def train(model, loss_fn):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    losses = []
    for ids in batches():
        loss = loss_fn(model, ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def worker(rank: int, world: int, port: int, out: dict) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        cpu_megatron(world)
        hf = tiny_hf("qwen2")
        s = mw.shape_of(hf.config)
        model = mw.build_gpt(s, mw.transformer_config(s, world))
        mw.load_into(model, mw.to_megatron(s, hf.state_dict(), world, rank))
        losses = train(model, mcore_loss)
        with torch.no_grad():
            logits = mcore_forward(model, batches()[0])
        out[rank] = {"losses": losses, "weights": mw.weights_of(model), "logits": logits}
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_trains_like_hf_and_exports(tmp_path, tp):
    import torch.multiprocessing as mp
    from transformers import AutoModelForCausalLM

    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(worker, args=(tp, free_port(), out), nprocs=tp, join=True)
        ranks = dict(out)
    hf = tiny_hf("qwen2")
    theirs = train(hf, lambda m, ids: m(ids, labels=ids).loss)
    for rank in range(tp):
        got = torch.tensor(ranks[rank]["losses"])
        torch.testing.assert_close(got, torch.tensor(theirs), rtol=1e-5, atol=1e-5)
    assert theirs[-1] < theirs[0] - 0.1

    s = mw.shape_of(hf.config)
    exported = tiny_hf("qwen2")
    exported.load_state_dict(mw.to_hf(s, [[ranks[r]["weights"] for r in range(tp)]]))
    exported.save_pretrained(tmp_path / "hf")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    logits = torch.cat([ranks[r]["logits"] for r in range(tp)], dim=-1)  # vocab shards, rank order
    with torch.no_grad():
        torch.testing.assert_close(again(batches()[0]).logits, logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(again(batches()[0]).logits, hf(batches()[0]).logits, rtol=1e-4, atol=1e-4)
