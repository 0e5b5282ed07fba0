"""The JSON state machine and the token masks of `response_format: json_object`: what it accepts is
exactly what can still become one JSON object, and a walk of random allowed tokens of the tiny
model's real tokenizer ends in an object `json.loads` reads, within any max_tokens >= 2."""

from __future__ import annotations

import json
import random

import pytest

from lmstack.infer.json_mode import START, JsonVocab, distance, feed, is_done


@pytest.mark.parametrize(
    "text",
    [
        '{"a": 1}',
        '{"a":[1,-2.5e+3,true,false,null,{"b":"\\u00e9\\n"}],"c":{}}',
        "{}",
        '{"k":"v"}',
        '{"x":0.5}',
    ],
)
def test_complete_objects_are_done(text):
    state = feed(START, text.replace(": ", ":"))
    assert state is not None and is_done(state) and distance(state) == 0


@pytest.mark.parametrize(
    "text", ["[1]", '"a"', "1", '{"a" 1}', "{a:1}", '{"a":01}', '{"a":1,}', "{}}", '{"a":"\x01"}', " {}"]
)
def test_what_cannot_become_an_object_is_refused(text):
    assert feed(START, text) is None


@pytest.mark.parametrize(
    "prefix, closing",
    [
        ('{"a":tru', "e}"),
        ('{"a":[1,{"b":"x', '"}]}'),
        ('{"', '":0}'),
        ('{"a":-', "0}"),
        ('{"a":"\\u00', '00"}'),
    ],
)
def test_distance_is_the_shortest_completion(prefix, closing):
    state = feed(START, prefix)
    assert distance(state) == len(closing)
    assert is_done(feed(state, closing))


@pytest.fixture(scope="module")
def vocab(tiny_tokenizer):
    return JsonVocab(tiny_tokenizer)


@pytest.mark.parametrize("max_tokens", [2, 3, 5, 12, 40])
def test_random_walks_of_allowed_tokens_end_in_a_json_object(vocab, tiny_tokenizer, max_tokens):
    rng = random.Random(max_tokens)
    for _ in range(20):
        state, ids = START, []
        while len(ids) < max_tokens and not is_done(state):
            allowed = vocab.allowed(state, max_tokens - len(ids) - 1).nonzero().flatten().tolist()
            token = rng.choice(allowed)
            ids.append(token)
            state = feed(state, vocab.texts[token])
        text = tiny_tokenizer.decode(ids)
        assert isinstance(json.loads(text), dict), text
        assert "".join(vocab.texts[t] for t in ids) == text  # token texts read as the decoded reply
