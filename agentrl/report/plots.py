"""PNG plots of a run directory (matplotlib, headless).

Each figure is a small declarative spec (:data:`FIGURES`): panels of metric keys from
``metrics.jsonl`` against the step. A figure is drawn when any of its keys has data, so the
staleness figure appears only for runs with partial rollouts, and a run that is still going gets
the figures its first steps allow. ``reward.png`` is always written (the trainer's end-of-run
plot). Every figure has the same pixel size, :data:`FIGURE_PX`; files are written to a temporary
name and renamed, so a viewer never sees half a PNG.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_DPI = 100
FIGURE_PX = (900, 400)
"""Width and height in pixels of every PNG written here."""


@dataclass(frozen=True, slots=True)
class Panel:
    """One axes: ``series`` are ``(metric key, label)`` pairs; ``prefix`` adds all keys under it."""

    title: str
    series: tuple[tuple[str, str], ...] = ()
    prefix: str | None = None
    ylabel: str = ""
    log_y: bool = False
    unit_range: bool = False
    prefix_label: str = "{}"
    """How a key under ``prefix`` is labelled (``{}`` is the rest of the key)."""


@dataclass(frozen=True, slots=True)
class Figure:
    """One PNG file of one or more panels side by side."""

    name: str
    title: str
    panels: tuple[Panel, ...]
    caption: str = ""
    """One line under the panels that says how to read them."""


FIGURES: tuple[Figure, ...] = (
    Figure(
        "reward",
        "Reward and success",
        (
            Panel(
                "mean reward per episode",
                (("rollout/reward_mean", "training episodes"), ("eval/reward_mean", "held-out")),
                ylabel="reward",
            ),
            Panel(
                "success rate",
                (("rollout/success_rate", "training episodes"), ("eval/success_rate", "held-out")),
                unit_range=True,
                ylabel="fraction of episodes",
            ),
        ),
        "Training episodes sample at rollout.temperature; held-out ones at "
        "train.eval_temperature (0: greedy).",
    ),
    Figure(
        "clipping",
        "Clipping and ratios",
        (
            Panel(
                "clip fraction",
                (("loss/clip_frac_tokens", "tokens"), ("loss/clip_frac_seqs", "sequences")),
                unit_range=True,
            ),
            Panel(
                "importance ratio",
                (("loss/ratio_mean", "mean"), ("loss/ratio_min", "min"), ("loss/ratio_max", "max")),
            ),
            Panel("grad norm", (("loss/grad_norm", "mean"), ("loss/grad_norm_max", "max"))),
        ),
    ),
    Figure(
        "mismatch",
        "Engine vs trainer log-probs (trainer - engine)",
        (
            Panel(
                "numeric mismatch, per token |diff|",
                (("mismatch/numeric_mean_abs", "mean"), ("mismatch/numeric_max_abs", "max")),
                log_y=True,
            ),
            Panel(
                "policy lag, per token |diff|",
                (("mismatch/lag_mean_abs", "mean"), ("mismatch/lag_max_abs", "max")),
                log_y=True,
            ),
            Panel(
                "sequence mean log-ratio",
                (
                    ("mismatch/seq_log_ratio_mean", "mean"),
                    ("mismatch/seq_log_ratio_abs_max", "|max|"),
                ),
            ),
        ),
        "Numeric: tokens sampled by the weights being trained (kernels, dtype; ~1e-6 in float32). "
        "Lag: tokens from older weights (overlapped loop), expected.",
    ),
    Figure(
        "lengths",
        "Episodes",
        (
            Panel("response tokens", (("rollout/response_len_mean", "mean"),), ylabel="tokens"),
            Panel("turns", (("rollout/turns_mean", "mean"),), ylabel="turns"),
            Panel(
                "outcomes",
                (
                    ("rollout/truncated_frac", "truncated"),
                    ("rollout/failed", "failed"),
                    ("rollout/zero_signal_groups", "zero-signal groups"),
                ),
            ),
        ),
    ),
    Figure(
        "speed",
        "Throughput and time per phase",
        (
            Panel("learner throughput", (("perf/tokens_per_s", "tokens/s"),), ylabel="tokens/s"),
            Panel(
                "seconds per step",
                (
                    ("time/rollout_s", "rollout"),
                    ("time/train_s", "train"),
                    ("time/sync_s", "weight sync"),
                    ("time/step_s", "step"),
                ),
                ylabel="s",
            ),
        ),
    ),
    Figure(
        "staleness",
        "Staleness (overlapped loop, partial rollouts)",
        (
            Panel(
                "per step",
                (
                    ("staleness/max", "oldest token (versions behind)"),
                    ("staleness/version_spread", "versions in the batch - 1"),
                    ("staleness/interrupted_episodes", "episodes interrupted"),
                    ("staleness/resumed_episodes", "episodes resumed"),
                    ("staleness/due_groups", "groups the step waited for"),
                ),
                ylabel="count",
            ),
            Panel(
                "trained tokens by age",
                (("staleness/old_token_frac", "older than the learner"),),
                prefix="staleness/hist_",
                prefix_label="{} versions old",
                unit_range=True,
                ylabel="fraction of tokens",
            ),
        ),
        "A token's age is the learner's version minus the version that sampled it.",
    ),
)


def _pyplot() -> Any:
    """Matplotlib's pyplot on the headless backend, imported on first use (it takes ~0.5 s)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL file, tolerating a run that is still writing it.

    A missing file gives ``[]``; a last line without its newline (being written) and lines that
    do not parse are skipped (the latter with a warning).
    """
    path = Path(path)
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    records: list[dict[str, Any]] = []
    for i, line in enumerate(lines[:-1]):  # the part after the last "\n" is incomplete
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            log.warning("%s:%d: skipping a line that is not JSON", path, i + 1)
    return records


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of ``metrics.jsonl`` (an empty list when there is none yet)."""
    return read_jsonl(Path(run_dir) / "metrics.jsonl")


def _series(
    records: list[dict[str, Any]], panel: Panel
) -> list[tuple[str, list[tuple[int, float]]]]:
    pairs = list(panel.series)
    if panel.prefix is not None:
        keys = sorted({k for r in records for k in r if k.startswith(panel.prefix)})
        pairs += [(k, panel.prefix_label.format(k.removeprefix(panel.prefix))) for k in keys]
    out = []
    for key, label in pairs:
        pts = [
            (int(r["step"]), float(r[key]))
            for r in records
            if isinstance(r.get(key), int | float) and "step" in r
        ]
        if pts:
            out.append((label, pts))
    return out


def _draw_panel(ax: Any, panel: Panel, data: list[tuple[str, list[tuple[int, float]]]]) -> None:
    for label, pts in data:
        xs, ys = zip(*pts, strict=True)
        sparse = len(pts) <= 2 or label.startswith("held-out")
        ax.plot(xs, ys, marker="o" if sparse else None, markersize=4, label=label)
    if panel.log_y and any(y > 0 for _, pts in data for _, y in pts):
        ax.set_yscale("log")
    if panel.unit_range:
        ax.set_ylim(-0.02, 1.02)
    ax.set_title(panel.title, fontsize=10)
    ax.set_xlabel("step")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if panel.ylabel:
        ax.set_ylabel(panel.ylabel)
    ax.grid(alpha=0.3)
    if data:
        ax.legend(fontsize=8, loc="best")
    else:
        ax.text(0.5, 0.5, "no data yet", ha="center", va="center", transform=ax.transAxes)


def _save(fig: Any, out: Path) -> None:
    tmp = out.with_name(f".{out.name}.tmp")
    fig.savefig(tmp, format="png", dpi=_DPI)
    os.replace(tmp, out)


def draw_figure(
    records: list[dict[str, Any]], figure: Figure, out_dir: Path, *, force: bool = False
) -> Path | None:
    """Write ``<figure.name>.png`` into ``out_dir``; ``None`` (nothing written) without data.

    Args:
        records: metric records (``step`` plus namespaced keys).
        figure: what to draw.
        out_dir: the directory to write into.
        force: write the figure even when none of its keys has data yet.
    """
    data = [_series(records, p) for p in figure.panels]
    if not force and not any(data):
        return None
    w, h = FIGURE_PX
    plt = _pyplot()
    fig, axes = plt.subplots(
        1, len(figure.panels), figsize=(w / _DPI, h / _DPI), dpi=_DPI, squeeze=False
    )
    try:
        for ax, panel, series in zip(axes[0], figure.panels, data, strict=True):
            _draw_panel(ax, panel, series)
        fig.suptitle(figure.title, fontsize=11)
        if figure.caption:
            fig.text(0.5, 0.01, figure.caption, ha="center", va="bottom", fontsize=8)
        fig.tight_layout(rect=(0, 0.05 if figure.caption else 0, 1, 1))
        out = out_dir / f"{figure.name}.png"
        _save(fig, out)
    finally:
        plt.close(fig)
    return out


def plot_all(run_dir: str | Path) -> list[Path]:
    """Write every figure that has data (``reward.png`` always); returns the files in order."""
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    written = []
    for figure in FIGURES:
        path = draw_figure(records, figure, run_dir, force=figure.name == "reward")
        if path is not None:
            written.append(path)
    return written


def plot_run(run_dir: str | Path) -> Path:
    """Write the run's PNG plots (:func:`plot_all`); returns the path of ``reward.png``."""
    plot_all(run_dir)
    return Path(run_dir) / "reward.png"
