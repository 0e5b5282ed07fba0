"""QLoRA settings: the bitsandbytes config, device placement, and the checks that run before loading."""

import json

import pytest
import torch

from lmstack.config.errors import ConfigError
from lmstack.config.load import build_config
from lmstack.models.quantization import check_quantization as _check
from lmstack.models.quantization import quantization_config, quantized_device_map


def check_quantization(c, sharded=False, device="cuda"):
    """The check with the run plan's facts: sharded (ZeRO-3/FSDP), the device, bitsandbytes present."""
    _check(c, sharded, "cpu" if c.training.use_cpu else device, True)


def cfg(tmp_path, **extra):
    return build_config({"model_name_or_path": "m", "output_dir": str(tmp_path / "out"), **extra})


def ds(tmp_path, stage):
    path = tmp_path / f"z{stage}.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": stage}}))
    return str(path)


def test_no_quantization_means_no_config(tmp_path):
    c = cfg(tmp_path)
    assert quantization_config(c, torch.bfloat16) is None and quantized_device_map(None, False, 0) is None
    check_quantization(c)  # nothing to check


@pytest.mark.parametrize("qtype,double", [("nf4", True), ("fp4", False)])
def test_four_bit_config_follows_the_fields(tmp_path, qtype, double):
    c = cfg(tmp_path, quantization_bit=4, quantization_type=qtype, double_quantization=double, bf16=True)
    q = quantization_config(c, torch.bfloat16)
    assert q.load_in_4bit and not q.load_in_8bit
    assert q.bnb_4bit_quant_type == qtype and q.bnb_4bit_use_double_quant is double
    assert q.bnb_4bit_compute_dtype == torch.bfloat16
    # packed weights stored in the compute dtype: ZeRO-3 / FSDP can shard them with the other params
    assert q.bnb_4bit_quant_storage == torch.bfloat16


def test_eight_bit_config(tmp_path):
    q = quantization_config(cfg(tmp_path, quantization_bit=8), torch.float16)
    assert q.load_in_8bit and not q.load_in_4bit


def test_device_map_is_this_rank_unless_sharded(tmp_path):
    from dataclasses import replace

    from lmstack.launch.context import FsdpLaunch
    from lmstack.plan.runplan import RunPlan
    from lmstack.plan.whatif import gpu_context

    ctx = replace(gpu_context(1, 80), local_rank=3, accelerate_fsdp=None)

    def device_map(**extra):
        return RunPlan.resolve(cfg(tmp_path, quantization_bit=4, **extra), ctx).model_spec().device_map

    assert quantized_device_map(4, False, 3) == {"": 3}
    assert device_map(deepspeed=ds(tmp_path, 2)) == {"": 3}
    assert device_map(deepspeed=ds(tmp_path, 3)) is None  # ZeRO-3 places the weights
    ctx = replace(ctx, accelerate_fsdp=FsdpLaunch())
    assert device_map() is None


@pytest.mark.parametrize(
    "extra,pattern",
    [
        (
            {"finetuning_type": "full"},
            r"quantization_bit: a 4-bit base cannot be trained with finetuning_type: full",
        ),
        ({"train_from_scratch": True}, r"quantization_bit: a random-init model"),
        ({"pissa_init": True}, r"pissa_init: PiSSA rewrites the base weights .*quantization_bit: 4"),
        ({"adapter_name_or_path": "a,b"}, r"adapter_name_or_path: merging adapters into a 4-bit base"),
    ],
)
def test_config_errors_name_both_fields(tmp_path, extra, pattern):
    with pytest.raises(ConfigError, match=pattern):
        check_quantization(cfg(tmp_path, quantization_bit=4, **extra))


def test_eight_bit_cannot_be_sharded(tmp_path):
    with pytest.raises(ConfigError, match=r"quantization_bit: 8-bit bases cannot be sharded by ZeRO-3/FSDP"):
        check_quantization(cfg(tmp_path, quantization_bit=8, deepspeed=ds(tmp_path, 3)), sharded=True)
    with pytest.raises(ConfigError, match=r"8-bit bases cannot be sharded .*FSDP via accelerate"):
        check_quantization(cfg(tmp_path, quantization_bit=8), sharded=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_no_gpu_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match=r"quantization_bit: got 4, but no CUDA GPU is visible; .*Remove"):
        check_quantization(cfg(tmp_path, quantization_bit=4, bf16=True), device="cpu")


def test_use_cpu_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match=r"quantization_bit: got 8, but (use_cpu: true is set|no CUDA GPU)"):
        check_quantization(cfg(tmp_path, quantization_bit=8, use_cpu=True))
