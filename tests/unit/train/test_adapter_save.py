"""A saved LoRA adapter is checked on disk: no tensors or empty tensors are an error (FSDP1 on
2 x H200 wrote an adapter with 0 tensors through the Trainer's save, 2026-11-29)."""

import pytest
import torch
from safetensors.torch import save_file

from lmstack.config.errors import LmstackError
from lmstack.models.adapter_save import ADAPTER_FILE, check_adapter_file, clean_name, trainable_tensors


def test_a_real_adapter_passes(tmp_path):
    save_file(
        {"a.lora_A.weight": torch.ones(8, 4), "a.lora_B.weight": torch.zeros(4, 8)}, tmp_path / ADAPTER_FILE
    )
    assert check_adapter_file(tmp_path) == 2


@pytest.mark.parametrize(
    "tensors, says",
    [
        ({}, "holds no tensors"),
        ({"a.lora_A.weight": torch.ones(8, 4), "a.lora_B.weight": torch.ones(0)}, "1 empty"),
    ],
)
def test_an_empty_or_hollow_adapter_is_an_error_naming_the_fix(tmp_path, tensors, says):
    save_file(tensors, tmp_path / ADAPTER_FILE)
    with pytest.raises(LmstackError, match=says) as err:
        check_adapter_file(tmp_path)
    assert "ds_z3_config.json" in str(err.value)


def test_a_missing_adapter_is_an_error(tmp_path):
    with pytest.raises(LmstackError, match="was not written"):
        check_adapter_file(tmp_path)


def test_fsdp_wrapper_prefixes_are_removed_and_only_trainable_tensors_kept():
    name = "base_model.model._fsdp_wrapped_module.model.layers.0._fsdp_wrapped_module._checkpoint_wrapped_module.q.lora_A.default.weight"
    assert clean_name(name) == "base_model.model.model.layers.0.q.lora_A.default.weight"
    frozen, trained = (
        torch.nn.Parameter(torch.ones(2), requires_grad=False),
        torch.nn.Parameter(torch.ones(3)),
    )
    kept = trainable_tensors([("_fsdp_wrapped_module.w", frozen), ("_fsdp_wrapped_module.lora_A", trained)])
    assert list(kept) == ["lora_A"] and kept["lora_A"].device.type == "cpu"
