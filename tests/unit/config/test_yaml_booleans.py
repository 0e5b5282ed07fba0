"""YAML 1.1 reads unquoted `no`/`off`/`yes`/`on` as booleans: `save_strategy: no` (as LLaMA-Factory
users write it) must mean the enum value "no", not a type error."""

from __future__ import annotations

import typing

import pytest
import yaml

from lmstack.config.errors import ConfigError
from lmstack.config.load import build_config, load_config
from lmstack.config.schema import SECTIONS

BASE = {"model_name_or_path": "m", "output_dir": "o"}


def test_unquoted_no_in_a_yaml_file_means_no(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model_name_or_path: m\noutput_dir: o\nsave_strategy: no\neval_strategy: No\n")
    assert yaml.safe_load(path.read_text())["save_strategy"] is False  # what YAML hands over
    cfg = load_config(path)
    assert cfg.training.save_strategy == "no" and cfg.training.eval_strategy == "no"
    assert cfg.flat()["save_strategy"] == "no"


def test_override_no_means_no(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model_name_or_path: m\noutput_dir: o\neval_strategy: steps\nsave_strategy: epoch\n")
    cfg = load_config(path, ["eval_strategy=no", "--save_strategy", "off"])
    assert cfg.training.eval_strategy == "no" and cfg.training.save_strategy == "no"


def test_saved_config_round_trips_the_string_no(tmp_path):
    from lmstack.config.load import save_config

    cfg = build_config({**BASE, "save_strategy": False})
    save_config(cfg, tmp_path / "saved.yaml")
    assert load_config(tmp_path / "saved.yaml").training.save_strategy == "no"


def test_true_is_still_refused_with_the_allowed_values():
    with pytest.raises(ConfigError) as err:
        build_config({**BASE, "save_strategy": True})
    msg = str(err.value)
    assert msg.startswith("save_strategy: got True; allowed: steps | epoch | no")
    assert "yes/no/on/off" in msg  # says why an unquoted word arrived as a boolean


def test_bool_fields_keep_their_bools():
    cfg = build_config({**BASE, "gradient_checkpointing": False, "bf16": True})
    assert cfg.training.gradient_checkpointing is False and cfg.training.bf16 is True


def _enum_words_yaml_reads_as_bool():
    """(field, word) for every enum choice of the schema that YAML 1.1 would turn into a bool."""
    out = set()
    for cls in SECTIONS.values():
        for name, info in cls.model_fields.items():
            ann = info.annotation
            args = (ann,) if typing.get_origin(ann) is typing.Literal else typing.get_args(ann)
            if bool in args:
                continue  # the field takes a bool itself; nothing to translate
            words = [w for a in args if typing.get_origin(a) is typing.Literal for w in typing.get_args(a)]
            out |= {(name, w) for w in words if isinstance(yaml.safe_load(str(w)), bool)}
    return sorted(out)


def test_the_schema_walk_finds_the_strategy_enums():
    assert {("eval_strategy", "no"), ("save_strategy", "no")} <= set(_enum_words_yaml_reads_as_bool())


@pytest.mark.parametrize(("field", "word"), _enum_words_yaml_reads_as_bool())
def test_every_enum_word_yaml_reads_as_a_bool_is_accepted_unquoted(tmp_path, field, word):
    path = tmp_path / "c.yaml"
    path.write_text(f"model_name_or_path: m\noutput_dir: o\n{field}: {word}\n")
    assert load_config(path).flat()[field] == word
