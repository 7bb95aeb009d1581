"""One decode step of the paged engine, kernel by kernel: what it launches, how long it takes.

Builds Qwen3-0.6B's body (28 layers, 1024 wide, GQA 16/8; random weights, bf16, the tiny
character vocabulary as in ``loop_gpu.py``) on the card and a ``PagedRunner`` as the engine
builds it (compiled layers, CUDA graphs). Each of ``--rows`` rows has ``--context`` tokens in
the cache; the captured decode step is then:

* timed: median over ``--repeats`` of ``--steps`` graph replays (CUDA events), as ms a step and
  tokens/s;
* traced (CUDA-only ``torch.profiler``, ``--steps`` replays): kernels a step, their summed time,
  the share of the replays' span at least one kernel runs (``busy``), and the kernels that take
  the most time a step (name, count a step, mean us).

Variants, side by side in one process (``--variants``):

* ``seams``: the engine's layers cut at attention (``fuse_seams=True``, the default): a layer's
  half after attention and the next one's half before, the KV write included, are one compiled
  function;
* ``split``: one compiled function per half-layer, the KV write apart (``fuse_seams=False``);
* ``eager``: uncompiled (``compile=False``).

Usage: ``python benchmarks/decode_kernels.py [--rows 64 128] [--variants seams split]``
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections import defaultdict
from typing import Any

import torch

from agentrl.inference.engine.paged_runner import DECODE_META, PagedRunner
from agentrl.tiny import QWEN3_0_6B_SHAPE, build_tiny_model

ONE_BITS = int(torch.tensor(1.0).view(torch.int32))


def make_runner(variant: str, rows: int, context: int, steps: int, page: int) -> PagedRunner:
    """A runner for ``variant`` whose block table gives each row the pages it needs."""
    shape = {k: v for k, v in QWEN3_0_6B_SHAPE.items() if k != "vocab_size"}
    shape["max_position_embeddings"] = 4096
    model = build_tiny_model(seed=0, **shape).to("cuda", torch.bfloat16)
    per_row = math.ceil((context + 2 * steps + 2) / page)
    runner = PagedRunner(
        model, num_pages=rows * per_row + 1, page_size=page, max_batch_size=rows,
        max_model_len=per_row * page, compute_dtype=torch.bfloat16, cuda_graphs=True,
        compile=variant != "eager", fuse_seams=variant != "split",
    )  # fmt: skip
    for r in range(rows):  # page 0 is the scratch page
        runner.block_table[r, :per_row] = torch.arange(1 + r * per_row, 1 + (r + 1) * per_row)
    return runner


def first_meta(runner: PagedRunner, rows: int, context: int, page: int) -> torch.Tensor:
    """Decode metadata (:data:`DECODE_META`) for every row at position ``context``."""
    table = runner.block_table.cpu()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, runner.model.config.vocab_size, (rows,), generator=g)
    pos = torch.full((rows,), context)
    slots = table[torch.arange(rows), context // page].long() * page + context % page
    cols = {
        "ids": ids, "pos": pos, "slots": slots, "rows": torch.arange(rows),
        "keys": torch.arange(rows), "inv_t_bits": torch.full((rows,), ONE_BITS),
        "greedy": torch.zeros(rows, dtype=torch.int64), "seeds": torch.arange(rows),
        "counts": torch.zeros(rows, dtype=torch.int64),
    }  # fmt: skip
    return torch.stack([cols[k].long() for k in DECODE_META])


def kernel_table(prof: Any, steps: int) -> dict[str, Any]:
    """Kernels a step, their time, the busy share of the traced span, the top kernels."""
    spans = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    by_name: dict[str, list[float]] = defaultdict(list)
    busy, end = 0.0, -math.inf
    for a, b, name in spans:
        by_name[name].append(b - a)
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
    span = spans[-1][1] - spans[0][0]
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:14]
    return {
        "kernels_per_step": len(spans) / steps,
        "kernel_us_per_step": sum(b - a for a, b, _ in spans) / steps,
        "busy": busy / span,
        "top": [
            {"name": n[:90], "per_step": len(d) / steps, "mean_us": statistics.mean(d)}
            for n, d in top
        ],
    }


@torch.inference_mode()  # as the engine runs it
def measure(variant: str, rows: int, a: argparse.Namespace) -> dict[str, Any]:
    """Time and trace ``variant``'s captured decode step of ``rows`` rows."""
    runner = make_runner(variant, rows, a.context, a.steps * (a.repeats + 2), a.page)
    runner.decode(first_meta(runner, rows, a.context, a.page))  # captures the step
    graph = runner._graphs[rows][0]
    times = []
    for _ in range(a.repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(a.steps):
            graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / a.steps)
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(a.steps):
            graph.replay()
        torch.cuda.synchronize()
    step_ms = statistics.median(times)
    return {"step_ms": step_ms, "tokens_per_s": rows / step_ms * 1e3, **kernel_table(prof, a.steps)}


def main() -> None:
    """Measure each variant at each row count; print tables, then one JSON line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--variants", nargs="+", default=["seams", "split"],
                    choices=["seams", "split", "eager"])  # fmt: skip
    ap.add_argument("--context", type=int, default=256, help="tokens in each row's cache")
    ap.add_argument("--steps", type=int, default=20, help="replays per timing and per trace")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--page", type=int, default=16)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("decode_kernels.py needs a CUDA device")
    card = torch.cuda.get_device_name(0)
    out: dict[str, Any] = {"card": card, "context": a.context}
    for rows in a.rows:
        for variant in a.variants:
            r = measure(variant, rows, a)
            out[f"{variant}/{rows}"] = r
            print(f"\n{variant}, {rows} rows on {card}: {r['step_ms']:.3f} ms a step "
                  f"({r['tokens_per_s']:,.0f} tokens/s), {r['kernels_per_step']:.0f} kernels "
                  f"{r['kernel_us_per_step']:.0f} us a step, busy {r['busy']:.1%}",
                  flush=True)  # fmt: skip
            for k in r["top"]:
                print(f"  {k['per_step']:6.1f} x {k['mean_us']:7.2f} us  {k['name']}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
