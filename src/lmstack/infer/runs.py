"""One API request's sequences in the batcher, seen from the event loop (split from infer/server.py).

The batcher hands a whole step's events to the loop in one `call_soon_threadsafe` (the sinks share
the loop's `many`, see `infer/batching.py`); `Runs.batches` coalesces what queued up meanwhile (a
choice's consecutive pieces become one), so a stream that falls behind sends fewer, larger SSE
chunks instead of one per token, and the loop's work grows with the streams, not the tokens.
"""

import asyncio
import threading
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Any

from lmstack.infer.sampling import Generation, Piece, Sampling


class Runs:
    """Sequences of one request, submitted to the engine; their events arrive on an asyncio queue
    as (choice index, Piece | Generation | Exception)."""

    def __init__(self, engine: Any, jobs: list[tuple[list[int], Sampling]], cancel: threading.Event):
        loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.count = len(jobs)
        many = _many_for(loop)
        for index, (ids, sampling) in enumerate(jobs):
            engine.submit(ids, sampling, _Sink(many, self.queue, index), cancel)

    async def batches(self) -> AsyncIterator[list[tuple[int, Any]]]:
        """What arrived since the last batch, coalesced; ends after every choice's Generation."""
        left = self.count
        while left:
            events = [await self.queue.get()]
            while not self.queue.empty():
                events.append(self.queue.get_nowait())
            batch = _coalesce(events)
            failed = next((k for k, (_, event) in enumerate(batch) if isinstance(event, Exception)), None)
            if failed is not None:  # what came before the failure is still sent
                if failed:
                    yield batch[:failed]
                raise batch[failed][1]
            left -= sum(isinstance(event, Generation) for _, event in batch)
            yield batch

    async def events(self) -> AsyncIterator[tuple[int, Any]]:
        async for batch in self.batches():
            for item in batch:
                yield item

    async def results(self) -> list[Generation]:
        done: dict[int, Generation] = {}
        async for index, event in self.events():
            if isinstance(event, Generation):
                done[index] = event
        return [done[i] for i in range(self.count)]


class _Sink:
    """One choice's sink: called from the batcher's thread; `many` delivers a step's events."""

    __slots__ = ("many", "queue", "index")

    def __init__(self, many: Callable, queue: asyncio.Queue, index: int):
        self.many, self.queue, self.index = many, queue, index

    def __call__(self, event: Any) -> None:
        self.many([(self, event)])


_MANY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _many_for(loop: Any) -> Callable:
    """The loop's delivery function (one per loop, so the batcher groups all its sinks' events)."""
    many = _MANY.get(loop)
    if many is None:

        def deliver(items: list[tuple[_Sink, Any]]) -> None:
            for sink, event in items:
                sink.queue.put_nowait((sink.index, event))

        def many(items: list[tuple[_Sink, Any]]) -> None:
            try:
                loop.call_soon_threadsafe(deliver, items)
            except RuntimeError:  # the loop is gone (server shutting down)
                pass

        _MANY[loop] = many
    return many


def _coalesce(events: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
    """Merges each choice's consecutive pieces (text and logprobs joined); order per choice kept."""
    out: list[tuple[int, Any]] = []
    last: dict[int, int] = {}  # choice -> position of its latest event in `out`
    for index, event in events:
        j = last.get(index)
        if j is not None and isinstance(event, Piece) and isinstance(out[j][1], Piece):
            prev = out[j][1]
            out[j] = (index, Piece(prev.text + event.text, prev.logprobs + event.logprobs))
        else:
            last[index] = len(out)
            out.append((index, event))
    return out
