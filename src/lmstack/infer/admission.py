"""Admission and client-disconnect handling for `lmstack api` (`infer/server.py`).

`Gate` admits at most `capacity` requests at once (those generating together plus those waiting
for a place in the batch). `until_disconnect` watches the ASGI receive channel while a request
waits or generates: when the client goes away it sets the request's cancel event (the engine stops
at the next token) and cancels the waits. `event_stream` is a server-sent-events response that does
the same for a stream and releases the request's admission however the response ends; a stream
whose client stops reading (its write waits longer than `stall` seconds) is treated as a disconnect,
since otherwise it would hold its batch place for as long as the client keeps the socket open.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

logger = logging.getLogger(__name__)


class Gate:
    """`admit()` counts a request in until the returned `release` is called (None: full, when
    `capacity` requests are in). `seconds` is a recent request's duration (for Retry-After)."""

    def __init__(self, capacity: int):
        self.capacity, self.admitted, self.seconds = capacity, 0, 1.0

    def admit(self) -> Callable[[], None] | None:
        if self.admitted >= self.capacity:
            return None
        self.admitted += 1
        released, start = False, time.monotonic()

        def release() -> None:
            nonlocal released
            if not released:
                released, self.admitted = True, self.admitted - 1
                self.seconds = 0.7 * self.seconds + 0.3 * (time.monotonic() - start)

        return release

    @property
    def retry_after(self) -> int:
        """Seconds until a slot likely frees (about one request's duration)."""
        return min(3600, max(1, math.ceil(self.seconds)))


@asynccontextmanager
async def until_disconnect(receive: Callable, gone: threading.Event) -> AsyncIterator[None]:
    """Runs the body while watching the ASGI `receive` channel (the request body must have been read):
    on a disconnect `gone` is set and the body's waits are cancelled, so the body ends early and the
    code after the `async with` runs. Exceptions of the body pass through unchanged."""
    import anyio

    error = None
    async with anyio.create_task_group() as tasks:

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()
            tasks.cancel_scope.cancel()

        tasks.start_soon(watch)
        try:
            yield
        except Exception as exc:  # re-raised below: the task group would wrap it in an ExceptionGroup
            error = exc
        finally:
            tasks.cancel_scope.cancel()
    if error is not None:
        raise error


def event_stream(
    events: AsyncIterator[str], gone: threading.Event, release: Callable[[], None], stall: float = 30.0
) -> Any:
    """A `text/event-stream` response of `events`: on a disconnect, or a write that waits more than
    `stall` seconds, `gone` is set and `events` is closed; `release` runs however the response ends,
    also when it never starts."""
    return _event_stream_type()(events, gone, release, stall)


@functools.cache
def _event_stream_type() -> type:
    import anyio
    from starlette.responses import StreamingResponse

    class EventStream(StreamingResponse):
        def __init__(
            self, events: AsyncIterator[str], gone: threading.Event, release: Callable[[], None], stall: float
        ):
            super().__init__(events, media_type="text/event-stream")
            self.events, self.gone, self.release, self.stall = events, gone, release, stall

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            async def timed_send(message: Any) -> None:
                with anyio.fail_after(self.stall):
                    await send(message)

            try:
                async with until_disconnect(receive, self.gone):
                    await self.stream_response(timed_send)
            except OSError:  # ASGI 2.4 servers raise on sending to a closed connection
                self.gone.set()
            except TimeoutError:
                logger.info("client stopped reading for %s s: stream dropped", self.stall)
                self.gone.set()
            finally:
                with anyio.CancelScope(shield=True):
                    await self.events.aclose()  # stops the generation, frees its slot
                self.release()
            if self.gone.is_set():
                logger.info("client disconnected: stream dropped")

    return EventStream
