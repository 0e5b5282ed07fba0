"""The Megatron backend's contract (plan/megatron.py): LF's Megatron-Bridge rules and the backend's own,
every problem reported at once by name; and every layout `lmstack plan --megatron` recommends for the
dense families passes them."""

from __future__ import annotations

import pytest

from lmstack.memory import enumerate_layouts
from lmstack.plan.megatron import MegatronFields, layout_fields, problems, shape_of_spec

DENSE = ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b", "llama-3-8b", "llama-13b", "llama-2-70b", "llama-2-7b")


@pytest.mark.parametrize("name", DENSE)
@pytest.mark.parametrize("gpus", [1, 2, 4, 8, 16, 64])
def test_recommended_layouts_pass_the_backend(specs, name, gpus):
    spec = specs[name]
    layouts = [lay for lay in enumerate_layouts(spec, gpus, 8, 32, sequence_parallel=True) if lay.valid]
    assert layouts, f"no valid layout for {name} on {gpus} GPUs"
    for lay in layouts:
        m = MegatronFields.from_mapping(layout_fields(lay))
        got = problems(m, world=gpus, stage="sft", finetuning_type="lora", shape=shape_of_spec(spec),
                       family=spec.model_type)  # fmt: skip
        assert got == [], (lay.tp, lay.pp, got)


def test_lf_rules_all_reported_by_name(specs):
    m = MegatronFields(tensor_model_parallel_size=3, sequence_parallel=False, recompute_granularity="some")
    got = problems(m, world=4, stage="dpo", finetuning_type="freeze", quantization_bit=4,
                   deepspeed="ds_z3.json", resume=True, do_eval=True)  # fmt: skip
    text = "\n".join(got)
    for name in ("does not divide the world size 4", "stage: got 'dpo'", "finetuning_type: got 'freeze'",
                 "quantization_bit: got 4", "deepspeed: got 'ds_z3.json'", "resume_from_checkpoint",
                 "do_eval", "recompute_granularity: got 'some'"):  # fmt: skip
        assert name in text, (name, text)
    assert len(got) == 8


def test_sequence_parallel_needs_tp():
    got = problems(MegatronFields(sequence_parallel=True), world=2, stage="pt", finetuning_type="full")
    assert got == ["sequence_parallel: true needs tensor_model_parallel_size > 1; set it false"]


def test_backend_refuses_what_it_does_not_do(specs):
    m = MegatronFields(expert_model_parallel_size=2, context_parallel_size=2, use_packed_sequences=True,
                       virtual_pipeline_model_parallel_size=2, megatron_pretrained_checkpoint="ckpt",
                       tensor_model_parallel_size=3)  # fmt: skip
    got = problems(m, world=12, stage="sft", finetuning_type="full", shape=shape_of_spec(specs["qwen2.5-0.5b"]),
                   family="qwen2_moe")  # fmt: skip
    text = "\n".join(got)
    for name in ("expert_model_parallel_size: got 2", "context_parallel_size: got 2", "use_packed_sequences",
                 "virtual_pipeline_model_parallel_size", "megatron_pretrained_checkpoint",
                 "model_type: got 'qwen2_moe'", "num_attention_heads 14", "num_key_value_heads 2"):  # fmt: skip
        assert name in text, (name, text)


def test_defaults_pass():
    assert problems(MegatronFields(), world=1, stage="sft", finetuning_type="lora") == []


def test_planner_refuses_a_tp_that_does_not_split_the_vocabulary(specs):
    """The backend splits the vocabulary exactly, so the planner does not recommend a TP it would refuse."""
    import dataclasses

    from lmstack.memory import check_layout

    odd = dataclasses.replace(specs["qwen2.5-0.5b"], vocab_size=151937)
    layout = check_layout(odd, 2, 2, 1, micro_batches=8)
    assert not layout.valid and "does not divide vocab_size=151937" in layout.reason
