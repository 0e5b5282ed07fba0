import pytest

from lmstack.data.encode import IGNORE_INDEX, DropExample, EncodeOptions, encode_supervised, infer_seqlen
from lmstack.data.formats import RecordError, convert
from lmstack.data.registry import COLUMN_DEFAULTS, TAG_DEFAULTS, DatasetAttr
from lmstack.templates import get_template


def alpaca_attr(**kw):
    return DatasetAttr(
        name="t",
        load_from="file",
        source="x",
        formatting="alpaca",
        columns={
            "prompt": "instruction",
            "query": "input",
            "response": "output",
            "system": "system",
            "history": "history",
        },
        tags=dict(TAG_DEFAULTS),
        **kw,
    )


def test_infer_seqlen_rules():
    assert infer_seqlen(10, 20, 100) == (10, 20)  # everything fits
    assert infer_seqlen(300, 20, 100) == (80, 20)  # short target kept whole, source cut
    assert infer_seqlen(20, 300, 100) == (20, 80)  # short source kept whole, target cut
    assert infer_seqlen(300, 100, 100) == (75, 25)  # proportional split


def test_alpaca_conversion_joins_input_and_history():
    ex = convert(
        {"instruction": "Translate", "input": "你好", "output": "Hello", "history": [["q", "a"]]},
        alpaca_attr(),
    )
    assert [m["role"] for m in ex["prompt"]] == ["user", "assistant", "user"]
    assert ex["prompt"][-1]["content"] == "Translate\n你好"
    assert ex["response"] == [{"role": "assistant", "content": "Hello"}]


@pytest.mark.parametrize(
    "record,field,reason",
    [
        ({"input": "", "output": "x"}, "instruction", "missing field"),
        ({"instruction": ["a"], "output": "x"}, "instruction", "must be a string, got list"),
        ({"instruction": "a", "output": "x", "history": [["only one"]]}, "history[0]", "pair"),
    ],
)
def test_alpaca_record_errors_name_the_field(record, field, reason):
    with pytest.raises(RecordError) as err:
        convert(record, alpaca_attr())
    assert err.value.field == field and reason in err.value.reason


def test_labels_mask_exactly_the_prompt(tiny_tokenizer):
    template = get_template("qwen")
    ex = convert({"instruction": "hi", "input": "", "output": "hello there"}, alpaca_attr())
    opts = EncodeOptions(stage="sft", cutoff_len=512)
    sample, truncated = encode_supervised(ex, tiny_tokenizer, template, opts)
    assert not truncated
    prompt = (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    answer = "hello there<|im_end|>\n"
    p_ids = tiny_tokenizer.encode(prompt, add_special_tokens=False)
    a_ids = tiny_tokenizer.encode(answer, add_special_tokens=False)
    assert sample["input_ids"] == p_ids + a_ids
    assert sample["labels"] == [IGNORE_INDEX] * len(p_ids) + a_ids
    assert tiny_tokenizer.convert_tokens_to_ids("<|im_end|>") in [t for t in sample["labels"] if t != -100]


def test_every_assistant_turn_is_trained_and_train_on_prompt(tiny_tokenizer):
    template = get_template("qwen")
    ex = convert({"instruction": "q2", "output": "a2", "history": [["q1", "a1"]]}, alpaca_attr())
    sample, _ = encode_supervised(ex, tiny_tokenizer, template, EncodeOptions(stage="sft", cutoff_len=512))
    trained = tiny_tokenizer.decode([t for t in sample["labels"] if t != IGNORE_INDEX])
    assert trained == "a1<|im_end|>\na2<|im_end|>\n"
    sample, _ = encode_supervised(
        ex, tiny_tokenizer, template, EncodeOptions(stage="sft", cutoff_len=512, train_on_prompt=True)
    )
    assert sample["labels"] == sample["input_ids"]
    sample, _ = encode_supervised(
        ex, tiny_tokenizer, template, EncodeOptions(stage="sft", cutoff_len=512, mask_history=True)
    )
    assert tiny_tokenizer.decode([t for t in sample["labels"] if t != IGNORE_INDEX]) == "a2<|im_end|>\n"


def test_truncation_is_reported_and_zero_label_examples_dropped(tiny_tokenizer):
    template = get_template("qwen")
    ex = convert({"instruction": "word " * 200, "output": "short answer"}, alpaca_attr())
    sample, truncated = encode_supervised(
        ex, tiny_tokenizer, template, EncodeOptions(stage="sft", cutoff_len=64)
    )
    assert truncated and len(sample["input_ids"]) == 64
    ex = convert({"instruction": "hi", "output": "   "}, alpaca_attr())
    with pytest.raises(DropExample, match="empty response"):
        encode_supervised(ex, tiny_tokenizer, template, EncodeOptions(stage="sft", cutoff_len=64))


def test_column_defaults_cover_lf_keys():
    for key in (
        "prompt",
        "query",
        "response",
        "history",
        "messages",
        "system",
        "tools",
        "chosen",
        "rejected",
        "kto_tag",
    ):
        assert key in COLUMN_DEFAULTS


def test_the_encoder_modules_form_no_import_circle():
    """encode.py imports encode_pref.py for ENCODERS; encode_pref.py must not import encode.py back
    (not even inside a function): both take the shared pieces from encode_common.py."""
    import ast
    from pathlib import Path

    import lmstack.data as data_pkg

    folder = Path(data_pkg.__file__).parent
    graph = {}
    for path in folder.glob("encode*.py"):
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "lmstack.data":
                imported |= {f"lmstack.data.{a.name}" for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module)
            elif isinstance(node, ast.Import):
                imported |= {a.name for a in node.names}
        graph[f"lmstack.data.{path.stem}"] = imported & {
            f"lmstack.data.{p.stem}" for p in folder.glob("*.py")
        }

    def reaches(start, goal, seen=()):
        return any(
            n == goal or (n not in seen and reaches(n, goal, (*seen, n))) for n in graph.get(start, ())
        )

    assert "lmstack.data.encode_pref" in graph["lmstack.data.encode"]
    assert [m for m in graph if reaches(m, m)] == []
