"""PNG plots of a run directory (matplotlib, headless)."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen first


def read_metrics(run_dir: str | Path) -> list[dict[str, float]]:
    """The records of ``metrics.jsonl`` (an empty list when there is none yet)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(ln) for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]


def plot_run(run_dir: str | Path) -> Path:
    """Write ``reward.png``: training reward/success per step and held-out success."""
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    for key, label in [("rollout/reward_mean", "train reward"),
                       ("rollout/success_rate", "train success"),
                       ("eval/success_rate", "held-out success")]:
        pts = [(r["step"], r[key]) for r in records if key in r]
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, marker="o" if key.startswith("eval") else None, label=label)
    ax.set_xlabel("step")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(run_dir.name)
    out = run_dir / "reward.png"
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
