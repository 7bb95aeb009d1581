"""PNG plots of a run directory (matplotlib, headless).

Each figure is a small declarative spec (:data:`FIGURES`): panels of metric keys from
``metrics.jsonl`` against the step. A figure is drawn when any of its keys has data, so the
staleness figure appears only for runs with partial rollouts, and a run that is still going gets
the figures its first steps allow. ``reward.png`` is always written (the trainer's end-of-run
plot). Each panel has a one-line caption for a newcomer, shown under its figure in
``report.html`` (:func:`figure_captions`). Y ranges are chosen, not zoomed to the data
(:func:`y_range`): fractions span 0 to 1, counts and sizes include 0, and an axis spans at
least a panel's ``min_span``. Every figure has the same pixel size, :data:`FIGURE_PX`; files are
written to a temporary name and renamed, so a viewer never sees half a PNG.
"""

from __future__ import annotations

import json
import logging
import os
import textwrap
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
    """A fraction: the y axis is 0 to 1 whatever the data."""
    from_zero: bool = False
    """A count or size: the y axis includes 0, so a steady value is a flat line, not noise."""
    min_span: float = 0.0
    """The y axis spans at least this much, so round-off is not magnified to fill the axes."""
    whole: bool = False
    """Whole numbers (episodes, groups): y ticks only at integers."""
    prefix_label: str = "{}"
    """How a key under ``prefix`` is labelled (``{}`` is the rest of the key)."""
    caption: str = ""
    """One line for a newcomer: what the panel shows and how to read it (under the plot)."""
    empty: str = "no data yet"
    """What the panel says when none of its keys has data."""


@dataclass(frozen=True, slots=True)
class Figure:
    """One PNG file of one or more panels side by side."""

    name: str
    title: str
    panels: tuple[Panel, ...]


FIGURES: tuple[Figure, ...] = (
    Figure(
        "reward",
        "Reward and success",
        (
            Panel(
                "mean reward per episode",
                (("rollout/reward_mean", "training episodes"), ("eval/reward_mean", "held-out")),
                ylabel="reward",
                from_zero=True,
                min_span=0.1,
                caption="The env's reward, averaged over episodes. Training episodes sample at "
                "rollout.temperature; held-out tasks are evaluated at train.eval_temperature "
                "(0: greedy) and are the number to trust.",
            ),
            Panel(
                "success rate",
                (("rollout/success_rate", "training episodes"), ("eval/success_rate", "held-out")),
                unit_range=True,
                ylabel="fraction of episodes",
                caption="Fraction of episodes whose reward reached the success threshold.",
            ),
        ),
    ),
    Figure(
        "clipping",
        "Clipping and ratios",
        (
            Panel(
                "clip fraction",
                (("loss/clip_frac_tokens", "tokens"), ("loss/clip_frac_seqs", "sequences")),
                unit_range=True,
                ylabel="fraction",
                caption="Share of tokens (sequences) whose probability moved past the clip range "
                "(learner.eps_low/eps_high) and so gave no gradient; near 1, the updates are "
                "too big for it.",
            ),
            Panel(
                "importance ratio",
                (("loss/ratio_mean", "mean"), ("loss/ratio_min", "min"), ("loss/ratio_max", "max")),
                min_span=0.05,
                ylabel="new / old probability",
                caption="A token's probability under the weights being updated over the one it "
                "was sampled with; 1 means the policy has not moved since.",
            ),
            Panel(
                "grad norm",
                (("loss/grad_norm", "mean"), ("loss/grad_norm_max", "max")),
                from_zero=True,
                caption="Size of the gradient before it is clipped to learner.grad_clip; "
                "spikes mark unstable updates.",
            ),
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
                ylabel="|log-prob difference|",
                caption="Same weights, same tokens: the trainer's and the inference engine's "
                "log-probs differ only by kernels and dtype (~1e-6 in float32); large means a bug.",
            ),
            Panel(
                "policy lag, per token |diff|",
                (("mismatch/lag_mean_abs", "mean"), ("mismatch/lag_max_abs", "max")),
                log_y=True,
                caption="The same difference for tokens sampled by older weights (overlapped "
                "loop, train.max_staleness >= 1): expected, the policy moved.",
                empty="none: every token was sampled by the weights being trained",
            ),
            Panel(
                "sequence mean log-ratio",
                (
                    ("mismatch/seq_log_ratio_mean", "mean"),
                    ("mismatch/seq_log_ratio_abs_max", "|max|"),
                ),
                from_zero=True,
                caption="Trainer minus engine log-prob averaged over each episode's tokens; "
                "near 0 means they agree on whole episodes.",
            ),
        ),
    ),
    Figure(
        "lengths",
        "Episode length",
        (
            Panel(
                "response tokens",
                (("rollout/response_len_mean", "mean"),),
                ylabel="tokens",
                from_zero=True,
                min_span=1.0,
                caption="Tokens the model wrote per episode (all its turns), mean over the "
                "step's episodes.",
            ),
            Panel(
                "turns",
                (("rollout/turns_mean", "mean"),),
                ylabel="turns",
                from_zero=True,
                min_span=1.0,
                caption="Assistant turns per episode, mean over the step's episodes; at most "
                "rollout.max_turns.",
            ),
        ),
    ),
    Figure(
        "outcomes",
        "How episodes ended",
        (
            Panel(
                "fraction of episodes",
                (("rollout/success_rate", "solved"), ("rollout/truncated_frac", "truncated")),
                unit_range=True,
                ylabel="fraction of episodes",
                caption="Solved: reward reached the success threshold. Truncated: cut off by "
                "rollout.max_turns or a token limit before the env ended the episode.",
            ),
            Panel(
                "failed episodes",
                (("rollout/failed", "all causes"),),
                prefix="rollout/failed_",
                ylabel="episodes per step",
                from_zero=True,
                whole=True,
                min_span=1.0,
                caption="Episodes lost to an error (env exception, timeout, server) and not "
                "trained on; any at all is a bug to fix: see the episode's error below.",
            ),
            Panel(
                "groups with no learning signal",
                (("rollout/zero_signal_groups", "groups"),),
                ylabel="groups per step",
                from_zero=True,
                whole=True,
                min_span=1.0,
                caption="Groups whose episodes all got the same reward: zero advantage, nothing "
                "to learn; tasks too easy or too hard (docs/envs.md).",
            ),
        ),
    ),
    Figure(
        "speed",
        "Throughput and time per phase",
        (
            Panel(
                "learner throughput",
                (("perf/tokens_per_s", "tokens/s"),),
                ylabel="tokens/s",
                from_zero=True,
                caption="Tokens per second through the learner's forward and backward passes.",
            ),
            Panel(
                "seconds per step",
                (
                    ("time/rollout_s", "rollout"),
                    ("time/train_s", "train"),
                    ("time/sync_s", "weight sync"),
                    ("time/step_s", "step"),
                ),
                ylabel="s",
                from_zero=True,
                caption="Wall time of a step and its phases: generating episodes, training, "
                "pushing the new weights to the engine.",
            ),
        ),
    ),
    Figure(
        "staleness",
        "Staleness (overlapped loop, partial rollouts)",
        (
            Panel(
                "versions behind",
                (
                    ("staleness/max", "oldest token"),
                    ("staleness/version_spread", "versions in the batch - 1"),
                ),
                ylabel="weight versions",
                from_zero=True,
                whole=True,
                min_span=1.0,
                caption="Staleness: how many weight updates behind the learner the batch's "
                "oldest token was sampled; at most train.max_staleness.",
            ),
            Panel(
                "partial rollouts",
                (
                    ("staleness/interrupted_episodes", "episodes interrupted"),
                    ("staleness/resumed_episodes", "episodes resumed"),
                    ("staleness/due_groups", "groups the step waited for"),
                ),
                ylabel="per step",
                from_zero=True,
                whole=True,
                min_span=1.0,
                caption="Episodes paused at a weight push and resumed on the new weights, and "
                "groups the step had to wait for.",
            ),
            Panel(
                "trained tokens by age",
                (("staleness/old_token_frac", "older than the learner"),),
                prefix="staleness/hist_",
                prefix_label="{} versions old",
                unit_range=True,
                ylabel="fraction of tokens",
                caption="A token's age is the learner's version minus the version that sampled "
                "it; 0 versions old is on-policy.",
            ),
        ),
    ),
)


def figure_captions(name: str) -> list[tuple[str, str]]:
    """``(panel title, caption)`` of each panel of the figure called ``name`` (``[]``: none)."""
    for figure in FIGURES:
        if figure.name == name:
            return [(p.title, p.caption) for p in figure.panels]
    return []


def y_range(panel: Panel, ys: list[float]) -> tuple[float, float] | None:
    """The y limits of a linear panel with these values; ``None`` leaves them to matplotlib.

    A fraction spans 0 to 1; a count includes 0; any axis spans at least ``min_span``, centred
    on the data, so that 1.98 to 2.00 is not drawn across the whole height. A 5% margin is kept.
    """
    if panel.unit_range:
        return -0.02, 1.02
    if panel.log_y or not ys:
        return None
    lo, hi = min(ys), max(ys)
    if panel.from_zero:
        lo, hi = min(lo, 0.0), max(hi, 0.0)
    if hi - lo < panel.min_span:
        mid = (lo + hi) / 2
        lo, hi = mid - panel.min_span / 2, mid + panel.min_span / 2
        if panel.from_zero and min(ys) >= 0 and lo < 0:  # a non-negative count stays >= 0
            lo, hi = 0.0, panel.min_span
    if hi == lo:
        return None
    pad = 0.05 * (hi - lo)
    return lo - pad, hi + pad


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
    fixed = {k for k, _ in panel.series}
    out = []
    for key, label in pairs:
        pts = [
            (int(r["step"]), float(r[key]))
            for r in records
            if isinstance(r.get(key), int | float) and "step" in r
        ]
        # a key found by prefix that is 0 throughout (a failure cause that never happened)
        # only crowds the legend
        if pts and (key in fixed or any(y != 0 for _, y in pts)):
            out.append((label, pts))
    return out


def _draw_panel(ax: Any, panel: Panel, data: list[tuple[str, list[tuple[int, float]]]]) -> None:
    for label, pts in data:
        xs, ys = zip(*pts, strict=True)
        sparse = len(pts) <= 2 or label.startswith("held-out")
        ax.plot(xs, ys, marker="o" if sparse else None, markersize=4, label=label)
    if panel.log_y and any(y > 0 for _, pts in data for _, y in pts):
        ax.set_yscale("log")
    limits = y_range(panel, [y for _, pts in data for _, y in pts])
    if limits is not None:
        ax.set_ylim(*limits)
    ax.set_title(panel.title, fontsize=10)
    ax.set_xlabel("step")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if panel.whole:
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    if panel.ylabel:
        ax.set_ylabel(panel.ylabel)
    ax.grid(alpha=0.3)
    if data:
        ax.legend(fontsize=8, loc="best")
    else:
        note = textwrap.fill(panel.empty, width=24)
        ax.text(0.5, 0.5, note, ha="center", va="center", transform=ax.transAxes, fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])


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
        fig.tight_layout()
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
