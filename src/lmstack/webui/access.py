"""Who may reach `lmstack webui` (`webui/app.py`): the API's Host / Origin rule (`infer/guard.py`:
loopback names, the bound address, `--allow-host`), so a web page on another site can neither read
the UI through DNS rebinding nor drive it cross-site; and a throttle on Gradio's login: after
`attempts` wrong passwords from one address within `window` seconds, its logins get 429 until the
window ends (Gradio answers a wrong login with 400 and does not slow guesses down)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lmstack.infer.guard import Guard, HostPolicy, Throttle, error_body

MIN_PASSWORD_CHARS = 12  # on an address other machines reach


class LoginThrottle:
    """ASGI middleware over Gradio's `POST /login`: counts its 400s per client address."""

    def __init__(self, app: Any, throttle: Throttle):
        self.app, self.throttle = app, throttle

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        login = (
            scope["type"] == "http" and scope["method"] == "POST" and scope["path"].rstrip("/") == "/login"
        )
        if not login:
            await self.app(scope, receive, send)
            return
        who = (scope.get("client") or ("",))[0]
        wait = self.throttle.locked(who)
        if wait is not None:
            from starlette.responses import JSONResponse

            message = f"too many wrong logins from {who}; retry after {wait} s"
            body = {**error_body(message, "authentication_error"), "detail": message}
            await JSONResponse(body, 429, {"Retry-After": str(wait)})(scope, receive, send)
            return

        async def counting(message: dict) -> None:
            if message["type"] == "http.response.start" and message["status"] == 400:
                self.throttle.failed(who)
            await send(message)

        await self.app(scope, receive, counting)


def middleware(host: str, allowed: tuple[str, ...], throttle: Throttle | None = None) -> list:
    """The FastAPI middleware list Gradio's app is built with (`launch(app_kwargs=...)`)."""
    from starlette.middleware import Middleware

    policy = HostPolicy(host, allowed, json_only=False, flag="lmstack webui --allow-host NAME")
    return [Middleware(Guard, policy=policy), Middleware(LoginThrottle, throttle=throttle or Throttle())]
