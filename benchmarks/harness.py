"""The scaffolding the benchmarks share, so each script reads as its recipe.

- the arguments most scripts take (``add_common_args``: ``--warmup``, ``--repeats``);
- the machine: ``card`` (the GPU's name, or the CPU's), ``versions`` (torch, transformers, TRL);
- timing: ``sync`` and ``free`` around a measured region, ``timed`` (warm-up calls, then the
  seconds of each timed call, the card synchronised on both sides) and ``median``;
- ``emit``: the JSON object every benchmark prints as its last line;
- ``side_by_side``: several runs of one measurement in one process, in order, each labelled.

benchmarks/ is a folder of scripts, not a package: a script puts its own folder on ``sys.path``
and imports this module as ``harness``.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def add_common_args(
    parser: argparse.ArgumentParser, *, warmup: int, repeats: int
) -> argparse.ArgumentParser:
    """``--warmup`` and ``--repeats`` with this benchmark's defaults."""
    parser.add_argument("--warmup", type=int, default=warmup, help="untimed runs first")
    parser.add_argument("--repeats", type=int, default=repeats, help="timed runs (median)")
    return parser


def cpu_model() -> str:
    """The CPU's model name, from ``/proc/cpuinfo`` where there is one."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else platform.processor() or platform.machine()


def cpu_name() -> str:
    """The CPU's model name and core count."""
    return f"{cpu_model()} ({os.cpu_count()} cores)"


def card(device: torch.device) -> str:
    """What ran the figures: the CUDA card's name, or the CPU's."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()


def versions(*packages: str) -> dict[str, str]:
    """Installed versions of ``packages`` (torch, transformers and trl by default); absent ones
    are left out."""
    found: dict[str, str] = {}
    for name in packages or ("torch", "transformers", "trl"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def sync(device: torch.device) -> None:
    """Wait for the card's queued work (nothing on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize()


def free(device: torch.device) -> None:
    """Drop what a finished run left: Python's garbage, then the CUDA cache."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def timed(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> list[float]:
    """Call ``fn`` ``warmup`` times untimed, then ``repeats`` times; each timed call's seconds,
    the card synchronised before and after it."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return times


def median(values: Iterable[float]) -> float:
    """The median: the figure every benchmark quotes of repeated timings."""
    return statistics.median(values)


def emit(result: dict[str, Any]) -> None:
    """Print the benchmark's JSON line, its last line of output (what outside checks read)."""
    print(json.dumps(result), flush=True)


def side_by_side(
    runs: dict[str, Callable[[], T]], report: Callable[[str, T], None] | None = None
) -> dict[str, T]:
    """Run each of ``runs`` in turn in this process, each result handed to ``report`` as it
    comes. Compare runs of one call: cards and hosts differ between calls by more than many
    levers do."""
    out: dict[str, T] = {}
    for label, run in runs.items():
        out[label] = run()
        if report is not None:
            report(label, out[label])
    return out
