"""training_<key>.png from trainer_state.json (raw curve + EMA-smoothed curve), like LF's plot_loss."""

from __future__ import annotations

import json
import math
from pathlib import Path


def smooth(values: list[float], weight: float | None = None) -> list[float]:
    if not values:
        return []
    if weight is None:  # stronger smoothing for longer curves
        weight = 1.8 * (1 / (1 + math.exp(-0.05 * len(values))) - 0.5)
    out, last = [], values[0]
    for v in values:
        last = last * weight + (1 - weight) * v
        out.append(last)
    return out


def plot_metrics(output_dir: str | Path, keys: list[str]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(output_dir)
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    written = []
    for key in keys:
        points = [(h["step"], h[key]) for h in history if key in h and isinstance(h[key], int | float)]
        if not points:
            continue
        steps, values = zip(*points)
        fig = plt.figure(figsize=(6, 4))
        plt.plot(steps, values, color="#1f77b4", alpha=0.4, label="original")
        plt.plot(steps, smooth(list(values)), color="#1f77b4", label="smoothed")
        plt.title(f"training {key} of {out}")
        plt.xlabel("step")
        plt.ylabel(key)
        plt.legend()
        path = out / f"training_{key.replace('/', '_')}.png"
        plt.savefig(path, format="png", dpi=100)
        plt.close(fig)
        written.append(path)
    return written
