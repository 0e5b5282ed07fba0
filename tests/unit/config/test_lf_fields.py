"""Every LLaMA-Factory field is known (issue 17): implemented in the schema, accepted at LF's default,
or refused as not available; never "unknown field", never a suggestion pointing at another feature.

LF_FIELDS.md here is a copy of ../shared/LF_FIELDS.md (the LF field contract, LF at ff6d4d1)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lmstack.config.errors import ConfigError
from lmstack.config.lf_fields import DEFAULT, LF_FIELDS, REFUSED
from lmstack.config.load import build_config, load_config
from lmstack.config.schema import field_owner

BASE = {"model_name_or_path": "m", "output_dir": "o"}
REFERENCE = Path(__file__).with_name("LF_FIELDS.md")
# another developer implements these as schema fields (issue 17): oft_* and module_dropout are all of
# LF_FIELDS §3.3 but the two keys shared with LoRA (additional_target, create_new_adapter)
BEING_IMPLEMENTED = {
    "oft_rank", "oft_block_size", "oft_target", "module_dropout", "use_dft_loss", "use_eaft_loss",
    "eaft_alpha", "use_asft_loss", "asft_alpha", "use_adam_mini", "use_llama_pro", "do_predict",
    "predict_with_generate", "run_name", "gradient_checkpointing_kwargs",
}  # fmt: skip
ROW = re.compile(r"^\| `([^`]+)`(?: / `([^`]+)`)? \|([^|]*)\|([^|]*)\|")


def reference_rows() -> dict[str, tuple[int, str]]:
    """name -> (section number, the row's third column) for every field row of §1-§6."""
    rows: dict[str, tuple[int, str]] = {}
    section = 0
    for line in REFERENCE.read_text(encoding="utf-8").splitlines():
        heading = re.match(r"^## (\d+)\.", line)
        if heading:
            section = int(heading.group(1))
        match = ROW.match(line) if 1 <= section <= 6 else None
        if match:
            for name in filter(None, match.group(1, 2)):
                rows.setdefault(name, (section, match.group(4).strip()))
    return rows


def parse_default(text: str) -> object:
    """LF_FIELDS.md's default column -> a Python value; `...` when it is not a plain value."""
    if text.startswith('"'):
        return text.split('"')[1]
    word = text.split(" ")[0]
    if word in ("None", "True", "False"):
        return {"None": None, "True": True, "False": False}[word]
    try:
        return int(word)
    except ValueError:
        try:
            return float(word)
        except ValueError:
            return ...


def test_every_lf_field_in_the_reference_is_known():
    rows = reference_rows()
    assert len(rows) > 300  # the parser really read the tables (§1-§6)
    owners = field_owner()
    unknown = [n for n in rows if n not in owners and n not in LF_FIELDS and n not in BEING_IMPLEMENTED]
    assert unknown == []


def test_the_table_holds_only_names_the_schema_lacks_and_valid_kinds():
    assert not set(LF_FIELDS) & set(field_owner())
    assert not set(LF_FIELDS) & BEING_IMPLEMENTED
    assert {e.kind for e in LF_FIELDS.values()} == {DEFAULT, REFUSED}
    assert all(e.feature and not e.feature.endswith(".") for e in LF_FIELDS.values())


def test_table_defaults_are_lf_defaults():
    """For LF's own dataclasses (§1-§5) the default in the table is the one LF_FIELDS.md gives."""
    wrong = {}
    for name, (section, column) in reference_rows().items():
        value = parse_default(column)
        if section <= 5 and name in LF_FIELDS and value is not ...:
            if LF_FIELDS[name].lf_default != value or type(LF_FIELDS[name].lf_default) is not type(value):
                wrong[name] = (LF_FIELDS[name].lf_default, value)
    assert wrong == {}


def _other_value(default: object) -> object:
    if isinstance(default, bool):
        return not default
    if isinstance(default, int | float):
        return default + 3
    if default is None:
        return "something"
    return "something-else"


@pytest.mark.parametrize("name", sorted(n for n, e in LF_FIELDS.items() if e.kind == DEFAULT))
def test_default_fields_accept_lf_default_and_refuse_other_values_by_name(name):
    entry = LF_FIELDS[name]
    build_config({**BASE, name: entry.lf_default})  # accepted: what lmstack does
    other = _other_value(entry.lf_default)
    with pytest.raises(ConfigError) as err:
        build_config({**BASE, name: other})
    msg = str(err.value)
    assert msg.startswith(f"{name}: LLaMA-Factory's `{name}: ")
    assert f"({entry.feature}) is not available in lmstack; remove it" in msg
    assert "unknown field" not in msg and "did you mean" not in msg
    if "token" not in name and "secret" not in name:
        shown = str(other).lower() if isinstance(other, bool) else str(other)
        assert f"`{name}: {shown}`" in msg


@pytest.mark.parametrize("name", sorted(n for n, e in LF_FIELDS.items() if e.kind == REFUSED))
def test_refused_fields_are_refused_at_any_value_with_the_not_available_message(name):
    entry = LF_FIELDS[name]
    for value in (entry.lf_default, _other_value(entry.lf_default)):
        with pytest.raises(ConfigError) as err:
            build_config({**BASE, name: value})
        msg = str(err.value)
        assert msg.startswith(
            f"{name}: LLaMA-Factory's `{name}` ({entry.feature}) is not available in lmstack; remove it"
        )
        assert "unknown field" not in msg and "did you mean" not in msg


def test_issue_examples_get_the_not_available_message_not_a_wrong_suggestion():
    """`mixed_precision` was "did you mean 'model_revision'?", `kt_config` 'kto_chosen_weight'."""
    with pytest.raises(ConfigError) as err:
        build_config({**BASE, "mixed_precision": "bf16_mixed", "kt_config": {"kt_backend": "x"}})
    lines = str(err.value).splitlines()
    assert lines[0].startswith("mixed_precision: LLaMA-Factory's `mixed_precision` (the Megatron Bridge")
    assert lines[1].startswith("kt_config: LLaMA-Factory's `kt_config` (KTransformers")
    assert "did you mean" not in str(err.value)


def test_lf_defaults_from_lf_examples_load():
    cfg = build_config(
        {
            **BASE,
            "infer_backend": "huggingface",
            "export_legacy_format": False,
            "quantization_method": "bnb",
            "use_kv_cache": True,
            "use_swanlab": False,
            "enable_thinking": True,
        }
    )
    assert cfg.model.model_name_or_path == "m"


def test_typo_of_an_lf_name_gets_a_suggestion_from_lf_names():
    with pytest.raises(ConfigError, match=r"use_swanlb: unknown field \(did you mean 'use_swanlab'\?\)"):
        build_config({**BASE, "use_swanlb": True})
    with pytest.raises(ConfigError, match=r"infer_backnd: unknown field \(did you mean 'infer_backend'\?\)"):
        build_config({**BASE, "infer_backnd": "huggingface"})


def test_a_name_neither_lmstack_nor_lf_knows_is_unknown():
    with pytest.raises(ConfigError, match=r"^zzz_option: unknown field; `lmstack train --help` lists them$"):
        build_config({**BASE, "zzz_option": 1})


def test_secret_values_are_not_quoted():
    with pytest.raises(ConfigError) as err:
        build_config({**BASE, "ms_hub_token": "ms-secret-value-123", "swanlab_api_key": "k-secret-456"})
    assert "ms-secret-value-123" not in str(err.value) and "k-secret-456" not in str(err.value)
    assert "`ms_hub_token: ***`" in str(err.value)


V1_YAML = """\
model: Qwen/Qwen3-4B
model_class: llm
peft_config:
  name: lora
  r: 16
dist_config:
  name: fsdp2
train_dataset: data/v1_sft_demo.yaml
output_dir: ./outputs/test_lora
micro_batch_size: 1
learning_rate: 1.0e-4
"""


def test_lf_v1_config_is_recognised_and_refused_as_such(tmp_path):
    path = tmp_path / "v1.yaml"
    path.write_text(V1_YAML)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    msg = str(err.value)
    assert msg.startswith("`model:`, `model_class:`, `peft_config:`, `dist_config:`")
    assert "LLaMA-Factory's v1 config" in msg and "lmstack reads LF's flat v0 YAML" in msg
    assert "model_name_or_path" in msg and "unknown field" not in msg


def test_a_nested_section_is_refused_as_not_flat():
    with pytest.raises(ConfigError, match=r"^`data:`: this looks like LLaMA-Factory's v1 config .* flat v0"):
        build_config({**BASE, "data": {"dataset": "alpaca_en_demo"}})


def test_every_problem_is_listed_at_once():
    with pytest.raises(ConfigError) as err:
        build_config(
            {
                **BASE,
                "kt_weight_path": "w",
                "lerning_rate": 1e-4,
                "finetuning_type": "lroa",
                "cutoff_len": -1,
                "top_p": 2.0,
            }
        )
    lines = str(err.value).splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "kt_weight_path", "lerning_rate", "cutoff_len", "finetuning_type", "top_p",
    ]  # fmt: skip
