"""`lmstack plan cfg.yaml [key=value ...] [--gpu NAME | --gpu-memory GIB] ...`: the memory and parallelism
plan of a training config, for this machine's GPU or a named one, with the launch it implies (--emit)."""

from __future__ import annotations

import argparse

from lmstack.config.errors import ConfigError


def split_plan_items(items: list[str]) -> tuple[str, list[str]]:
    """`plan`'s positionals in any order: the config file (the one item that is not key=value) and the
    key=value overrides, as `train` takes them."""
    files = [x for x in items if "=" not in x]
    if len(files) != 1:
        got = "none" if not files else ", ".join(files)
        raise argparse.ArgumentTypeError(
            f"lmstack plan takes one config file and key=value overrides; got config file(s): {got}"
        )
    return files[0], [x for x in items if "=" in x]


def target_gpu(
    args: argparse.Namespace, here
) -> tuple[float, tuple[int, int] | None, str | None, str | None]:
    """(GiB per GPU, compute capability, GPU name, interconnect) of the machine planned for: --gpu NAME's
    table entry, --gpu-memory / --gpu-capability over it, else the visible GPU (planning for this machine)."""
    from lmstack.memory.gpus import gpu_kind

    if args.gpu:
        try:
            kind = gpu_kind(args.gpu)
        except ValueError as err:
            raise ConfigError(f"--gpu: {err}") from None
        memory, capability, name, link = kind.memory_gib, kind.capability, kind.label, kind.interconnect
    elif args.gpu_memory:
        memory, capability, name, link = args.gpu_memory, None, None, None
    else:  # this machine's GPU: its kind where one is visible
        memory, capability, name, link = (
            here.gpu_memory_gib or 80.0,
            here.cuda_capability,
            here.gpu_name,
            None,
        )
    memory = args.gpu_memory or memory
    if args.gpu_capability:
        capability, name = args.gpu_capability, "given by --gpu-capability"
    return memory, capability, name, link


def planned_for(args: argparse.Namespace, here, memory: float) -> str | None:
    """The plan's device reason where the GPU planned for is not one this machine shows (None: the
    named target's own words)."""
    if args.gpu or args.gpu_memory:
        return None
    if here.cuda:
        return "a CUDA GPU is visible (this machine's is planned for)"
    return (
        f"no CUDA GPU is visible here: planned for a CUDA GPU of {memory:g} GiB (give --gpu NAME or "
        "--gpu-memory GIB for the machine that will train)"
    )


def cmd_plan(args: argparse.Namespace) -> int:
    import json

    from lmstack.config.load import load_config
    from lmstack.launch.context import LaunchContext
    from lmstack.memory import check_layout, enumerate_layouts, plan, pretrain_gpt_args, to_json
    from lmstack.models.load import check_model_path
    from lmstack.plan.whatif import disk_free_gib, machine_memory_gib

    if args.emit and (args.megatron or args.tp or args.pp):
        raise ConfigError(
            "--emit: lmstack train does not run Megatron TP x PP layouts; drop --megatron/--tp/--pp to emit "
            "the launch of the recommended DeepSpeed/FSDP/DDP layout"
        )
    given = {"--configured": args.configured, "--master-addr": args.master_addr, "--image": args.image,
             "--master-port": args.master_port, "--job-name": args.job_name}  # fmt: skip
    unused = [flag for flag, value in given.items() if value not in (None, False)]
    if unused and not args.emit:
        raise ConfigError(
            f"{', '.join(unused)}: only used with --emit torchrun|slurm|k8s; add --emit or drop them"
        )
    if args.emit and args.json:
        raise ConfigError("--emit prints the launch file, --json the plan: give one of them")
    if args.configured and args.search:
        raise ConfigError(
            "--configured emits the YAML as it is, --search changes its micro-batch/checkpointing: give one"
        )
    if args.emit == "k8s" and not args.image:
        raise ConfigError("--emit k8s: give --image, the container image with lmstack installed")
    cfg = load_config(args.config, args.overrides)
    # a hub id that is not cached while offline: one line, as `train` says it; the tokenizer is needed
    # only when the data's own lengths are read
    check_model_path(cfg, tokenizer=not args.no_data, model_type=False)
    # the GPU is probed (torch imported) only when --gpus / --gpu-memory / --gpu leave something to read
    here = LaunchContext.from_env(probe_cuda=not (args.gpus and (args.gpu_memory or args.gpu)))
    gpus = args.gpus or max(here.gpu_count, 1)
    memory, capability, gpu_name, interconnect = target_gpu(args, here)
    # planning for this machine (no GPU named): its CPU RAM and disk are constraints too; the optional
    # packages never are (the target is assumed to have what a strategy needs: plan/whatif.py)
    local = not (args.gpu_memory or args.gpu)
    run_plan, req = plan_target(
        cfg, gpus, memory, nodes=args.nodes, capability=capability, gpu_name=gpu_name,
        planned_for=planned_for(args, here, memory), interconnect=interconnect,
        cpu_memory_gib=args.cpu_memory or (machine_memory_gib() if local else None),
        disk_free_gib=disk_free_gib(cfg.training.output_dir) if local else None,
        search=args.search, data=not args.no_data,
    )  # fmt: skip
    if args.megatron or args.tp or args.pp:
        total, per_node = gpus * args.nodes, gpus
        mb = args.micro_batches
        if args.tp or args.pp:
            layouts = [
                check_layout(
                    req.spec,
                    total,
                    args.tp or 1,
                    args.pp or 1,
                    gpus_per_node=per_node,
                    micro_batches=mb,
                    seq_len=req.seq_len,
                    gpu_memory_gib=req.gpu_memory_gib,
                    interconnect=interconnect,
                )
            ]
        else:
            layouts = enumerate_layouts(
                req.spec, total, per_node, mb, seq_len=req.seq_len, gpu_memory_gib=req.gpu_memory_gib,
                interconnect=interconnect,
            )  # fmt: skip
        if args.json:
            print(json.dumps([layout_dict(x) for x in layouts], indent=2))
            return 0
        for x in layouts:
            mem = f"{x.per_gpu.total:7.1f} GiB" if x.per_gpu else "      -"
            print(
                f"TP={x.tp:<3} PP={x.pp:<3} DP={x.dp:<4} bubble={x.bubble_ratio:5.1%} {mem}  "
                f"{'valid' if x.valid else 'INVALID'}: {x.reason}"
            )
        best = next((x for x in layouts if x.valid), None)
        if best is not None:
            print("\npretrain_gpt.py " + " ".join(pretrain_gpt_args(best)))
        return 0 if best is not None else 1
    result = plan(req)
    if args.emit:
        print(emit_launch(args, result, gpus), end="")
        return 0
    if args.json:
        print(json.dumps({**to_json(result), "run_plan": run_plan.to_dict()}, indent=2))
    else:
        print(plan_text(run_plan, result))
    return 0


def plan_target(
    cfg, gpus: int, memory: float, *, nodes: int = 1, capability: tuple[int, int] | None = None,
    gpu_name: str | None = None, planned_for: str | None = None, interconnect: str | None = None,
    cpu_memory_gib: float | None = None, disk_free_gib: float | None = None, search: bool = False,
    data: bool = True,
):  # fmt: skip
    """(run plan, memory-plan request) of `cfg` on `nodes` x `gpus` GPUs of `memory` GiB: what `lmstack
    plan` and the web UI's plan both estimate, for the target machine (the optional packages a strategy
    needs are assumed there, never read from this machine: plan/whatif.py). `data`: read the unpacked
    rows' own lengths (else cutoff_len); `cpu_memory_gib` / `disk_free_gib`: constraints where known."""
    from lmstack.plan.from_config import request_from_plan
    from lmstack.plan.lengths import data_lengths
    from lmstack.plan.whatif import plan_for

    run_plan = plan_for(cfg, gpus * nodes, memory, capability, gpu_name, planned_for)
    lengths = data_lengths(run_plan) if data else None  # unpacked rows: the data's own lengths
    try:
        req = request_from_plan(
            run_plan, gpus, memory, nodes, cpu_memory_gib, search=search, lengths=lengths,
            disk_free_gib=disk_free_gib, interconnect=interconnect,
        )  # fmt: skip
    except OSError as err:  # config.json unreachable (no network, no cache): transformers' OSError
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(
            f"model_name_or_path: {cfg.model.model_name_or_path}: its config.json cannot be read ({first}); "
            "give a local model directory, or download the model first"
        ) from None
    return run_plan, req


def plan_text(run_plan, result) -> str:
    """The table `lmstack plan` prints (and the web UI shows): the candidates, then the run plan."""
    from lmstack.memory import format_table

    return format_table(result) + "\n\n" + run_plan.describe()


def emit_launch(args: argparse.Namespace, result, gpus: int) -> str:
    """The launch file (--emit) of the recommended layout, or with --configured the configured one, on
    --nodes nodes of `gpus` GPUs; a layout that does not fit is refused."""
    from pathlib import Path

    from lmstack.launch.emit import LaunchSpec, render
    from lmstack.launch.torchrun import DEFAULT_MULTINODE_PORT, override_args
    from lmstack.memory.advice import label, target_installs

    layers = result.request.spec.num_layers
    if args.configured:
        chosen, changes = result.configured, {}
        if chosen is None or not chosen.fits:
            why = chosen.why_not if chosen is not None else "no estimate"
            raise ConfigError(
                f"--emit --configured: the configured setup does not fit ({why}); drop --configured"
            )
    else:
        if result.recommendation is None:
            raise ConfigError("--emit: nothing fits on this layout; more GPUs/nodes or a smaller setup first")
        chosen, changes = result.recommendation.candidate, dict(result.recommendation.yaml_changes)
    installs = target_installs(result.request, chosen.setup)
    notes = [f"per GPU {chosen.estimate.gpu.total:.1f} GiB of {result.request.gpu_memory_gib:g} GiB"]
    if chosen.setup.offload_optimizer or chosen.setup.checkpoint_offload:
        notes.append(f"CPU memory per node: about {chosen.estimate.cpu_gib:.0f} GiB (offload)")
    notes += [f"install on every node: pip install {' '.join(installs)}"] if installs else []
    notes += ["THIS CHANGES THE METHOD (see lmstack plan's reason)"] if chosen.changes_method else []
    config = Path(args.config)
    spec = LaunchSpec(
        config=str(config.resolve()),
        nnodes=args.nodes,
        nproc_per_node=gpus,
        overrides=(*args.overrides, *override_args(changes)),
        master_addr=args.master_addr,
        master_port=args.master_port or DEFAULT_MULTINODE_PORT,
        job_name=args.job_name or "lmstack",
        image=args.image,
        summary=("configured: " if args.configured else "recommended: ") + label(chosen, layers),
        notes=tuple(notes),
    )
    return render(args.emit, spec, config.name, config.read_text(encoding="utf-8"))


def parse_capability(text: str) -> tuple[int, int]:
    """--gpu-capability 9.0 | 8.9 | sm90 -> (major, minor)."""
    digits = text.lower().removeprefix("sm").replace(".", "")
    if not digits.isdigit() or len(digits) < 2:
        raise argparse.ArgumentTypeError(
            f"got {text!r}; give major.minor, e.g. 9.0 (H100/H200) or 8.0 (A100)"
        )
    return int(digits[:-1]), int(digits[-1])


def layout_dict(x) -> dict:
    return {
        "tp": x.tp,
        "pp": x.pp,
        "dp": x.dp,
        "bubble_ratio": x.bubble_ratio,
        "valid": x.valid,
        "reason": x.reason,
        "per_gpu_gib": x.per_gpu.to_dict() if x.per_gpu else None,
    }


def register(sub: argparse._SubParsersAction) -> None:
    """`lmstack plan`'s arguments (the order of `lmstack --help` is build_parser's)."""
    p = sub.add_parser(
        "plan", help="predict per-GPU memory, pick the strategy that fits (Megatron layouts too)"
    )
    p.add_argument("config", help="training YAML (only config.json of the model is read)")
    p.add_argument("overrides", nargs="*", help="key=value overrides (anywhere on the line, as for train)")
    p.add_argument("--gpus", type=int, help="GPUs per node (default: the visible ones, else 1)")
    p.add_argument(
        "--gpu",
        metavar="NAME",
        help="the target GPU: its memory, compute capability and interconnect (h200, h100, h100-pcie, "
        "a100-80, a100-40, l40s, l4, a10g, 4090, 3090, b200)",
    )
    p.add_argument(
        "--gpu-memory", type=float, help="GiB per GPU (default: --gpu's, else the visible GPU's, else 80)"
    )
    p.add_argument("--nodes", type=int, default=1, help="number of nodes")
    p.add_argument("--cpu-memory", type=float, help="GiB of CPU memory per node (checks offload)")
    p.add_argument(
        "--gpu-capability",
        type=parse_capability,
        help="the GPU's compute capability, e.g. 9.0 (H100/H200), 8.0 (A100): FP8 needs 8.9+ "
        "(default: the visible GPU's)",
    )
    p.add_argument(
        "--search",
        action="store_true",
        help="the configured row too searches micro-batch and checkpointing (the recommendation always does)",
    )
    p.add_argument(
        "--no-data", action="store_true", help="unpacked rows: assume cutoff_len instead of reading the data"
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--megatron", action="store_true", help="enumerate Megatron TP x PP x DP layouts")
    p.add_argument("--tp", type=int, help="check one Megatron layout: tensor-parallel size")
    p.add_argument("--pp", type=int, help="check one Megatron layout: pipeline-parallel size")
    p.add_argument("--micro-batches", type=int, default=32, help="Megatron micro-batches per step")
    p.add_argument(
        "--emit",
        choices=["torchrun", "slurm", "k8s"],
        help="print the launch of the recommended layout instead of the table: a torchrun line per node, "
        "a Slurm sbatch script, or a Kubernetes PyTorchJob (Kubeflow training operator) with its ConfigMap",
    )
    p.add_argument(
        "--configured", action="store_true", help="--emit the configured setup, not the recommended"
    )
    p.add_argument(
        "--master-addr", help="--emit torchrun: node 0's address (default: $MASTER_ADDR on each node)"
    )
    p.add_argument("--master-port", type=int, help="--emit: the rendezvous port (default 29500)")
    p.add_argument("--job-name", help="--emit slurm/k8s: the job's name (default lmstack)")
    p.add_argument("--image", help="--emit k8s: the container image with lmstack installed")
    p.set_defaults(func=cmd_plan)
