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


def _lmstack_modules() -> list[str]:
    """Every module of lmstack that can define a trainer (all but the UI/API front ends, whose imports
    need gradio/fastapi and which subclass no Trainer, and the `python -m` entry, which runs the CLI)."""
    import pkgutil

    import lmstack

    skip = ("lmstack.webui", "lmstack.infer.server")
    names = [m.name for m in pkgutil.walk_packages(lmstack.__path__, "lmstack.")]
    return sorted(n for n in names if not n.startswith(skip) and not n.endswith(".__main__"))


def _lmstack_trainers() -> list[type]:
    """Every transformers.Trainer subclass defined in lmstack (TRL's trainers are Trainer subclasses)."""
    import importlib

    from transformers import Trainer

    for name in _lmstack_modules():
        importlib.import_module(name)
    found, todo = [], [Trainer]
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            if sub.__module__.startswith("lmstack.") and sub not in found:
                found.append(sub)
    return found


def _private_overrides(trainer: type) -> set[tuple[str, str]]:
    """(lmstack class path, method) for each private method an lmstack class in `trainer`'s MRO defines
    that a transformers/TRL class further down the MRO defines too."""
    library = [c for c in trainer.__mro__ if not c.__module__.startswith("lmstack.")]
    out = set()
    for cls in trainer.__mro__:
        if not cls.__module__.startswith("lmstack."):
            continue
        for name, value in vars(cls).items():
            private = name.startswith("_") and not name.startswith("__") and callable(value)
            if private and any(name in vars(base) for base in library):
                out.add((f"{cls.__module__}:{cls.__qualname__}", name))
    return out


def test_every_private_override_is_registered():
    """Each lmstack trainer's override of a transformers/TRL private method is in seam.HOOKS, so the
    tests above check it against the installed libraries."""
    registered = {(h.overridden_by, h.method) for h in HOOKS}
    trainers = _lmstack_trainers()
    assert len(trainers) >= 10, [t.__name__ for t in trainers]  # the discovery itself works
    missing = {o for t in trainers for o in _private_overrides(t)} - registered
    assert not missing, f"private transformers/TRL hooks overridden but not in seam.HOOKS: {sorted(missing)}"


def test_the_discovery_sees_the_rollout_override():
    """The completeness check above would catch an unregistered override: it finds this one."""
    from lmstack.train.grpo import TemplatePromptGRPOTrainer

    found = _private_overrides(TemplatePromptGRPOTrainer)
    assert ("lmstack.train.rollout_engine:FastRollouts", "_generate_single_turn") in found
    assert ("lmstack.train.grpo:_TemplatePrompts", "_tokenize_prompts") in found
