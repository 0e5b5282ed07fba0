"""The planner's per-GPU prediction for every measured GPU run of a benchmark session, offline (CPU):
reads the result lines that came back from the GPU calls, rebuilds each run's exact config against
config-only model folders (bench/make_assets.py's configs, no weights), asks the planner, and writes
bench/results/plan_accuracy.json (rows + summary: median and worst |error|).

    python3 bench/plan_check.py OUT_JSON [--old-chunked-ce-before ISO_DATE] RESULT_FILE...
        RESULT_FILE: speed*.jsonl, stages*.jsonl, qlora*.jsonl, distributed*.jsonl, plan_runs*.json
        --old-chunked-ce-before: runs dated before this were made before the chunked CE freed each
        chunk early (commit db98c1b, 2026-11-29T17:05Z); for them the planner models that
        implementation's loss term, for later ones the current one
Compared: the planner's total without its CUDA-context/fragmentation term ("allocated_equiv") vs
torch.cuda.max_memory_allocated() (which sees neither).
"""

from __future__ import annotations

import datetime as dt
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import lmstack_bench  # noqa: E402
import qlora_bench  # noqa: E402
import stage_bench  # noqa: E402
from make_assets import CONFIGS, qwen_config  # noqa: E402
from plan_accuracy import predict  # noqa: E402

from lmstack.memory import memory as plan_memory  # noqa: E402
from lmstack.memory import stage_memory  # noqa: E402

H200_GIB = 139.8


def config_only_assets(root: Path) -> None:
    for arch in CONFIGS:
        qwen_config(arch).save_pretrained(root / arch)
    (root / "data").mkdir(exist_ok=True)
    registry = {name: {"file_name": "synth.json"} for name in ("synth", "synth_pref", "synth_kto")}
    (root / "data" / "dataset_info.json").write_text(json.dumps(registry))
    (root / "data" / "synth.json").write_text(json.dumps([{"instruction": "a", "input": "", "output": "b"}]))


def local(cfg: dict, root: Path, arch: str) -> dict:
    return {
        **cfg,
        "model_name_or_path": str(root / arch),
        "dataset_dir": str(root / "data"),
        "output_dir": str(root / "o"),
    }


def from_speed(line: dict, root: Path) -> dict | None:
    if line.get("system") != "lmstack" or line.get("status") != "ok":
        return None
    cfg = {**lmstack_bench.COMMON, **line["settings"]}
    notes = " ".join(line.get("notes") or [])
    if line["method"] == "full" and "(float32," in notes:  # made before master_weights existed: classic AMP
        cfg["master_weights"] = "model"
    return dict(name=line["name"], cfg=local(cfg, root, line["model"]), gpus=1, fsdp=False,
                measured=line["peak_alloc_gib"])  # fmt: skip


def from_stages(line: dict, root: Path) -> dict | None:
    run = next((r for r in stage_bench.RUNS if r.name == line["name"]), None)
    if run is None or line.get("status") != "ok":
        return None
    cfg = {**stage_bench.BASE, **run.cfg, "max_steps": line.get("steps") or 20, "bf16": True}
    cfg.update((line.get("auto") or {}).get("resolved") or {})
    if run.method == "full" and (line.get("auto") or {}).get("used", {}).get("master_weights") != "optimizer":
        cfg["master_weights"] = "model"
    return dict(name=line["name"], cfg=local(cfg, root, run.arch), gpus=1, fsdp=False,
                measured=line["peak_alloc_gib"])  # fmt: skip


def from_qlora(line: dict, root: Path) -> dict | None:
    if not line.get("peak_allocated_gib"):
        return None
    cfg = {**qlora_bench.COMMON, **qlora_bench.RUNS[line["name"]], "max_steps": line.get("steps") or 20}
    return dict(name=f"qlora_{line['name']}", cfg=local(cfg, root, qlora_bench.ARCH), gpus=1, fsdp=False,
                measured=line["peak_allocated_gib"])  # fmt: skip


def from_distributed(line: dict, root: Path) -> dict | None:
    if line.get("status") != "ok" or "config" not in line:
        return None
    cfg = dict(line["config"])
    if (
        line["method"] == "full" and line["strategy"] == "ddp"
    ):  # older lines: made before master_weights existed
        cfg["master_weights"] = line.get("master_weights") or "model"
    return dict(name=line["name"], cfg=local(cfg, root, line["model"]), gpus=line["num_gpus"],
                fsdp=line["strategy"] == "fsdp", measured=line["peak_alloc_gib"])  # fmt: skip


def from_plan_runs(line: dict, root: Path) -> dict | None:
    if "measured_gib" not in line:
        return None
    arch = Path(line["config"]["model_name_or_path"]).name
    return dict(name=line["name"], cfg=local(line["config"], root, arch), gpus=1, fsdp=False,
                measured=line["measured_gib"])  # fmt: skip


READERS = {"speed": from_speed, "stages": from_stages, "qlora": from_qlora, "distributed": from_distributed,
           "plan_runs": from_plan_runs}  # fmt: skip


# (its fitted bytes stand for every case: it was never traced over checkpointed inputs alone)
OLD_CHUNKED_CE = {"LMSTACK_CE_CHUNK_TOKENS": 4096, "LMSTACK_CE_LIVE_CHUNKS": 2, "LMSTACK_CE_BYTES": 6,
                  "LMSTACK_CE_HEAD_BYTES": 4, "LMSTACK_CE_TRACED_BYTES": 6,
                  "LMSTACK_CE_SIDE_BYTES_PER_HIDDEN": 0}  # fmt: skip
CURRENT_CHUNKED_CE = {name: getattr(plan_memory, name) for name in OLD_CHUNKED_CE}


def chunked_ce_model(old: bool) -> None:
    """old: model the chunked CE the GPU runs before db98c1b ran (4096-token chunks, the previous
    chunk's tensors still alive while the next was computed); otherwise the current constants."""
    for name, value in (OLD_CHUNKED_CE if old else CURRENT_CHUNKED_CE).items():
        setattr(plan_memory, name, value)


# train/rlhf.load_frozen_model loads a frozen reference copy in the compute dtype since commit 28233d9 (its
# time); every run recorded before loaded it like the policy (fp32 under classic AMP)
FROZEN_COPY_IN_COMPUTE_DTYPE_SINCE = "2026-12-02T01:36:57+00:00"


def run_model(run: dict) -> None:
    """Model the code a recorded run ran: its chunked CE (`chunked_ce_model`) and how it loaded a frozen copy."""
    chunked_ce_model(run.get("chunked_ce_model", "current") != "current")
    date = run.get("run_date") or run.get("date") or ""
    stage_memory.REFERENCE_COPY_LIKE_THE_POLICY = date < FROZEN_COPY_IN_COMPUTE_DTYPE_SINCE


def current_model() -> None:
    """Today's code: the current chunked CE, the frozen copy in the compute dtype."""
    chunked_ce_model(False)
    stage_memory.REFERENCE_COPY_LIKE_THE_POLICY = False


def main(out: Path, files: list[Path], old_before: str | None = None) -> dict:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        config_only_assets(root)
        for path in files:
            kind = next(k for k in READERS if path.name.startswith(k))
            if path.suffix == ".json":  # bench/plan_accuracy.py's document: {"meta", "runs": [...]}
                lines = json.loads(path.read_text())["runs"]
            else:
                lines = [json.loads(t) for t in path.read_text().splitlines() if t.strip()]
            for line in lines:
                run = READERS[kind](line, root)
                if run is None:
                    continue
                old = bool(old_before) and (line.get("date") or line.get("run_date") or "") < old_before
                run_model({**line, "chunked_ce_model": "before db98c1b" if old else "current"})
                pred = predict(run["cfg"], H200_GIB, gpus=run["gpus"], fsdp=run["fsdp"])
                err = 100 * (pred["allocated_equiv"] - run["measured"]) / run["measured"]
                cfg = {k: v for k, v in run["cfg"].items() if k not in ("dataset_dir", "output_dir")}
                cfg["model_name_or_path"] = Path(cfg["model_name_or_path"]).name
                rows.append({"source": path.name, "name": run["name"], "num_gpus": run["gpus"],
                             "measured_gib": run["measured"], "predicted_gib": pred["allocated_equiv"],
                             "error_pct": round(err, 1), "predicted": pred, "config": cfg,
                             "run_date": line.get("date"), "gpu": line.get("gpu"),
                             "chunked_ce_model": "before db98c1b" if old else "current"})  # fmt: skip
    errs = sorted(abs(r["error_pct"]) for r in rows)
    mid = len(errs) // 2
    summary = {
        "n": len(errs),
        "median_abs_error_pct": (errs[mid] if len(errs) % 2 else (errs[mid - 1] + errs[mid]) / 2)
        if errs
        else None,
        "worst_abs_error_pct": errs[-1] if errs else None,
        "within_5_pct": sum(e <= 5 for e in errs),
        "within_15_pct": sum(e <= 15 for e in errs),
    }
    meta = {"computed": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "gpu_memory_gib": H200_GIB,
            "compared": "planner total minus its overhead term vs torch.cuda.max_memory_allocated()",
            "chunked_ce_model": {"current": CURRENT_CHUNKED_CE, "before db98c1b": OLD_CHUNKED_CE,
                                 "old_before": old_before}}  # fmt: skip
    out.write_text(json.dumps({"meta": meta, "summary": summary, "runs": rows}, indent=1))
    for r in rows:
        print(f"{r['name']:34s} gpus {r['num_gpus']} meas {r['measured_gib']:7.2f} pred {r['predicted_gib']:7.2f} "
              f"err {r['error_pct']:+6.1f}%")  # fmt: skip
    print("SUMMARY", json.dumps(summary))
    return summary


if __name__ == "__main__":
    argv = sys.argv[1:]
    before = None
    if "--old-chunked-ce-before" in argv:
        i = argv.index("--old-chunked-ce-before")
        before = argv[i + 1]
        del argv[i : i + 2]
    main(Path(argv[0]), [Path(p) for p in argv[1:]], before)
