"""Config files as users write them: YAML merge keys (as PyYAML's safe_load and LF's OmegaConf read
them), a file that is not UTF-8, and a secret field given a value of the wrong type."""

from __future__ import annotations

import pytest

from lmstack.config.errors import ConfigError
from lmstack.config.load import build_config, load_yaml


def test_merge_key_merges_and_the_mappings_own_keys_win(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "defaults: &d {learning_rate: 1.0e-3, cutoff_len: 512}\n"
        "run:\n  <<: *d\n  cutoff_len: 128\n"
        "<<: *d\nlearning_rate: 5.0e-5\n"
    )
    data = load_yaml(path)
    assert data["run"] == {"learning_rate": 1e-3, "cutoff_len": 128}
    assert data["learning_rate"] == 5e-5 and data["cutoff_len"] == 512


def test_a_key_set_twice_beside_a_merge_is_still_an_error(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("d: &d {cutoff_len: 512}\n<<: *d\ncutoff_len: 128\ncutoff_len: 64\n")
    with pytest.raises(ConfigError, match="cutoff_len: set twice"):
        load_yaml(path)


def test_a_latin1_file_is_a_plain_error_naming_the_encoding_and_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_bytes(b"model_name_or_path: m\n# caf\xe9\n")
    with pytest.raises(ConfigError, match=r"line 2: byte 0xe9 is not UTF-8.*re-save it as UTF-8"):
        load_yaml(path)


def test_a_utf8_bom_is_read_past(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_bytes(b"\xef\xbb\xbfmodel_name_or_path: m\n")
    assert load_yaml(path) == {"model_name_or_path": "m"}


def test_a_secret_of_the_wrong_type_is_not_echoed():
    with pytest.raises(ConfigError) as err:
        build_config({"model_name_or_path": "m", "hf_hub_token": 918273645501})
    assert "hf_hub_token" in str(err.value) and "918273645501" not in str(err.value)


def test_val_size_between_forms_names_both_of_lfs_forms_once():
    with pytest.raises(ConfigError) as err:
        build_config({"model_name_or_path": "m", "val_size": 1.5})
    message = str(err.value)
    assert (
        message.count("got 1.5") == 1 and "a fraction in (0, 1) or a whole number of records >= 1" in message
    )
