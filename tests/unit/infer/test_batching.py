"""Continuous batching on the tiny model (real weights, real forward): sequences that join and leave
a running batch get exactly the tokens they get alone, in far fewer forwards than one at a time;
seeds make sampling reproducible whatever else is in the batch; cancel stops a sequence."""

from __future__ import annotations

import queue
import threading

import pytest

from lmstack.infer.sampling import Generation, Piece, Sampling

PROMPTS = ["Hello there", "What is 2 + 2?", "Tell me a story.", "你好", "Name three colors.", "x " * 40]


@pytest.fixture(scope="module")
def engine(tiny_model, make_engine):
    return make_engine(tiny_model, 48)


def run(engine, jobs):
    """Submits all jobs at once; returns (texts, generations) in job order."""
    sinks = [queue.Queue() for _ in jobs]
    for (ids, sampling), sink in zip(jobs, sinks, strict=True):
        engine.submit(ids, sampling, sink.put, threading.Event())
    texts, results = [], []
    for sink in sinks:
        pieces = []
        while not isinstance(event := sink.get(timeout=120), Generation):
            assert isinstance(event, Piece), event
            pieces.append(event.text)
        texts.append("".join(pieces))
        results.append(event)
    return texts, results


def test_batched_sequences_equal_their_runs_alone(engine):
    ids = [engine.prompt_ids([{"role": "user", "content": p}]) for p in PROMPTS]
    lengths = [48, 5, 30, 17, 48, 9]  # sequences leave the batch at different steps
    jobs = [(i, Sampling(max_tokens=n)) for i, n in zip(ids, lengths, strict=True)]
    alone = [run(engine, [job]) for job in jobs]
    before = engine.scheduler.steps
    texts, results = run(engine, jobs)  # 6 sequences through a batch of 4
    steps = engine.scheduler.steps - before
    assert texts == [t[0] for t, _ in alone]
    assert [r.text for r in results] == texts
    assert [(r.completion_tokens, r.finish_reason) for r in results] == [
        (a[1][0].completion_tokens, a[1][0].finish_reason) for a in alone
    ]
    assert steps < 0.6 * sum(r.completion_tokens for r in results)  # decoded together, not in turn


def test_seeded_sampling_does_not_depend_on_the_batch(engine):
    ids = engine.prompt_ids([{"role": "user", "content": "Hello"}])
    sampled = Sampling(max_tokens=16, do_sample=True, temperature=1.0, seed=3)
    alone, _ = run(engine, [(ids, sampled)])
    crowd, _ = run(engine, [(ids, Sampling(max_tokens=40))] * 2 + [(ids, sampled)])
    assert crowd[2] == alone[0]
    other, _ = run(engine, [(ids, Sampling(max_tokens=16, do_sample=True, temperature=1.0, seed=4))])
    assert other != alone


def test_cancel_stops_a_sequence_and_a_cancelled_waiting_one_never_runs(engine):
    ids = engine.prompt_ids([{"role": "user", "content": "Hello"}])
    cancel, out = threading.Event(), queue.Queue()
    cancel.set()
    engine.submit(ids, Sampling(max_tokens=48), out.put, cancel)
    result = out.get(timeout=60)
    assert isinstance(result, Generation) and result.completion_tokens == 0

    cancel, out = threading.Event(), queue.Queue()
    engine.submit(ids, Sampling(max_tokens=10_000), out.put, cancel)
    assert isinstance(out.get(timeout=60), Piece)
    cancel.set()
    while not isinstance(event := out.get(timeout=60), Generation):
        pass
    assert event.finish_reason == "stop" and event.completion_tokens < 10_000
