"""Multi-turn tool-use rollouts for stage grpo (`tool_funcs`): the model answers in the template's tool-call
format, lmstack calls the user's Python function with the parsed arguments, appends its answer as the
template's observation turn, and the model continues, up to `max_tool_calling_iterations` calls or
max_new_tokens. The tool answers (and the template text around them) are masked from the loss.

Built on TRL 1.16's `rollout_func` hook of GRPOTrainer, which takes prompt ids, completion ids and an
`env_mask` (1 = the model's token, 0 = inserted) and treats the mask as its tool mask (trl/trainer/
grpo_trainer.py: `tool_mask = extra_fields.pop("env_mask")`, then `mask = completion_mask * tool_mask` in
the loss). TRL's own `tools=` loop is not used: it needs conversational prompts rendered by the
tokenizer's chat template and a response schema for it, while lmstack's prompts are its templates'
rendering; the tool-call format here is the template's (`tool_format`), the same the data encodes and
`lmstack api` parses.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from lmstack.infer.toolcalls import parse_tool_calls
from lmstack.templates.slots import apply, to_ids

logger = logging.getLogger(__name__)


class ToolRollout:
    """A TRL rollout_func: (prompts, trainer) -> {prompt_ids, completion_ids, logprobs, env_mask}."""

    def __init__(
        self,
        template: Any,
        tokenizer: Any,
        tools: dict[str, Callable],
        max_iterations: int | None,
        max_completion_length: int,
    ):
        self.template, self.tokenizer, self.tools = template, tokenizer, tools
        self.max_iterations, self.max_len = max_iterations, max_completion_length
        self.calls = self.failures = 0
        # the template's answer turn after the model's stop token (qwen: the "\n" after <|im_end|>): the model
        # stops generating at the stop token, the template's turn goes on to the next turn's start
        stop = set(template.stop_token_ids(tokenizer))
        turn = to_ids(tokenizer, apply(template.format_assistant, "x"))
        at = max((i for i, t in enumerate(turn) if t in stop), default=len(turn) - 1)
        self.turn_tail = list(turn[at + 1 :])

    def observation_ids(self, results: list[str]) -> list[int]:
        """The observation turn(s) with the tool answers, ending in the assistant opener."""
        slot = self.template.format_observation or self.template.format_user
        return self.turn_tail + list(to_ids(self.tokenizer, apply(slot, "\n".join(results))))

    def call(self, name: str, arguments: Any) -> str:
        self.calls += 1
        func = self.tools.get(name)
        if func is None:
            self.failures += 1
            return f"error: no tool named {name!r} (tools: {', '.join(self.tools)})"
        try:
            result = func(**arguments) if isinstance(arguments, dict) else func(arguments)
        except Exception as err:  # noqa: BLE001 - the model made a bad call: it reads the error and goes on
            self.failures += 1
            return f"error: {type(err).__name__}: {err}"
        return result if isinstance(result, str) else json.dumps(result, ensure_ascii=False, default=str)

    def tool_results(self, ids: list[int]) -> list[str] | None:
        """The answers of the tool calls in one generated turn (None: the turn calls no tool)."""
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        try:
            _, calls = parse_tool_calls(self.template.tool_format, text)
        except (ValueError, KeyError, TypeError):
            return None
        return [self.call(name, args) for name, args in calls] or None

    def __call__(self, prompts: list[str], trainer: Any) -> dict[str, list]:
        # the sampler already repeats each prompt num_generations times: one rollout per prompt given
        prompt_ids = [
            list(ids) for ids in self.tokenizer(text=list(prompts), add_special_tokens=False)["input_ids"]
        ]
        calls_before, failures_before = self.calls, self.failures
        completions: list[list[int]] = [[] for _ in prompt_ids]
        masks: list[list[int]] = [[] for _ in prompt_ids]
        active, turn = list(range(len(prompt_ids))), 0
        while active:
            contexts = [prompt_ids[i] + completions[i] for i in active]
            generated, _ = trainer._generate_single_turn(contexts, None, {}, 1)
            still = []
            for i, ids in zip(active, generated):
                completions[i] += ids
                masks[i] += [1] * len(ids)
                limit = self.max_iterations is not None and turn >= self.max_iterations
                results = None if limit or len(completions[i]) >= self.max_len else self.tool_results(ids)
                if results is None:
                    continue
                inserted = self.observation_ids(results)
                completions[i] += inserted
                masks[i] += [0] * len(inserted)
                if len(completions[i]) < self.max_len:
                    still.append(i)
            active, turn = still, turn + 1
        mode = "train" if trainer.model.training else "eval"
        calls, failures = self.calls - calls_before, self.failures - failures_before
        trainer._metrics[mode]["tools/call_frequency"].append(calls / max(len(prompt_ids), 1))
        trainer._metrics[mode]["tools/failure_frequency"].append(failures / calls if calls else 0.0)
        completion_ids = [c[: self.max_len] for c in completions]
        env_mask = [m[: self.max_len] for m in masks]
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": completion_ids,
            "logprobs": None,
            "env_mask": env_mask,
        }
