"""What LLaMA-Factory's API accepts, `lmstack api` accepts too (checked with the official `openai`
client against a real uvicorn on loopback), and malformed corners of a request get a clean 400."""

from __future__ import annotations

import openai
import pytest
from fastapi.testclient import TestClient
from tests.unit.infer.test_server import LOCAL, FakeEngine, body, serving

from lmstack.infer.server import create_app


class TextEngine(FakeEngine):
    tokenizer = range(1000)  # len() is the vocabulary size that /v1/completions checks ids against


def client_for(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=10)


def test_any_model_name_is_served_and_echoed():
    engine = TextEngine(tick=0.001)
    with serving(engine) as port:
        reply = client_for(port).chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "hi"}]
        )
        assert reply.model == "gpt-4o" and reply.choices[0].message.content == "xxxx"
        done = client_for(port).completions.create(model="davinci", prompt="hi")
        assert done.model == "davinci"


def test_logit_bias_is_capped_at_openais_300_entries():
    client = TestClient(create_app(TextEngine(tick=0.001), "m"), base_url=LOCAL)
    bias = {str(i): 1.0 for i in range(301)}
    r = client.post("/v1/chat/completions", json=body("hi", logit_bias=bias))
    assert r.status_code == 400 and "logit_bias: 301 entries; at most 300" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "path, fields, message",
    [
        ("/v1/completions", {"prompt": ""}, "prompt: an empty string; give the text to complete"),
        ("/v1/completions", {"prompt": ["a", ""]}, "prompt: an empty string"),
        ("/v1/completions", {"prompt": [[]]}, "prompt: empty"),
        ("/v1/chat/completions", {"seed": 2**64}, "seed: Input should be less than or equal to"),
        ("/v1/chat/completions", {"seed": -(2**63) - 1}, "seed: Input should be greater than or equal to"),
    ],
)
def test_corner_values_are_a_4xx_naming_the_field_not_a_500(path, fields, message):
    client = TestClient(create_app(TextEngine(tick=0.001), "m"), base_url=LOCAL)
    base = (
        {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    )
    r = client.post(path, json={"model": "m", **base, **fields})
    assert r.status_code in (400, 422), r.text
    assert message in r.json()["error"]["message"]
    assert client.post(path, json={"model": "m", **base, "seed": 2**63 - 17}).status_code == 200


def test_a_lone_surrogate_is_a_400_not_a_500():
    client = TestClient(create_app(TextEngine(tick=0.001), "m"), base_url=LOCAL)
    raw = b'{"model": "m", "messages": [{"role": "user", "content": "hi \\ud800"}]}'
    r = client.post("/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    assert (
        r.json()["error"]["message"]
        == "request body: a string holds \\ud800, a lone surrogate; send valid Unicode"
    )
