"""How the batcher hands its output over (issue 22 follow-up), on the tiny model: a step's events go
out in one call to the sinks' shared `many`; the server's `Runs` coalesces what queued up while its
loop was busy into one piece per choice, text and logprobs intact; the fast decode path gives exactly
`tokenizer.decode`'s text."""

from __future__ import annotations

import asyncio
import queue
import random
import threading

import pytest

from lmstack.infer.engine import ChatEngine, load_infer_config
from lmstack.infer.sampling import Generation, Piece, Sampling


@pytest.fixture(scope="module")
def engine(tiny_model, make_engine):
    return make_engine(tiny_model, 32)


class Shared:
    """Sinks of one `many`: records each call's events."""

    def __init__(self):
        self.calls: list[list] = []
        self.done = threading.Event()
        self.left = 0

    def many(self, items):
        self.calls.append(items)
        self.left -= sum(isinstance(event, Generation) for _, event in items)
        if self.left == 0:
            self.done.set()


class SharedSink:
    def __init__(self, shared: Shared):
        self.many = shared.many

    def __call__(self, event):
        self.many([(self, event)])


def test_a_steps_events_reach_the_shared_many_in_one_call(engine):
    prompts = ["Hello there", "What is 2 + 2?", "你好", "Name three colors."]
    shared = Shared()
    shared.left = len(prompts)
    sinks = [SharedSink(shared) for _ in prompts]
    lengths = [20, 7, 13, 20]
    before = engine.scheduler.steps
    for prompt, sink, n in zip(prompts, sinks, lengths, strict=True):
        ids = engine.prompt_ids([{"role": "user", "content": prompt}])
        engine.submit(ids, Sampling(max_tokens=n), sink, threading.Event())
    assert shared.done.wait(120)
    steps = engine.scheduler.steps - before
    assert len(shared.calls) <= steps + 1  # one hand-off per step, not one per row and token
    assert max(len(items) for items in shared.calls) > 1  # rows of one step travel together
    for items in shared.calls:  # a row has at most one piece per step
        pieces = [sink for sink, event in items if isinstance(event, Piece)]
        assert len(pieces) == len(set(map(id, pieces)))
    for sink, n in zip(sinks, lengths, strict=True):
        events = [event for items in shared.calls for s, event in items if s is sink]
        result = events[-1]
        assert isinstance(result, Generation) and result.completion_tokens <= n
        assert "".join(e.text for e in events[:-1]) == result.text


def test_pieces_queued_while_the_loop_is_busy_arrive_as_one_per_choice(engine):
    from lmstack.infer import runs as runs_module
    from lmstack.infer.server import Runs

    ids = engine.prompt_ids([{"role": "user", "content": "Tell me a story."}])
    sampling = Sampling(max_tokens=24, logprobs=True, top_logprobs=2)

    async def main():
        loop = asyncio.get_running_loop()
        many, handed_off = runs_module._many_for(loop), threading.Event()
        results = []

        def counting(items):  # the loop's delivery, noting when both choices' results were handed off
            many(items)
            results.extend(event for _, event in items if isinstance(event, Generation))
            if len(results) == 2:
                handed_off.set()

        runs_module._MANY[loop] = counting
        runs = Runs(engine, [(ids, sampling), (ids, Sampling(max_tokens=24))], threading.Event())
        # the loop is blocked until every event of both choices has queued up (the timeout only guards)
        assert handed_off.wait(120)
        return [batch async for batch in runs.batches()]

    batches = asyncio.run(main())
    events = [item for batch in batches for item in batch]
    for choice in (0, 1):
        mine = [event for i, event in events if i == choice]
        pieces, result = mine[:-1], mine[-1]
        assert isinstance(result, Generation) and result.completion_tokens > 1
        assert len(pieces) == 1  # coalesced, not one per token
        assert pieces[0].text == result.text
        if choice == 0:  # every token's logprob, in order, in the one piece
            assert len(result.logprobs) >= result.completion_tokens - 1
            assert pieces[0].logprobs == result.logprobs


def test_the_fast_decode_gives_tokenizer_decode_text(engine):
    from lmstack.infer.batching import _exact_decoder

    tokenizer = engine.tokenizer
    decode = _exact_decoder(tokenizer)
    assert decode != tokenizer.decode  # the tiny model's tokenizer takes the fast path
    rng = random.Random(0)
    vocab = len(tokenizer)
    text_ids = tokenizer("héllo 你好 wörld, <|im_end|> ok")["input_ids"]
    windows = [rng.sample(range(vocab), k=rng.randint(1, 5)) for _ in range(300)]
    windows += [text_ids[i:j] for i in range(len(text_ids)) for j in range(i + 1, len(text_ids) + 1)]
    for window in windows:
        for skip in (True, False):
            assert decode(window, skip_special_tokens=skip) == tokenizer.decode(
                window, skip_special_tokens=skip
            )


def test_a_tokenizer_that_cleans_up_spaces_keeps_its_own_decode(tiny_model):
    from transformers import AutoTokenizer

    from lmstack.infer.batching import _exact_decoder

    tokenizer = AutoTokenizer.from_pretrained(tiny_model, clean_up_tokenization_spaces=True)
    assert _exact_decoder(tokenizer) == tokenizer.decode


@pytest.mark.gpu
def test_bf16_logits_on_cuda_give_the_same_greedy_tokens_and_float_logprobs(tiny_model):
    """The batcher keeps the forward's logits in bf16 (argmax is exact on them) and casts only for
    sampling and logprobs: on CUDA, batched greedy rows equal their runs alone, logprobs are <= 0."""
    cfg = {
        "model_name_or_path": str(tiny_model),
        "template": "qwen",
        "infer_dtype": "bfloat16",
        "do_sample": False,
        "max_new_tokens": 24,
    }
    gpu = ChatEngine.from_config(load_infer_config(None, cfg), max_batch=4)
    assert gpu.model.device.type == "cuda"
    prompts = ["Hello there", "What is 2 + 2?", "你好"]
    jobs = [
        (gpu.prompt_ids([{"role": "user", "content": p}]), Sampling(max_tokens=24, logprobs=True))
        for p in prompts
    ]

    def run(batch):
        sinks = [queue.Queue() for _ in batch]
        for (ids, sampling), sink in zip(batch, sinks, strict=True):
            gpu.submit(ids, sampling, sink.put, threading.Event())
        out = []
        for sink in sinks:
            while not isinstance(event := sink.get(timeout=120), Generation):
                pass
            out.append(event)
        return out

    alone = [run([job])[0] for job in jobs]
    together = run(jobs)
    assert [r.text for r in together] == [r.text for r in alone]
    assert all(all(e.logprob <= 0.0 for e in r.logprobs) for r in together)
