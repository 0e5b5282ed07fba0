"""The bounds of one `lmstack api` server (its flags), the bind rule (a non-loopback address needs a key)
and which image files a request may name (split from infer/server.py)."""

import ipaddress
import socket
from dataclasses import dataclass
from pathlib import Path

from lmstack.config.errors import ConfigError
from lmstack.infer.openai_request import APIError

MIN_KEY_CHARS = 16


@dataclass(frozen=True)
class Limits:
    """Bounds of one server (`lmstack api` flags). `max_tokens` None: the YAML's `max_new_tokens`
    (which is also the default of a request's max_tokens)."""

    max_queue: int = 16  # requests that may wait while `max_batch` generate; one more gets a 503
    max_prompt_tokens: int = 8192
    max_tokens: int | None = None
    max_batch: int = 16  # sequences decoded together (the transformers backend's batch)
    image_dirs: tuple[str, ...] = ()  # folders whose image files a request may name (--image-dir)
    # tokens one request may ask to generate, summed over its sequences (prompts x n x max_tokens)
    max_request_tokens: int = 1 << 18
    read_timeout: float = 20.0  # seconds for a request's headers, and again for its body
    stall_timeout: float = 30.0  # seconds a stream's write may wait on a client that does not read
    allowed_hosts: tuple[str, ...] = ()  # more names for Host / Origin (--allow-host, "*": any)

    def check(self) -> None:
        for flag, value, low in (
            ("--max-queue", self.max_queue, 0),
            ("--max-prompt-tokens", self.max_prompt_tokens, 1),
            ("--max-tokens-limit", self.max_tokens, 1),
            ("--max-batch", self.max_batch, 1),
            ("--max-request-tokens", self.max_request_tokens, 1),
        ):
            if value is not None and value < low:
                raise ConfigError(f"{flag}: got {value}; give an integer of at least {low}")
        for flag, seconds in (("--read-timeout", self.read_timeout), ("--stall-timeout", self.stall_timeout)):
            if not 0 < seconds < float("inf"):
                raise ConfigError(f"{flag}: got {seconds}; give a number of seconds above 0")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, api_key: str | None) -> None:
    if is_loopback(host):
        return
    if not api_key:
        raise ConfigError(
            f"--host: {host} is reachable from other machines, so an API key is required; pass "
            "--api-key KEY or set API_KEY (clients send `Authorization: Bearer KEY`), or bind 127.0.0.1"
        )
    if len(api_key) < MIN_KEY_CHARS:
        raise ConfigError(
            f"--api-key: the key has {len(api_key)} characters; on {host}, reachable from other machines, "
            f"it needs at least {MIN_KEY_CHARS} (make one with: python -c 'import secrets; "
            "print(secrets.token_urlsafe(24))'), or bind 127.0.0.1"
        )


def readable_file(where: str, url: str, image_dirs: tuple[str, ...]) -> None:
    """A request may name a file on the server only inside a folder `lmstack api --image-dir` allowed:
    otherwise any client could make the server open (and so probe) any file its user can read. Checked
    on the resolved path (no `..` or link escapes), before the file is looked at."""
    path = Path(url.removeprefix("file://")).expanduser()
    if not path.is_absolute():
        return  # the request check names relative paths
    resolved = path.resolve()
    if any(resolved.is_relative_to(Path(d).resolve()) for d in image_dirs):
        return
    allowed = ", ".join(image_dirs) if image_dirs else "none (no --image-dir given)"
    raise APIError(
        400,
        f"{where}: {str(path)[:80]!r}: this server reads image files only inside the folders given with "
        f"`lmstack api --image-dir DIR` (now: {allowed}); send the image as a data: URL instead",
        param="messages",
    )


def bind_socket(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as err:
        raise ConfigError(
            f"--host/--port: cannot listen on {host}:{port} ({err}); try --port 0 for any free port"
        ) from None
    sock.listen(128)
    return sock
