"""`lmstack train --strict` means what `lmstack check --strict` means: a record the data pipeline would
drop (a bad JSON line, a missing field, ...) fails the run instead of a warning, before the model loads
and before output_dir is written; `strict: true` in the YAML is the same switch."""

from __future__ import annotations

from pathlib import Path

import yaml

from cli_run import lmstack

REPO = Path(__file__).resolve().parents[2]
BAD = REPO / "tests" / "fixtures" / "bad_data"




def test_train_strict_refuses_data_with_a_bad_json_line(base_cfg, tmp_path):
    out = tmp_path / "out"
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {**base_cfg, "dataset": "bad_sharegpt", "dataset_dir": str(BAD), "output_dir": str(out)}
        )
    )
    done = lmstack("train", str(cfg), "--strict", cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "error: strict: " in done.stderr and "record(s) would be dropped from the data" in done.stderr
    assert f"{BAD / 'bad_sharegpt.jsonl'} line 2: " in done.stderr  # the broken JSON line, by file and line
    assert "Loading weights" not in done.stderr and "Traceback" not in done.stderr
    assert not out.exists()
    checked = lmstack("check", str(cfg), "strict=true", cwd=tmp_path)  # the YAML field, for check too
    assert checked.returncode == 1 and "--strict:" in checked.stderr
    lenient = lmstack("train", str(cfg), "max_steps=1", cwd=tmp_path)  # without it: dropped with a warning
    assert lenient.returncode == 0, lenient.stderr[-3000:]
    assert "bad_sharegpt.jsonl line 2" in lenient.stderr


def test_strict_data_trains_when_nothing_is_dropped(base_cfg, tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({**base_cfg, "max_steps": 1}))
    done = lmstack("train", str(cfg), "--strict", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (Path(base_cfg["output_dir"]) / "adapter_model.safetensors").is_file()
