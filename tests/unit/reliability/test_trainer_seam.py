"""The private transformers/TRL hooks lmstack overrides (reliability/seam.HOOKS) still exist in the
installed libraries with the parameters lmstack relies on; an upgrade that renames or re-signatures
one fails here, not silently (a renamed hook is never called) or mid-run."""

from __future__ import annotations

import inspect
import os

import pytest

from lmstack.reliability.seam import HOOKS, Hook, resolve

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def _params(func) -> list[inspect.Parameter]:
    return [p for p in inspect.signature(func).parameters.values() if p.name != "self"]


def _positional(params: list[inspect.Parameter]) -> list[str]:
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in params if p.kind in kinds]


def _lmstack_class(hook: Hook) -> type:
    owner = resolve(hook.overridden_by)
    return owner if isinstance(owner, type) else owner(resolve(hook.library))  # a class factory


@pytest.mark.parametrize("hook", HOOKS, ids=lambda h: f"{h.library.split(':')[1]}.{h.method}")
def test_the_installed_library_still_has_the_hook(hook):
    library = resolve(hook.library)
    method = getattr(library, hook.method, None)
    if method is None and hook.optional:
        pytest.skip(f"{hook.library}.{hook.method} is absent and lmstack works without it")
    assert callable(method), f"{hook.library} has no {hook.method}: lmstack's override would never run"
    params = _params(method)
    assert _positional(params)[: len(hook.params)] == list(hook.params), (hook, inspect.signature(method))
    if hook.exact:  # the library calls the override with its own arguments: no new one may appear
        assert [p.name for p in params] == list(hook.params), (hook, inspect.signature(method))


@pytest.mark.parametrize("hook", HOOKS, ids=lambda h: f"{h.overridden_by.split(':')[1]}.{h.method}")
def test_lmstack_overrides_what_the_registry_says(hook):
    cls = _lmstack_class(hook)
    own = [c for c in cls.__mro__ if hook.method in vars(c) and c.__module__.startswith("lmstack.")]
    assert own, f"{hook.overridden_by} does not override {hook.method}: the entry is stale"
    params = _params(vars(own[0])[hook.method])
    assert _positional(params)[: len(hook.params)] == list(hook.params)
    if hook.exact:
        assert [p.name for p in params] == list(hook.params)


def test_every_private_override_is_registered():
    registered = {(h.overridden_by, h.method) for h in HOOKS}
    for path in {h.overridden_by for h in HOOKS}:
        owner = resolve(path)
        if not isinstance(owner, type):
            continue
        for name, value in vars(owner).items():
            private = name.startswith("_") and not name.startswith(("__", "_lm_")) and callable(value)
            if private:
                assert (path, name) in registered, f"{path}.{name} overrides a private hook not in seam.HOOKS"
