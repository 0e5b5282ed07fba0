"""bench/fp8_parity.py's verdict (issue 19): FP8 passes when its final loss is within 0.5% of bf16's and its
smoothed curve within 1% after warm-up -- and only on a curve that learns (two flat curves always agree)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from fp8_parity import compare  # noqa: E402


def falling(n: int = 200, start: float = 10.0, end: float = 6.0) -> list[float]:
    return [start + (end - start) * i / (n - 1) for i in range(n)]


def test_equal_learning_curves_pass_and_report_how_far_the_loss_fell():
    got = compare(falling(), falling())
    assert got["pass"] and got["final_rel_diff"] == 0 and got["max_curve_rel_diff_after_warmup"] == 0
    assert got["bf16_loss_drop_after_warmup"] > 0.3


def test_a_curve_off_by_more_than_the_tolerance_fails():
    fp8 = [x * 1.02 for x in falling()]  # 2% above everywhere: final and curve both out
    got = compare(falling(), fp8)
    assert not got["pass"] and got["final_rel_diff"] > 0.005 and got["max_curve_rel_diff_after_warmup"] > 0.01
    late = falling()[:150] + [x * 1.015 for x in falling()[150:]]  # apart only late in the run
    assert not compare(falling(), late)["pass"]


def test_two_flat_curves_are_not_a_pass():
    flat = [11.93 + 0.001 * (i % 3) for i in range(200)]
    got = compare(flat, list(flat))
    assert got["final_rel_diff"] == 0 and not got["pass"]
    assert got["bf16_loss_drop_after_warmup"] < 0.01


def test_too_few_steps_is_said():
    got = compare(falling(20), falling(20))
    assert not got["pass"] and got["reason"] == "too few logged steps"
