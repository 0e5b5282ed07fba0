"""What LLaMA-Factory's API accepts, `lmstack api` accepts too (checked with the official `openai`
client against a real uvicorn on loopback), and malformed corners of a request get a clean 400."""

from __future__ import annotations

import openai
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
