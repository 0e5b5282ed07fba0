"""What `lmstack api` checks before it reads a request (`infer/server.py`), against browsers and slow
or guessing clients:

- Host and Origin (`HostPolicy`): a keyless server is on loopback, and a web page on any site can
  still reach it: through DNS rebinding (the page's own name resolves to 127.0.0.1, so the request's
  Host is that name) or with a cross-site request (its Origin names the other site). A request is
  answered only when its Host and, if sent, its Origin name this server: a loopback name (localhost,
  127.x.x.x, ::1), the address it is bound to, or a name given with `--allow-host` / API_ALLOWED_HOSTS
  (`*`: any). On a wildcard bind (0.0.0.0, ::) the Host is not checked (the key it needs guards it),
  the Origin still is. Clients that are not browsers send no Origin.
- Content type: a POST body must be JSON (`application/json`; no Content-Type is read as JSON, as
  FastAPI does). `text/plain`, forms and multipart are what a browser sends cross-site without a
  CORS preflight, so a JSON parse of them would let any page start generations.
- Failed API keys (`Throttle`): after `attempts` wrong keys from one address within `window` seconds,
  that address gets 429 with Retry-After until the window ends (right key or not), so a key cannot be
  guessed at loopback speed.
- Slow connections (`deadline_protocol`): uvicorn waits for a request's headers without a time limit,
  so connections that send a byte now and then hold file descriptors until none is left. The protocol
  closes a connection whose headers are not complete `seconds` after it opened (or after its previous
  response); the body and the stream's writes have their own bounds in the server.
"""

from __future__ import annotations

import functools
import ipaddress
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARDS = ("0.0.0.0", "::", "")


def error_body(message: str, kind: str, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def _name(host: str) -> str:
    """The host name of a Host header value or bound address, lower case, without port or brackets."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    if host.count(":") == 1:
        host = host.partition(":")[0]
    return host.rstrip(".")


def _is_loopback(name: str) -> bool:
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class HostPolicy:
    """The names a request's Host and Origin may carry (see the module docstring)."""

    bound: str = "127.0.0.1"
    allowed: tuple[str, ...] = ()
    json_only: bool = True  # POST bodies must be JSON (the API; the web UI posts forms and uploads)
    flag: str = "--allow-host NAME (or API_ALLOWED_HOSTS=NAME,...)"  # how to allow a name

    @property
    def names(self) -> list[str]:
        extra = [_name(h) for h in self.allowed]
        bound = [] if _name(self.bound) in WILDCARDS else [_name(self.bound)]
        return list(dict.fromkeys([*LOOPBACK_NAMES, *bound, *extra]))

    def allows(self, name: str) -> bool:
        return "*" in self.allowed or _is_loopback(name) or name in self.names

    def problem(self, method: str, headers: dict[str, str]) -> tuple[int, str] | None:
        """(status, message) when the request must not be answered, else None."""
        fix = (
            f"this server answers names {', '.join(self.names)}; if this is a name of your server, start "
            f"it with {self.flag}"
        )
        host = headers.get("host", "")
        if _name(self.bound) not in WILDCARDS and not self.allows(_name(host)):
            return 403, (
                f"Host: {host[:80]!r} is not a name of this server (a web page may be reaching it "
                f"through DNS rebinding); {fix}"
            )
        origin = headers.get("origin")
        if origin is not None and not self._origin_ok(origin, host):
            return 403, (
                f"Origin: {origin[:80]!r}: a web page on another site may not call this server; {fix}"
            )
        kind = headers.get("content-type")
        if self.json_only and method == "POST" and kind is not None and not _is_json(kind):
            return 415, (
                f"Content-Type: {kind[:80]!r}; send the body as JSON with Content-Type: application/json "
                "(other types are what a web page on another site can send without asking first)"
            )
        return None

    def _origin_ok(self, origin: str, host: str) -> bool:
        """A name this server answers, or the page's own origin on a wildcard bind (a browser on
        another machine opened the server by its address; the login it needs there guards it)."""
        parts = urlsplit(origin)
        if self.allows((parts.hostname or "").rstrip(".")):
            return True
        return _name(self.bound) in WILDCARDS and parts.netloc.lower() == host.strip().lower() != ""


def _is_json(content_type: str) -> bool:
    kind = content_type.partition(";")[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


class Guard:
    """ASGI middleware: answers a request that `policy.problem` names with a JSON 403 / 415."""

    def __init__(self, app: Any, policy: HostPolicy):
        self.app, self.policy = app, policy

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http":
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            problem = self.policy.problem(scope["method"], headers)
            if problem is not None:
                from starlette.responses import JSONResponse

                status, message = problem
                await JSONResponse(error_body(message, "invalid_request_error"), status)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class Throttle:
    """Failed API-key attempts per client address: `attempts` within `window` seconds lock it out
    until the window (which starts at its first failure) ends."""

    def __init__(self, attempts: int = 10, window: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self.attempts, self.window, self.clock = attempts, window, clock
        self.failures: dict[str, tuple[float, int]] = {}

    def locked(self, who: str) -> int | None:
        """Seconds until `who` may try again, or None when it may now."""
        start, count = self.failures.get(who, (0.0, 0))
        left = start + self.window - self.clock()
        if left <= 0:
            self.failures.pop(who, None)
            return None
        return max(1, int(left + 0.999)) if count >= self.attempts else None

    def failed(self, who: str) -> None:
        now = self.clock()
        if len(self.failures) > 4096:  # many addresses: forget those whose window is over
            self.failures = {k: v for k, v in self.failures.items() if v[0] + self.window > now}
        start, count = self.failures.get(who, (now, 0))
        self.failures[who] = (start, count + 1) if start + self.window > now else (now, 1)


@functools.cache
def deadline_protocol(seconds: float) -> type:
    """uvicorn's h11 protocol with a deadline on each request's headers (see the module docstring)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class DeadlineH11Protocol(H11Protocol):
        head_timer: Any = None

        def _arm(self) -> None:
            if self.head_timer is not None:
                self.head_timer.cancel()
            self.head_timer = self.loop.call_later(seconds, self._head_deadline)

        def _head_deadline(self) -> None:
            waiting = self.cycle is None or self.cycle.response_complete
            if waiting and not self.transport.is_closing():
                self.logger.info("closing a connection whose request headers did not arrive in %s s", seconds)
                self.transport.close()

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            self._arm()  # the next request's headers get the same time
            super().on_response_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            if self.head_timer is not None:
                self.head_timer.cancel()
            super().connection_lost(exc)

    return DeadlineH11Protocol
