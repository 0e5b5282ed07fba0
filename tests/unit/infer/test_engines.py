"""`infer_backend: vllm | sglang`: refusals before anything loads (missing package, several adapters,
training), LF's vllm_* / sglang_* fields, and the translation of a sequence's `Sampling` into each
engine's parameters (plain data: the engines themselves are not installable on a CPU box)."""

from __future__ import annotations

import re

import pytest

from lmstack.config.errors import ConfigError
from lmstack.config.load import build_config
from lmstack.infer.engines import (
    check_backend,
    load_engine,
    sglang_engine_args,
    sglang_sampling_kwargs,
    vllm_engine_args,
    vllm_sampling_kwargs,
)
from lmstack.infer.sampling import Sampling

BASE = {"model_name_or_path": "/models/Qwen2.5-0.5B", "output_dir": "o"}


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_a_missing_engine_package_is_refused_by_name_before_the_model_loads(backend, tmp_path):
    cfg = build_config({**BASE, "model_name_or_path": str(tmp_path / "missing"), "infer_backend": backend})
    message = re.escape(
        f"infer_backend: {backend} needs the {backend} package: pip install 'lmstack[{backend}]'"
    )
    with pytest.raises(ConfigError, match=message):
        check_backend(cfg)
    with pytest.raises(ConfigError, match=message):  # not "model_name_or_path: directory not found"
        load_engine(cfg)


def test_two_adapters_are_refused_for_an_engine_that_serves_one_unmerged():
    cfg = build_config({**BASE, "infer_backend": "vllm", "adapter_name_or_path": "a,b"})
    with pytest.raises(ConfigError, match="adapter_name_or_path: infer_backend vllm serves one LoRA adapter"):
        check_backend(cfg)


def test_training_with_another_backend_is_refused(base_cfg):
    from lmstack.train.run import train

    with pytest.raises(ConfigError, match="infer_backend: vllm serves chat/api only; train and eval need"):
        train(None, {**base_cfg, "infer_backend": "vllm"})


def test_the_transformers_engine_refuses_a_config_for_another_backend():
    from lmstack.infer.engine import ChatEngine

    with pytest.raises(ConfigError, match="infer_backend: sglang is served by lmstack api and lmstack chat"):
        ChatEngine.from_config(build_config({**BASE, "infer_backend": "sglang"}))


def test_lf_vllm_fields_become_engine_arguments_and_vllm_config_wins():
    cfg = build_config(
        {
            **BASE,
            "infer_backend": "vllm",
            "adapter_name_or_path": "/runs/lora",
            "infer_dtype": "bfloat16",
            "vllm_maxlen": 2048,
            "vllm_gpu_util": 0.9,
            "vllm_enforce_eager": True,
            "vllm_max_lora_rank": 64,
            "vllm_config": '{"max_num_seqs": 64, "gpu_memory_utilization": 0.8}',
        }
    )
    args = vllm_engine_args(cfg, gpus=2)
    assert args["model"] == "/models/Qwen2.5-0.5B" and args["dtype"] == "bfloat16"
    assert (args["max_model_len"], args["enforce_eager"], args["tensor_parallel_size"]) == (2048, True, 2)
    assert (args["enable_lora"], args["max_lora_rank"]) == (True, 64)  # the adapter is served, not merged
    assert (args["max_num_seqs"], args["gpu_memory_utilization"]) == (64, 0.8)
    plain = vllm_engine_args(build_config(BASE), gpus=0)
    assert (plain["enable_lora"], plain["tensor_parallel_size"], plain["max_model_len"]) == (False, 1, 4096)
    assert plain["gpu_memory_utilization"] == 0.7 and plain["dtype"] == "auto"


def test_a_bad_vllm_config_string_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match="vllm_config: .*not valid JSON"):
        build_config({**BASE, "vllm_config": "{max_num_seqs: 64"})


def test_lf_sglang_fields_become_engine_arguments():
    cfg = build_config(
        {
            **BASE,
            "adapter_name_or_path": "/runs/lora",
            "sglang_maxlen": 1024,
            "sglang_mem_fraction": 0.5,
            "sglang_lora_backend": "flashinfer",
            "sglang_config": {"chunked_prefill_size": 512},
        }
    )
    args = sglang_engine_args(cfg, gpus=4)
    assert (args["context_length"], args["mem_fraction_static"], args["tp_size"]) == (1024, 0.5, 4)
    assert (args["lora_paths"], args["lora_backend"]) == (["/runs/lora"], "flashinfer")
    assert args["chunked_prefill_size"] == 512
    assert sglang_engine_args(build_config({**BASE, "sglang_tp_size": 1}), gpus=4)["tp_size"] == 1


SAMPLED = Sampling(
    max_tokens=50,
    do_sample=True,
    temperature=0.7,
    top_p=0.9,
    top_k=20,
    repetition_penalty=1.1,
    presence_penalty=0.5,
    frequency_penalty=0.25,
    logit_bias=((7, -100.0),),
    seed=3,
    stop=("\n\n",),
    logprobs=True,
    top_logprobs=2,
)


def test_sampling_maps_onto_vllm_sampling_params():
    kw = vllm_sampling_kwargs(SAMPLED, [2, 5], skip_special_tokens=True)
    assert kw == {
        "n": 1,
        "max_tokens": 50,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "repetition_penalty": 1.1,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
        "seed": 3,
        "stop": ["\n\n"],
        "stop_token_ids": [2, 5],
        "skip_special_tokens": True,
        "logprobs": 2,
        "logit_bias": {7: -100.0},
    }
    greedy = vllm_sampling_kwargs(Sampling(max_tokens=8, json_object=True), [2], skip_special_tokens=False)
    assert (greedy["temperature"], greedy["top_p"], greedy["top_k"], greedy["logprobs"]) == (
        0.0,
        1.0,
        -1,
        None,
    )
    assert greedy["json_object"] is True and greedy["stop"] is None
    # do_sample with temperature 0 is greedy too
    assert (
        vllm_sampling_kwargs(Sampling(max_tokens=8, do_sample=True, temperature=0), [], True)["temperature"]
        == 0
    )


def test_sampling_maps_onto_sglang_sampling_params():
    kw = sglang_sampling_kwargs(SAMPLED, [2], skip_special_tokens=True)
    assert kw["max_new_tokens"] == 50 and kw["sampling_seed"] == 3 and kw["logit_bias"] == {"7": -100.0}
    assert (kw["temperature"], kw["top_p"], kw["top_k"], kw["stop"]) == (0.7, 0.9, 20, ["\n\n"])
    assert (kw["presence_penalty"], kw["frequency_penalty"], kw["repetition_penalty"]) == (0.5, 0.25, 1.1)
    json_mode = sglang_sampling_kwargs(Sampling(max_tokens=8, json_object=True), [2], True)
    assert json_mode["json_schema"] == '{"type": "object"}' and json_mode["temperature"] == 0.0
    assert "sampling_seed" not in json_mode
