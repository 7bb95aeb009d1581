"""``agentrl report RUN_DIR``: one self-contained HTML page of a run, plus its PNG plots.

The page (``RUN_DIR/report.html``) embeds everything it shows: the plots as base64 PNGs, the
trajectories as JSON, and vanilla JavaScript for the trajectory browser, so it opens from disk
with no server and makes no network request. It reads what the trainer writes: ``metrics.jsonl``,
``trajectories.jsonl`` (per-token advantages and trainer log-probs next to each trained-on
trajectory), ``config.yaml`` and ``summary.json``. A run that is still going works too: a last
line being written is skipped, trajectories of a step whose metrics are not logged yet wait for
the next refresh (the trainer logs a step after writing its trajectories), and re-running the
command refreshes the page (each file is written under a temporary name and renamed).

Which trajectories are embedded (large runs): trajectories form groups (the consecutive records
of one task at one step). Groups are taken round-robin over the steps, newest step first: the
first group of every step, then the second group of every step, and so on, until the next group
would pass ``max_trajectories`` trajectories or ``max_bytes`` bytes of ``trajectories.jsonl``.
Groups are never split, so every shown group has all its rewards and advantages. The page states
how many trajectories, groups and steps it shows out of how many. ``steps`` restricts the choice
to some steps (for example to see all of one step's groups).

Token text comes from the run's tokenizer: a tokenizer saved beside the weights in the run
directory, else ``model.path`` of the config (``tiny`` builds the local one); each id is decoded
on its own. Without a tokenizer the page shows ids.
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import os
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from agentrl.report.chips import summary_chips
from agentrl.report.page import episode_payload, render_page
from agentrl.report.plots import plot_all, read_jsonl

log = logging.getLogger(__name__)

DEFAULT_MAX_TRAJECTORIES = 2000
DEFAULT_MAX_BYTES = 48 * 2**20
REPORT_NAME = "report.html"

_STEP = re.compile(rb'^\{"step":\s*(-?\d+)')
_TASK = re.compile(rb'"task_id":\s*"((?:[^"\\]|\\.)*)"')
_INDEX = re.compile(rb'"group_index":\s*(\d+)')


@dataclass(frozen=True, slots=True)
class _LineRef:
    """Where one record of ``trajectories.jsonl`` is, and which group it belongs to."""

    offset: int
    length: int
    step: int
    task_id: str
    group_index: int


def _parse_ref(line: bytes, offset: int) -> _LineRef | None:
    step, task, index = _STEP.search(line), _TASK.search(line), _INDEX.search(line)
    if step and task and index:  # the trainer's key order: read the keys without parsing it all
        task_id = json.loads(b'"' + task.group(1) + b'"')
        return _LineRef(offset, len(line), int(step.group(1)), task_id, int(index.group(1)))
    try:
        rec = json.loads(line)
        traj = rec["trajectory"]
        return _LineRef(
            offset,
            len(line),
            int(rec["step"]),
            str(traj["task_id"]),
            int(traj.get("group_index", 0)),
        )
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        return None


def scan_groups(path: Path) -> tuple[list[list[_LineRef]], int]:
    """The groups of a trajectories file, in file order, and the number of unreadable lines.

    A group is a run of consecutive records with the same step and task whose group index
    increases. A last line without its newline (still being written) is ignored.
    """
    groups: list[list[_LineRef]] = []
    bad = 0
    if not path.exists():
        return groups, bad
    with path.open("rb") as f:
        offset = 0
        for line in f:
            ref = _parse_ref(line, offset) if line.endswith(b"\n") and line.strip() else None
            offset += len(line)
            if ref is None:
                bad += int(line.endswith(b"\n") and bool(line.strip()))
                continue
            last = groups[-1][-1] if groups else None
            if (
                last is None
                or (last.step, last.task_id) != (ref.step, ref.task_id)
                or ref.group_index <= last.group_index
            ):
                groups.append([])
            groups[-1].append(ref)
    return groups, bad


def select_groups(
    groups: Sequence[list[_LineRef]],
    *,
    max_trajectories: int,
    max_bytes: int,
    steps: Iterable[int] | None = None,
) -> list[list[_LineRef]]:
    """Whole groups, round-robin over steps newest first, within both budgets (module docs)."""
    wanted = None if steps is None else set(steps)
    by_step: dict[int, list[list[_LineRef]]] = {}
    for g in groups:
        if wanted is None or g[0].step in wanted:
            by_step.setdefault(g[0].step, []).append(g)
    order = sorted(by_step, reverse=True)
    chosen: list[list[_LineRef]] = []
    n_traj = n_bytes = 0
    for rank in range(max((len(v) for v in by_step.values()), default=0)):
        for step in order:
            if rank >= len(by_step[step]):
                continue
            g = by_step[step][rank]
            size = sum(r.length for r in g)
            if chosen and (n_traj + len(g) > max_trajectories or n_bytes + size > max_bytes):
                return chosen
            chosen.append(g)
            n_traj, n_bytes = n_traj + len(g), n_bytes + size
    return chosen


def load_tokenizer(run_dir: Path, model_path: str | None) -> Any | None:
    """The run's tokenizer: one saved in the run directory, else ``model_path``; else ``None``."""
    saved = sorted(run_dir.glob("**/tokenizer_config.json"), key=lambda p: p.stat().st_mtime)
    try:
        if saved:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(str(saved[-1].parent))
        from agentrl.tiny import PRESETS, build_tiny_tokenizer

        if model_path in PRESETS:
            return build_tiny_tokenizer()
        if model_path:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError, ImportError) as e:
        log.warning("no tokenizer for the report (%s); showing token ids", e)
    return None


def token_texts(tokenizer: Any | None, ids: Iterable[int]) -> dict[int, str]:
    """Each id decoded on its own (``<id>`` where there is no tokenizer or no text)."""
    out: dict[int, str] = {}
    for i in sorted(set(ids)):
        text = tokenizer.decode([i]) if tokenizer is not None else ""
        out[i] = text if text else f"<{i}>"
    return out


def _read_groups(path: Path, groups: list[list[_LineRef]]) -> list[dict[str, Any]]:
    out = []
    with path.open("rb") as f:
        for g in groups:
            episodes = []
            for ref in g:
                f.seek(ref.offset)
                try:
                    episodes.append(episode_payload(json.loads(f.read(ref.length))))
                except (json.JSONDecodeError, KeyError, ValidationError) as e:
                    log.warning("%s: skipping a trajectory at byte %d: %s", path, ref.offset, e)
            if episodes:
                out.append({"step": g[0].step, "task_id": g[0].task_id, "episodes": episodes})
    return out


def _sampling_note(
    groups: list[list[_LineRef]],
    chosen: list[list[_LineRef]],
    pending: list[list[_LineRef]],
    bad: int,
    max_trajectories: int,
    max_bytes: int,
) -> dict[str, Any]:
    total = sum(len(g) for g in groups)
    shown = sum(len(g) for g in chosen)
    return {
        "pending_trajectories": sum(len(g) for g in pending),
        "total_trajectories": total,
        "total_groups": len(groups),
        "total_steps": len({g[0].step for g in groups}),
        "shown_trajectories": shown,
        "shown_groups": len(chosen),
        "shown_steps": len({g[0].step for g in chosen}),
        "unreadable_lines": bad,
        "rule": (
            f"whole groups, round-robin over steps newest first (the first group of every "
            f"step, then the second, ...), at most {max_trajectories} trajectories and "
            f"{max_bytes / 2**20:.0f} MiB of trajectories.jsonl"
        ),
    }


def collect_report_data(
    run_dir: str | Path,
    *,
    max_trajectories: int = DEFAULT_MAX_TRAJECTORIES,
    max_bytes: int = DEFAULT_MAX_BYTES,
    steps: Iterable[int] | None = None,
) -> dict[str, Any]:
    """Everything the page embeds as JSON (the trajectory browser's data and the run's facts)."""
    run_dir = Path(run_dir)
    config_path = run_dir / "config.yaml"
    config_text = config_path.read_text(encoding="utf-8") if config_path.exists() else ""
    config = yaml.safe_load(config_text) if config_text else {}
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    last_step = max((int(r.get("step", 0)) for r in metrics), default=None)
    traj_path = run_dir / "trajectories.jsonl"
    groups, bad = scan_groups(traj_path)
    # The trainer logs a step's metrics after writing its trajectories: a step without its
    # metrics record may still be half written, so it waits for the next refresh.
    pending = [g for g in groups if last_step is not None and g[0].step > last_step]
    groups = [g for g in groups if last_step is None or g[0].step <= last_step]
    chosen = select_groups(
        groups, max_trajectories=max_trajectories, max_bytes=max_bytes, steps=steps
    )
    shown = _read_groups(traj_path, chosen) if chosen else []
    model_path = (config.get("model") or {}).get("path") if isinstance(config, dict) else None
    tokenizer = load_tokenizer(run_dir, model_path) if shown else None
    ids = (i for g in shown for e in g["episodes"] for i in e["ids"])
    return {
        "run": {
            "name": run_dir.name,
            "dir": str(run_dir.resolve()),
            "summary": summary,
            "chips": summary_chips(summary if isinstance(summary, dict) else None),
            "in_progress": summary is None,
            "config_text": config_text,
            "generated_at": time.strftime("%Y-%m-%d %H:%M:%S"),
            "last_step": last_step,
            "last_metrics": metrics[-1] if metrics else None,
        },
        "sampling": _sampling_note(groups, chosen, pending, bad, max_trajectories, max_bytes),
        "tokenizer": type(tokenizer).__name__ if tokenizer is not None else None,
        "vocab": {str(k): v for k, v in token_texts(tokenizer, ids).items()},
        "groups": shown,
    }


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def build_report(
    run_dir: str | Path,
    *,
    max_trajectories: int = DEFAULT_MAX_TRAJECTORIES,
    max_bytes: int = DEFAULT_MAX_BYTES,
    steps: Iterable[int] | None = None,
) -> Path:
    """Write the PNG plots and ``report.html`` into a run directory; returns the HTML's path.

    Args:
        run_dir: a directory written by ``agentrl train`` (finished or still running).
        max_trajectories: at most this many trajectories are embedded (whole groups).
        max_bytes: at most this many bytes of ``trajectories.jsonl`` are embedded.
        steps: embed only groups of these steps (``None``: any step).

    Raises:
        FileNotFoundError: ``run_dir`` has neither ``metrics.jsonl`` nor ``trajectories.jsonl``.
    """
    run_dir = Path(run_dir)
    if max_trajectories < 1 or max_bytes < 1:
        raise ValueError(
            f"expected positive budgets, got max_trajectories={max_trajectories}, "
            f"max_bytes={max_bytes}"
        )
    if not any((run_dir / n).exists() for n in ("metrics.jsonl", "trajectories.jsonl")):
        raise FileNotFoundError(f"expected a run directory with metrics.jsonl, got {run_dir}")
    plots = [(p.name, base64.b64encode(p.read_bytes()).decode("ascii")) for p in plot_all(run_dir)]
    data = collect_report_data(
        run_dir, max_trajectories=max_trajectories, max_bytes=max_bytes, steps=steps
    )
    out = run_dir / REPORT_NAME
    _write_atomic(out, render_page(data, plots))
    log.info(
        "report: %s (%d plots, %d of %d trajectories)",
        out,
        len(plots),
        data["sampling"]["shown_trajectories"],
        data["sampling"]["total_trajectories"],
    )
    return out


def _steps_arg(text: str) -> list[int]:
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated steps, got {text!r}") from None


def add_report_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Declare ``agentrl report RUN_DIR`` on the ``agentrl`` command's subparsers."""
    parser = subparsers.add_parser(
        "report",
        help="write a self-contained HTML report and PNG plots into a run directory",
        description=(
            "Write RUN_DIR/report.html (one file: plots and a trajectory browser, no network "
            "needed to view it) and the PNG plots. Works while the run is going; re-run to "
            "refresh. Large runs embed whole groups, round-robin over steps newest first, "
            "within --max-trajectories and --max-mb."
        ),
    )
    parser.add_argument("run_dir", help="the run directory (with metrics.jsonl)")
    parser.add_argument(
        "--max-trajectories",
        type=int,
        default=DEFAULT_MAX_TRAJECTORIES,
        help=f"most trajectories embedded (default {DEFAULT_MAX_TRAJECTORIES})",
    )
    parser.add_argument(
        "--max-mb",
        type=float,
        default=DEFAULT_MAX_BYTES / 2**20,
        help="most MiB of trajectories.jsonl embedded (default %(default)s)",
    )
    parser.add_argument(
        "--steps",
        type=_steps_arg,
        default=None,
        help="only these steps, comma-separated (e.g. 1,50,100)",
    )
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    parser.set_defaults(func=run_report_command)


def run_report_command(args: argparse.Namespace) -> int:
    """Run ``agentrl report`` from parsed arguments; returns the exit code."""
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        path = build_report(
            args.run_dir,
            max_trajectories=args.max_trajectories,
            max_bytes=int(args.max_mb * 2**20),
            steps=args.steps,
        )
    except (FileNotFoundError, ValueError) as e:
        log.error("%s", e)
        return 1
    print(path)  # the command's output: the page to open
    return 0
