"""`lmstack api` on a tiny Qwen2-VL (built here): OpenAI `image_url` content parts (a data URL, a
file:// URL, an absolute path) are served with the prompt training builds for the same message and
image, and the reply equals `lmstack chat`'s (`/image PATH`); streamed, it comes as one chunk and
[DONE]; what an image request cannot be (a text-only model, a network URL, n > 1, ...) is a 400 that
names the part. The real `openai` client talks to a real server process."""

from __future__ import annotations

import base64
import json
import threading
from pathlib import Path

import httpx
import openai
import pytest
from test_api import start_api, stop_api

MODEL = "tiny-vl"
QUESTION = "What colour is this picture?"
DATA = Path(__file__).resolve().parents[2] / "data"


@pytest.fixture(scope="module")
def picture(tmp_path_factory) -> Path:
    """A one-record sharegpt dataset in LF's layout around a tiny PNG made here: (dataset_dir)."""
    from PIL import Image

    folder = tmp_path_factory.mktemp("pics")
    image = Image.new("RGB", (64, 48), (220, 30, 30))
    for x in range(0, 64, 8):  # a pattern, so the pixels are not one flat colour
        for y in range(48):
            image.putpixel((x, y), (20, 20, 200))
    image.save(folder / "red.png")
    record = {
        "messages": [
            {"role": "user", "content": "<image>" + QUESTION},
            {"role": "assistant", "content": "It is red."},
        ],
        "images": ["red.png"],
    }
    (folder / "pics.json").write_text(json.dumps([record]))
    tags = {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}
    entry = {"file_name": "pics.json", "formatting": "sharegpt", "tags": tags}
    entry["columns"] = {"messages": "messages", "images": "images"}
    (folder / "dataset_info.json").write_text(json.dumps({"pics": entry}))
    return folder


@pytest.fixture(scope="module")
def vlm_cfg(tmp_path_factory, picture) -> dict:
    from lmstack.tiny import build_tiny_vision_model

    model = build_tiny_vision_model(tmp_path_factory.mktemp("vlm") / "qwen2_vl", "qwen2_vl", data_dir=DATA)
    return {
        "model_name_or_path": str(model),
        "template": "qwen2_vl",
        "do_sample": False,
        "max_new_tokens": 6,
        "dataset_dir": str(picture),
    }


@pytest.fixture(scope="module")
def vlm_server(vlm_cfg, tmp_path_factory, picture):
    url, proc = start_api(
        tmp_path_factory.mktemp("vlm_api"), vlm_cfg, "--model-name", MODEL, "--image-dir", str(picture)
    )
    yield url
    stop_api(proc)


@pytest.fixture(scope="module")
def text_server(tiny_model, tmp_path_factory):
    cfg = {"model_name_or_path": str(tiny_model), "template": "qwen", "max_new_tokens": 4}
    url, proc = start_api(tmp_path_factory.mktemp("text_api"), cfg, "--model-name", MODEL)
    yield url
    stop_api(proc)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)


def data_url(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def image_message(url: str, text: str = QUESTION) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]
    return [{"role": "user", "content": parts}]


def test_an_image_request_gets_the_training_prompt_and_the_chat_reply(vlm_cfg, vlm_server, picture, base_cfg):
    from lmstack.config.load import build_config
    from lmstack.data.pipeline import build_datasets
    from lmstack.infer.engine import ChatEngine, load_infer_config
    from lmstack.infer.vision import session_for

    engine = ChatEngine.from_config(load_infer_config(None, vlm_cfg))
    chat = session_for(engine)  # what `lmstack chat` runs for a vision model
    (note,) = chat.send(f"/image {picture / 'red.png'}")
    assert note.startswith("[image 1 attached")
    (expected,) = chat.send(QUESTION)
    assert expected

    train_cfg = build_config({**base_cfg, **vlm_cfg, "dataset": "pics", "cutoff_len": 256})
    sample = build_datasets(train_cfg, engine.tokenizer, engine.template).train[0]
    prompt_len = next(i for i, label in enumerate(sample["labels"]) if label != -100)
    image_tokens = sample["input_ids"][:prompt_len].count(
        engine.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    )
    assert image_tokens > 0

    api = client(vlm_server)
    path = picture / "red.png"
    for url in (data_url(path), f"file://{path}", str(path)):
        reply = api.chat.completions.create(model=MODEL, messages=image_message(url))
        assert reply.choices[0].message.content == expected, url
        assert reply.usage.prompt_tokens == prompt_len  # the vision tokens exactly as training writes them
        assert reply.choices[0].finish_reason in ("stop", "length")

    # the image is read: another picture, another prompt (its own number of vision tokens)
    from PIL import Image

    Image.new("RGB", (128, 96), (30, 200, 60)).save(picture / "green.png")
    other = api.chat.completions.create(model=MODEL, messages=image_message(str(picture / "green.png")))
    assert other.usage.prompt_tokens > prompt_len

    # streamed: the whole reply in one content chunk, then the finish chunk and [DONE]
    body = {"model": MODEL, "messages": image_message(data_url(path)), "stream": True}
    with httpx.stream("POST", f"{vlm_server}/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0]["role"] == "assistant"
    assert [d["content"] for d in deltas if d.get("content")] == [expected]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    streamed = api.chat.completions.create(model=MODEL, messages=image_message(str(path)), stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected


def test_image_and_text_requests_at_once_each_get_their_answer_served_alone(vlm_server, picture):
    api = client(vlm_server)
    text = [{"role": "user", "content": [{"type": "text", "text": "Hello there"}]}]
    image = image_message(str(picture / "red.png"))
    alone = [
        api.chat.completions.create(model=MODEL, messages=m).choices[0].message.content for m in (text, image)
    ]
    together: dict[int, str] = {}

    def ask(i: int, messages: list[dict]) -> None:
        together[i] = api.chat.completions.create(model=MODEL, messages=messages).choices[0].message.content

    threads = [threading.Thread(target=ask, args=(i, m)) for i, m in enumerate((text, image, text, image))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert [together[i] for i in range(4)] == alone * 2


def refusal(url: str, messages: list[dict], **extra) -> str:
    with pytest.raises(openai.BadRequestError) as err:
        client(url).chat.completions.create(model=MODEL, messages=messages, **extra)
    assert err.value.status_code == 400
    return err.value.body["message"]


def test_a_text_only_model_refuses_image_parts_by_position(text_server, picture):
    parts = [
        {"type": "text", "text": QUESTION},
        {"type": "image_url", "image_url": {"url": data_url(picture / "red.png")}},
    ]
    message = refusal(text_server, [{"role": "user", "content": parts}])
    assert (
        message == "messages[0].content[1]: image_url needs a vision-language model; this model is text-only"
    )


@pytest.mark.parametrize(
    "url, extra, expected",
    [
        ("https://example.com/cat.png", {}, "messages[0].content[0].image_url.url: 'https://example.com/cat.png': "
         "this server reads no network (it runs offline); send the image as a data URL"),
        ("red.png", {}, "messages[0].content[0].image_url.url: 'red.png': a file on the server must be given by "
         "its absolute path"),
        ("MISSING", {}, "messages[0].content[0]: image: "),
        ("/etc/passwd", {}, "messages[0].content[0]: '/etc/passwd': this server reads image files only inside the "
         "folders given with `lmstack api --image-dir DIR`"),
        ("OUTSIDE", {}, "messages[0].content[0]: "),
        ("data:image/png;base64,bm90IGEgcGljdHVyZQ==", {}, "messages[0].content[0]: image_url: the data URL "
         "holds no image that PIL reads"),
        ("RED", {"n": 2}, "n: got 2; a request with images returns one choice (n: 1)"),
        ("RED", {"logprobs": True}, "logprobs: not supported in a request with images"),
        ("RED", {"response_format": {"type": "json_object"}}, "response_format: not supported in a request with"),
    ],
)  # fmt: skip
def test_image_requests_a_vision_model_cannot_serve_are_400s_naming_the_part(
    vlm_server, picture, url, extra, expected
):
    named = {
        "RED": picture / "red.png",
        "MISSING": picture / "missing.png",
        "OUTSIDE": picture / ".." / "red.png",
    }
    url = str(named[url]) if url in named else url
    said = refusal(vlm_server, image_message(url), **extra)
    assert said.startswith(expected), said
    if url.endswith("missing.png"):
        assert said.endswith("no such file")
    if "/../" in url:  # `..` resolves outside the allowed folder: refused before the file is looked at
        assert "only inside the folders given with `lmstack api --image-dir DIR`" in said


def test_an_image_outside_a_user_message_is_refused(vlm_server, picture):
    system = {
        "role": "system",
        "content": [{"type": "image_url", "image_url": {"url": str(picture / "red.png")}}],
    }
    message = refusal(vlm_server, [system, {"role": "user", "content": QUESTION}])
    assert message == "messages[0].content[0]: image_url is allowed in user messages only (got 'system')"


@pytest.fixture(scope="module")
def qwen3_vl_cfg(tmp_path_factory, picture) -> dict:
    from lmstack.tiny import build_tiny_vision_model

    model = build_tiny_vision_model(tmp_path_factory.mktemp("vlm3") / "qwen3_vl", "qwen3_vl", data_dir=DATA)
    return {
        "model_name_or_path": str(model),
        "template": "qwen3_vl_nothink",
        "do_sample": False,
        "max_new_tokens": 6,
        "dataset_dir": str(picture),
    }


def test_a_qwen3_vl_image_request_gets_the_training_prompt_and_the_chat_reply(
    qwen3_vl_cfg, picture, base_cfg, tmp_path
):
    """Qwen3-VL (its rope index needs mm_token_type_ids at generation too): the API's prompt is the
    training prompt of the same record, token for token in count, and its reply is `lmstack chat`'s."""
    from lmstack.config.load import build_config
    from lmstack.data.pipeline import build_datasets
    from lmstack.infer.engine import ChatEngine, load_infer_config
    from lmstack.infer.vision import session_for

    engine = ChatEngine.from_config(load_infer_config(None, qwen3_vl_cfg))
    chat = session_for(engine)
    (note,) = chat.send(f"/image {picture / 'red.png'}")
    assert note.startswith("[image 1 attached")
    (expected,) = chat.send(QUESTION)
    assert chat.images  # the reply saw the picture
    train_cfg = build_config({**base_cfg, **qwen3_vl_cfg, "dataset": "pics", "cutoff_len": 256})
    sample = build_datasets(train_cfg, engine.tokenizer, engine.template).train[0]
    prompt_len = next(i for i, label in enumerate(sample["labels"]) if label != -100)
    pads = sample["input_ids"][:prompt_len].count(engine.tokenizer.convert_tokens_to_ids("<|image_pad|>"))
    assert pads == 4  # 64x48 -> 64x64 (32-pixel units, the tiny processor's minimum) = 4 x 4 patches / 2^2

    url, proc = start_api(tmp_path, qwen3_vl_cfg, "--model-name", MODEL, "--image-dir", str(picture))
    try:
        reply = client(url).chat.completions.create(
            model=MODEL, messages=image_message(data_url(picture / "red.png"))
        )
    finally:
        stop_api(proc)
    assert reply.usage.prompt_tokens == prompt_len
    assert reply.choices[0].message.content == expected
