"""Where one learner update's time goes on a GPU: wall time, GPU busy time, idle gaps, kernels.

Runs one :mod:`learner_gpu` configuration (same batch and model) for a few warm-up updates,
times ``--repeats`` updates (median), then profiles one update with ``torch.profiler`` and
prints the GPU's busy and idle time (union of kernel intervals), the largest idle gaps with the
operations on either side (a host-to-GPU copy that synchronises, a statistic read mid-step),
and the kernels by GPU time. ``--no-head-kernels`` falls back to the compiled head softmax
instead of :mod:`agentrl.kernels.head`, for an A/B on the same machine.

Usage: ``python benchmarks/learner_profile.py [--variant NAME] [--no-head-kernels]`` on a GPU;
``--model tiny`` runs the same code on a CPU in seconds (host operations stand in for kernels).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import TextIO

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
import learner_gpu as lg  # noqa: E402

from agentrl.kernels import head as head_kernels  # noqa: E402
from agentrl.learner import Learner, TrainSample  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="packed+bf16head+compile+sel+16k+triton")
    parser.add_argument("--no-head-kernels", action="store_true")
    parser.add_argument("--warmup", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--gaps", type=int, default=8, help="largest idle gaps to list")
    parser.add_argument("--rows", type=int, default=25, help="kernels to list")
    parser.add_argument("--model", choices=["qwen3-0.6b-shape", "tiny"], default="qwen3-0.6b-shape")
    ours = parser.parse_args()
    if ours.no_head_kernels:
        head_kernels._TRITON = False
    sys.argv = [sys.argv[0], "--model", ours.model]
    args = lg.parse_args()  # learner_gpu's defaults: the batch and model
    model = lg.build_model(args, args.device)
    args.num_layers = model.config.num_hidden_layers
    samples = lg.samples_for(*lg.make_batch(args, model.config.vocab_size))
    learner = Learner(model, lg.learner_config(args, lg.VARIANTS[ours.variant]))
    batch = lg.with_engine_logprobs(learner, samples)
    for _ in range(ours.warmup):
        learner.step(batch)
    tokens = sum(len(s.tokens) for s in batch)
    times = []
    for _ in range(ours.repeats):
        lg.sync(args.device)
        t = time.perf_counter()
        learner.step(batch)
        lg.sync(args.device)
        times.append(time.perf_counter() - t)
    step = statistics.median(times)
    cuda = args.device.type == "cuda"
    card = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"{card}: {ours.variant}, head kernels {'off' if ours.no_head_kernels else 'on'}")
    print(f"step {step * 1e3:.1f} ms, {tokens / step:.0f} tokens/s (median of {ours.repeats})")
    profile_update(learner, batch, args.device, gaps=ours.gaps, rows=ours.rows)


def profile_update(
    learner: Learner,
    batch: list[TrainSample],
    device: torch.device,
    *,
    gaps: int = 10,
    rows: int = 30,
    label: str = "profiled update",
    file: TextIO | None = None,
) -> None:
    """One more ``learner.step(batch)`` under ``torch.profiler``, then print (to ``file``,
    default stdout) its wall time, the device's busy time and largest idle gaps, and the
    kernels by device time. On a CPU, host operations stand in for kernels."""
    out = file or sys.stdout
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    t = time.perf_counter()
    with profile(activities=activities) as prof:
        learner.step(batch)
        lg.sync(device)
    print(f"# {label}: {(time.perf_counter() - t) * 1e3:.0f} ms wall (with the profiler)",
          file=out)  # fmt: skip
    kind = DeviceType.CUDA if cuda else DeviceType.CPU
    _gaps(prof, kind, gaps, out)
    _kernels(prof, kind, rows, out)
    out.flush()


def _gaps(prof: profile, kind: DeviceType, top: int, out: TextIO) -> None:
    kernels = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == kind
    )
    busy, gaps = 0.0, []
    start, end, prev = kernels[0]
    for a, b, name in kernels[1:]:
        if a > end:
            busy += end - start
            gaps.append((a - end, end - kernels[0][0], prev, name))
            start, end = a, b
        else:
            end = max(end, b)
        prev = name
    busy += end - start
    span = kernels[-1][1] - kernels[0][0]
    print(
        f"device span {span / 1e3:.1f} ms, busy {busy / 1e3:.1f} ms, idle {(span - busy) / 1e3:.1f}"
        " ms",
        file=out,
    )
    for gap, at, before, after in sorted(gaps, reverse=True)[:top]:
        where = f"after {before[:50]} | before {after[:50]}"
        print(f"  idle {gap:7.0f} us at {at / 1e3:6.1f} ms: {where}", file=out)


def _kernels(prof: profile, kind: DeviceType, rows: int, out: TextIO) -> None:
    """Kernels by GPU time (the host-side ops, which carry the same time again, left out)."""
    cuda = kind == DeviceType.CUDA
    events = [e for e in prof.key_averages() if e.device_type == kind]
    times = {e.key: e.self_device_time_total if cuda else e.self_cpu_time_total for e in events}
    total = sum(times.values()) or 1.0
    counts = {e.key: e.count for e in events}
    for key, t in sorted(times.items(), key=lambda kv: -kv[1])[:rows]:
        print(f"{100 * t / total:5.1f}% {t / 1e3:8.2f} ms {counts[key]:5d}  {key[:90]}", file=out)


if __name__ == "__main__":
    main()
