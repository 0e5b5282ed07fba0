"""`lmstack api` honours LLaMA-Factory's API_HOST / API_PORT; command-line flags win."""

import pytest

from lmstack.cli.api import bind_address
from lmstack.config.errors import ConfigError


def test_env_is_honoured_and_flags_win():
    env = {"API_HOST": "::1", "API_PORT": "9001"}
    assert bind_address(None, None, {}) == ("127.0.0.1", 8000)
    assert bind_address(None, None, env) == ("::1", 9001)
    assert bind_address("127.0.0.2", 0, env) == ("127.0.0.2", 0)
    with pytest.raises(ConfigError, match="API_PORT: got 'x'"):
        bind_address(None, None, {"API_PORT": "x"})
