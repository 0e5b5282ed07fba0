"""When an adapter's base_model_name_or_path "clearly names another base": the model's own name differs
(hub id, local folder and hub-cache snapshot of one model agree) and the two are not one folder."""

from __future__ import annotations

import pytest

from lmstack.infer.trained import model_name, same_model


@pytest.mark.parametrize(
    "spelling",
    [
        "Qwen/Qwen2.5-0.5B",
        "/models/Qwen2.5-0.5B/",
        "qwen2.5-0.5b",
        "/root/.cache/huggingface/hub/models--Qwen--Qwen2.5-0.5B/snapshots/0123abcd",
    ],
)
def test_spellings_of_one_model_give_one_name(spelling):
    assert model_name(spelling) == "qwen2.5-0.5b"
    assert same_model(spelling, "Qwen/Qwen2.5-0.5B")


def test_different_models_are_different():
    assert not same_model("Qwen/Qwen2.5-7B", "Qwen/Qwen2.5-0.5B")
    assert not same_model("/models/a", "/models/b")  # neither exists: the names decide


def test_one_folder_under_two_names_is_the_same_model(tmp_path):
    real = tmp_path / "qwen2"
    real.mkdir()
    (tmp_path / "current").symlink_to(real)
    assert same_model(str(tmp_path / "current"), str(real))
