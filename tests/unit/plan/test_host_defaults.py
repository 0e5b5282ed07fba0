"""plan.loader and plan.optimizer: an LF YAML that leaves `dataloader_num_workers` and `optim` unset gets
the fast host-side path (batches built by worker processes on a CUDA run, torch's fused AdamW), each
choice printed with its reason; a value the YAML writes is taken as written, even when it equals LF's
default."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lmstack.config.load import build_config
from lmstack.launch.context import LaunchContext
from lmstack.plan.runplan import RunPlan
from lmstack.plan.whatif import gpu_context

CPU = LaunchContext(cpu_count=16)
H200 = replace(gpu_context(1, 139), cpu_count=16)  # the bench machine: 16 cores, one GPU


@pytest.fixture
def lf_yaml(tiny_model, tmp_path) -> dict:
    """LF's LoRA SFT example as an LF user writes it: no optim, no dataloader_num_workers."""
    return {
        "model_name_or_path": str(tiny_model), "stage": "sft", "do_train": True, "finetuning_type": "lora",
        "lora_target": "all", "dataset": "alpaca_en_demo", "template": "qwen", "cutoff_len": 2048,
        "output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 1,
        "gradient_accumulation_steps": 8, "learning_rate": 1e-4, "bf16": True, "packing": True,
    }  # fmt: skip


def plan(cfg: dict, ctx: LaunchContext = H200) -> RunPlan:
    return RunPlan.resolve(build_config(cfg), ctx)


def line(p: RunPlan, name: str) -> str:
    return next(x for x in p.describe().splitlines() if x.strip().startswith(name + " "))


def test_unset_fields_on_a_gpu_get_data_workers_and_fused_adamw(lf_yaml):
    p = plan(lf_yaml)
    assert p.loader.workers == 2 and p.loader.pin_memory and not p.loader.persistent
    assert p.optimizer == "adamw_torch_fused"
    assert p.decisions()["data_workers"] == 2 and p.decisions()["optimizer"] == "adamw_torch_fused"
    assert "dataloader_num_workers unset: 2 worker processes" in line(p, "data_workers")
    assert "the same AdamW math as adamw_torch" in line(p, "optimizer")
    args_kw = _trainer_fields(p)
    assert args_kw == {"optim": "adamw_torch_fused", "dataloader_num_workers": 2,
                       "dataloader_persistent_workers": False}  # fmt: skip


def test_the_value_the_yaml_writes_wins_even_lf_default(lf_yaml):
    p = plan({**lf_yaml, "dataloader_num_workers": 0, "optim": "adamw_torch"})
    assert p.loader.workers == 0 and p.optimizer == "adamw_torch"
    assert p.reasons["data_workers"] == "dataloader_num_workers: 0"
    # as written, with what the unset field would have given
    assert p.reasons["optimizer"].startswith("optim: adamw_torch; adamw_torch_fused is the same update")
    assert _trainer_fields(p)["optim"] == "adamw_torch"
    p = plan({**lf_yaml, "dataloader_num_workers": 6, "optim": "adafactor"})
    assert p.loader.workers == 6 and p.optimizer == "adafactor"


def test_a_cpu_run_says_what_it_picks_here_and_on_a_gpu(lf_yaml):
    p = plan({**lf_yaml, "bf16": False}, CPU)
    assert p.device == "cpu" and p.loader.workers == 0
    assert (
        "CPU run" in p.reasons["data_workers"] and "on a CUDA GPU it would be 2" in p.reasons["data_workers"]
    )
    assert p.optimizer == "adamw_torch_fused"  # torch has a fused CPU kernel too
    assert "for cpu (on a CUDA GPU: the CUDA fused kernel)" in p.reasons["optimizer"]


def test_workers_only_where_cores_are_to_spare(lf_yaml):
    assert plan(lf_yaml, replace(H200, cpu_count=3)).loader.workers == 1
    few = plan(lf_yaml, replace(H200, cpu_count=2))
    assert few.loader.workers == 0 and "none to spare" in few.reasons["data_workers"]
    eight = replace(gpu_context(8, 139), cpu_count=16)  # 8 processes on 16 cores: 2 each
    assert plan(lf_yaml, eight).loader.workers == 0
    assert plan(lf_yaml, replace(eight, cpu_count=128)).loader.workers == 2


def test_no_workers_where_they_would_change_the_data_or_buy_nothing(lf_yaml):
    streamed = plan({**lf_yaml, "packing": False, "streaming": True, "max_steps": 10})
    assert streamed.loader.workers == 0 and "different sample order" in streamed.reasons["data_workers"]
    grpo = {**lf_yaml, "stage": "grpo", "packing": False, "reward_funcs": "format"}
    p = plan(grpo)
    assert p.loader.workers == 0 and "generating" in p.reasons["data_workers"]


def test_sharded_runs_and_method_optimizers_keep_their_optimizer(lf_yaml):
    fsdp = plan({**lf_yaml, "fsdp": "full_shard auto_wrap"}, replace(gpu_context(2, 139), cpu_count=32))
    assert fsdp.optimizer == "adamw_torch" and "FSDP steps the optimizer" in fsdp.reasons["optimizer"]
    full = {**lf_yaml, "finetuning_type": "full"}
    muon = plan({**full, "use_muon": True})
    assert (
        muon.optimizer == "adamw_torch" and "use_muon builds its own optimizer" in muon.reasons["optimizer"]
    )
    galore = plan({**full, "use_galore": True, "galore_target": "all"})
    assert "use_galore builds its own optimizer" in galore.reasons["optimizer"]


def test_the_memory_model_follows_the_plan_s_kernel(lf_yaml):
    from lmstack.plan.from_config import request_from_plan

    assert not request_from_plan(plan(lf_yaml), 1, 139).adam_foreach
    assert request_from_plan(plan({**lf_yaml, "optim": "adamw_torch"}), 1, 139).adam_foreach


def _trainer_fields(p: RunPlan) -> dict:
    from lmstack.train.common import training_arguments

    # TrainingArguments cannot be built for CUDA here (and turn pinned memory off on CPU themselves)
    args = training_arguments(replace(p, device="cpu"))
    names = ("optim", "dataloader_num_workers", "dataloader_persistent_workers")
    return {n: getattr(args, n).value if n == "optim" else getattr(args, n) for n in names}


HEAVY = frozenset({"torchao", "bitsandbytes"})


def test_a_plain_run_keeps_the_unused_heavy_packages_out(lf_yaml):
    p = plan(lf_yaml, replace(H200, packages=H200.packages | HEAVY))
    assert set(p.kept_out) == HEAVY and p.decisions()["kept_out"] == "torchao, bitsandbytes"
    assert "installed but unused by this run" in line(p, "kept_out")
    assert plan(lf_yaml, replace(H200, packages=frozenset())).kept_out == ()


@pytest.mark.parametrize(
    ("over", "kept", "why"),
    [
        ({"quantization_bit": 4}, (), "quantization_bit"),
        ({"optim": "adamw_8bit"}, (), "optim: adamw_8bit"),
        ({"finetuning_type": "full", "use_galore": True, "galore_target": "all"}, (), "use_galore"),
        ({"trust_remote_code": True}, (), "trust_remote_code"),
        ({"fp8": True}, ("bitsandbytes",), "kept in: fp8: true"),
    ],
)
def test_whatever_may_reach_them_keeps_them_in(lf_yaml, over, kept, why):
    p = plan({**lf_yaml, **over}, replace(H200, packages=H200.packages | HEAVY, cuda_capability=(9, 0)))
    assert p.kept_out == kept and why in p.reasons["kept_out"]
