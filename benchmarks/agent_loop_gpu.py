"""The whole loop on a synthetic agent workload: long multi-turn tool episodes, side by side.

The workload (``_agent_workload.py``, env ``bench-agent-v0``): Qwen3-0.6B's body with random
weights (bf16, no download; the tiny character tokenizer), ``K`` assistant turns an episode
(``--turns 1 4 8 16``), each turn's response length drawn long-tailed in [64, 4096] tokens
(median 256; EOS ignored, so the engine samples exactly that many), a tool observation of
[64, 2048] tokens (median 256) after every turn but the last, and a tool latency in
[10 ms, 2 s] (median 100 ms) awaited after every turn. Draws are seeded by the task and the
episode's place in its group, so each loop below runs the same episodes. Reward: a hash of the
final answer (every group has a signal). ``--tasks`` tasks x 4 episodes a step.

For each ``K``, one trainer (one model, one engine, one learner) runs three phases in turn,
each from the same task cursor: ``sync``, the synchronous loop (generate the step's groups,
then update, then push); ``ceiling``, the same loop with no tool latency, timed as its rollout
plus its update only (the same episodes' generation alone on the idle card, plus the learner
alone on the same batch: what a loop that wasted nothing would take, one after the other on
one card); ``loop``, the overlapped loop (``--max-staleness``, 1 by default; partial rollouts:
the turns in flight at a push resume on the new weights). The first ``--warmup`` steps of each
phase are not timed.

Reported per phase, over its timed steps: trained tokens/s (prompt + response tokens of the
trained sequences over the timed steps' wall time), GPU busy (``nvidia-smi``'s utilisation
sampled every 100 ms, the share of time a kernel ran; ``--kernel-trace``: the union of the
card's kernel intervals over the wall time from a CUDA-only profiler trace, exact but slow to
read for long phases; ``_card_busy``),
the wall-time split (``time_split``: shares of ``push``, ``update``, ``generation``,
``env_wait`` and ``idle``; an instant counts for the first of them running, so in the
overlapped loop generation during an update counts as update), the share of re-sent history
tokens the engine served from its prefix cache (``prefix_reuse_frac``: prefill tokens a cached
prefix held over the history tokens the requests re-sent; a weight push empties the cache, so
turns that cross a push recompute), peak memory, and the engine-vs-learner log-prob mismatch
split into ``numeric`` (tokens of the version trained) and ``lag`` (older versions).

TRL: its ``GRPOTrainer`` cannot run this workload (``TRL`` below says why); not run here.

Usage: ``python benchmarks/agent_loop_gpu.py [--turns 1 4 8 16] [--steps 4] [--dry-run]``
(``--dry-run``: the tiny model on the CPU, tiny lengths and latencies: what the tests run).
``--phases`` runs a subset: on a host of two cards, ``--phases loop`` on one and ``--phases
sync ceiling`` on the other run the same seeded episodes at once (the ratios are then taken
from the two processes' JSON lines). Each phase prints its figures as a ``[phase]`` JSON line
the moment it ends, so a run cut short keeps the phases it finished.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))

# benchmarks/ is a folder of scripts, not a package
from _agent_workload import AgentEnv, HistoryClient, Spans, Workload  # noqa: E402
from _card_busy import GpuBusy, KernelBusy  # noqa: E402

from agentrl.config import load_config  # noqa: E402
from agentrl.loop.pipeline import Pipeline  # noqa: E402
from agentrl.loop.trainer import Trainer  # noqa: E402
from agentrl.tiny import QWEN3_0_6B_SHAPE  # noqa: E402

Q06_MODEL = {k: v for k, v in QWEN3_0_6B_SHAPE.items() if k != "vocab_size"}
PHASES = ("sync", "ceiling", "loop")
DRY_RUN: dict[str, Any] = {"response": (4, 24, 8), "observation": (4, 24, 8),
                           "latency_s": (0.001, 0.02, 0.003), "prompt_tokens": 16}  # fmt: skip
MISMATCH = ("numeric_mean_abs", "numeric_max_abs", "lag_mean_abs", "lag_max_abs",
            "lag_tokens_frac")  # fmt: skip
TRL = {
    "version": "1.16.0 (benchmarks/trl_wheels.sh)",
    "runs_workload": False,
    "reason": (
        "GRPOTrainer(tools=..., environment_factory=...) runs a multi-turn tool episode only "
        "while the model's own text parses as a tool call (parse_response, through the "
        "tokenizer's response schema): a random-weights model ends every episode after its "
        "first turn, so K turns set by the env cannot be run, and the character tokenizer has "
        "no tool-call schema. It also has one max_completion_length over all turns and tool "
        "outputs (no per-turn response lengths), generates the batch's turns in lockstep (each "
        "turn waits for every sample's tool calls; sync tools run one after another) and never "
        "overlaps generation with training; rollout_func leaves the whole multi-turn loop to "
        "the user"
    ),
}


def parse_args() -> argparse.Namespace:
    """The command line; bounds checked before anything is built."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, nargs="+", default=[1, 4, 8, 16], help="K per setting")
    ap.add_argument("--steps", type=int, default=4, help="timed steps a phase")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first, a phase")
    ap.add_argument("--tasks", type=int, default=8, help="tasks a step (x --group episodes)")
    ap.add_argument("--group", type=int, default=4, help="episodes a task")
    ap.add_argument("--max-staleness", type=int, default=1, help="the overlapped loop's")
    ap.add_argument("--max-response", type=int, default=4096, help="longest turn (tokens)")
    ap.add_argument("--latency-max-s", type=float, default=2.0, help="longest tool latency")
    ap.add_argument("--max-total-tokens", type=int, default=32768, help="context budget")
    ap.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES),
                    help="the phases to run (in this order)")
    ap.add_argument("--dry-run", action="store_true", help="tiny model on the CPU, tiny lengths")
    ap.add_argument("--kernel-trace", action="store_true",
                    help="GPU busy from a CUDA profiler trace (exact, slow to read on long phases) "
                         "instead of nvidia-smi sampled every 100 ms")  # fmt: skip
    a = ap.parse_args()
    checks = [("--turns", min(a.turns), 1, 64), ("--turns", max(a.turns), 1, 64),
              ("--steps", a.steps, 1, 1000), ("--warmup", a.warmup, 0, 100),
              ("--tasks", a.tasks, 1, 4096), ("--group", a.group, 2, 64),
              ("--max-staleness", a.max_staleness, 1, 8),
              ("--max-response", a.max_response, 1, 32768),
              ("--latency-max-s", a.latency_max_s, 1e-3, 60.0),
              ("--max-total-tokens", a.max_total_tokens, 64, 131072)]  # fmt: skip
    for name, value, lo, hi in checks:
        if not lo <= value <= hi:
            ap.error(f"{name}: {value} is outside [{lo}, {hi}]")
    return a


def workload(a: argparse.Namespace, turns: int) -> Workload:
    """The episode distributions for ``turns`` turns (capped by ``--max-response`` and
    ``--latency-max-s``; tiny under ``--dry-run``)."""
    if a.dry_run:
        return Workload(turns=turns, group_size=a.group, **DRY_RUN)
    r, lat = a.max_response, a.latency_max_s
    return Workload(turns=turns, group_size=a.group, response=(min(64, r), r, min(256, r)),
                    latency_s=(min(0.01, lat), lat, min(0.1, lat)))  # fmt: skip


def build_trainer(a: argparse.Namespace, w: Workload, max_turns: int) -> Trainer:
    """One trainer for every setting: the engine decodes every row the pipeline may start."""
    rows = (a.max_staleness + 1) * a.tasks * a.group  # the steps' episodes in flight at once
    model: dict[str, Any] = {"device": "cpu"}
    learner: dict[str, Any] = {"lr": 1e-6, "num_minibatches": 1}
    total = min(a.max_total_tokens, 1024) if a.dry_run else a.max_total_tokens
    if not a.dry_run:  # loop_gpu.py's qwen3-0.6b settings (the recipes' GPU learner levers)
        model = {"tiny": dict(Q06_MODEL, max_position_embeddings=total + 64),
                 "dtype": "bfloat16", "device": "auto"}  # fmt: skip
        learner |= {
            "dtype": "bfloat16",
            "micro_batch_tokens": max(32768, total),
            "attention_kernel": "triton",
            "compile": True,
            "selective_recompute": True,
        }
    config = load_config({
        "run_dir": tempfile.mkdtemp(prefix="agent_loop_gpu_"), "seed": 0, "model": model,
        "inference": {"max_batch_size": rows},
        "env": {"id": "bench-agent-v0", "num_train_tasks": 4096, "num_eval_tasks": 1,
                "kwargs": w.kwargs()},
        "rollout": {"group_size": a.group, "max_turns": max_turns,
                    "max_new_tokens": int(w.response[1]), "max_total_tokens": total,
                    "max_observation_tokens": int(w.observation[1]) + 64, "ignore_eos": True,
                    "temperature": 1.0, "concurrency": 4096,
                    "env_timeout_s": max(60.0, 4 * w.latency_s[1])},
        "learner": learner,
        "train": {"steps": 10**6, "tasks_per_step": a.tasks, "eval_every": 0,
                  "max_staleness": a.max_staleness},
    })  # fmt: skip
    return Trainer(config)


async def _sync_steps(trainer: Trainer) -> AsyncGenerator[dict[str, float], None]:
    while True:
        yield await trainer.train_step()


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


async def run_phase(
    trainer: Trainer, phase: str, w: Workload, a: argparse.Namespace, spans: Spans
) -> dict[str, Any]:
    """One phase (``sync``, ``ceiling`` or ``loop``) from the trainer's cursor; its figures."""
    client = trainer.rollout.client
    assert isinstance(client, HistoryClient)
    spans.clear()
    env_kwargs, scale = w.kwargs(), 0.0 if phase == "ceiling" else 1.0
    trainer.make_env = lambda: AgentEnv(latency_scale=scale, spans=spans, **env_kwargs)  # type: ignore[method-assign]
    cuda = trainer.learner.device.type == "cuda"
    busy: GpuBusy | KernelBusy | None = None
    if cuda and phase != "ceiling":  # a kernel trace of a long phase holds millions of events
        busy = KernelBusy() if a.kernel_trace else GpuBusy()
    # the paged engine (CUDA) caches prefixes; the CPU's engine has no cache: reuse is None
    paged = getattr(trainer.client, "paged", False)
    prefill = getattr(trainer.client, "prefill_stats", None) if paged else None
    seen: dict[str, Any] = {}

    def begin() -> None:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        if busy is not None:
            try:
                busy.start()
            except OSError:  # no nvidia-smi on this host
                seen["no_busy"] = True
        client.counting, client.resent, client.resent_resumed, client.sent = True, 0, 0, 0
        seen["prefill"] = prefill() if prefill else None
        seen["t0"] = time.perf_counter()

    source = Pipeline(trainer).steps() if phase == "loop" else _sync_steps(trainer)
    steps: list[dict[str, float]] = []
    marks: list[float] = []
    t_start = time.perf_counter()
    if a.warmup == 0:
        begin()
    async with aclosing(source) as stream:
        async for metrics in stream:
            marks.append(time.perf_counter())
            n = len(marks)
            print(f"[progress] K={w.turns} {phase} step {n}/{a.warmup + a.steps}: "
                  f"{metrics.get('perf/tokens', 0):,.0f} tokens, update "
                  f"{metrics.get('time/train_s', 0):.2f} s, step "
                  f"{marks[-1] - (marks[-2] if n > 1 else t_start):.2f} s"
                  + ("" if n > a.warmup else " (warm-up)"),
                  file=sys.stderr, flush=True)  # fmt: skip
            if n > a.warmup:
                steps.append(metrics)
            if n == a.warmup:
                begin()
            if n == a.warmup + a.steps:
                seen["t1"] = time.perf_counter()
                got = busy.stop() if busy is not None and "no_busy" not in seen else None
                seen["busy"] = None if got is None or got != got else got  # (nan: no samples)
                seen["prefill_end"] = prefill() if prefill else None
                client.counting = False
                break
    t0, t1 = seen["t0"], seen["t1"]
    walls = [b - a_ for a_, b in zip([t0, *marks[a.warmup :]], marks[a.warmup :], strict=False)]
    tokens = [float(m.get("perf/tokens", 0.0)) for m in steps]
    if phase == "ceiling":  # generation alone, then the learner alone
        walls = [m["time/rollout_s"] + m["time/train_s"] for m in steps]
    split = spans.split(t0, t1)
    cached, resent = None, client.resent
    if seen["prefill"] is not None:
        cached = seen["prefill_end"]["cached_tokens"] - seen["prefill"]["cached_tokens"]
    return {
        # the timed steps' tokens over their wall time: in the overlapped loop a step can take
        # a batch that finished during the last update (seconds) and the next waits for a tail,
        # so a median of the steps' own ratios says little (58.6k and 2.8k tokens/s on an H200)
        "tokens_per_s": sum(tokens) / sum(walls) if sum(walls) > 0 else None,
        "tokens_per_s_median_step": _median(
            [t / s for t, s in zip(tokens, walls, strict=True) if s > 0]
        ),
        "tokens_per_step": sum(tokens) / len(tokens),
        "step_s": _median(walls),
        "generation_alone_s": _median([m["time/rollout_s"] for m in steps])
        if phase == "ceiling"
        else None,
        "learner_alone_s": _median([m["time/train_s"] for m in steps])
        if phase == "ceiling"
        else None,
        "gpu_busy": seen["busy"],
        "time_split": {k: v / (t1 - t0) for k, v in split.items()},
        "time_split_s_per_step": {k: v / len(steps) for k, v in split.items()},
        # each kind's own share of the wall time, overlaps counted in each (not a partition)
        "time_busy": {k: spans.busy(k, t0, t1) / (t1 - t0) for k in Spans.PRIORITY},
        "prefix_reuse_frac": None if cached is None or not resent else cached / resent,
        "prefix_reuse": {
            "resent_history_tokens": resent,
            "cached_tokens": cached,
            "resent_by_resumed_turns": client.resent_resumed,
            "input_tokens": client.sent,
        },
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "mismatch": {
            k: _median([m[f"mismatch/{k}"] for m in steps if f"mismatch/{k}" in m])
            for k in MISMATCH
        },
        # episodes per step: failed, truncated (context budget), mean turns (K unless cut)
        "episodes": {
            k: _median([m.get(f"rollout/{k}", 0.0) for m in steps])
            for k in ("failed", "truncated_frac", "turns_mean")
        },
    }


async def run_setting(
    trainer: Trainer, a: argparse.Namespace, turns: int, spans: Spans
) -> dict[str, Any]:
    """The three phases of one ``K``, each from the same task cursor (the same episodes)."""
    w = workload(a, turns)
    start, end = trainer.cursor, trainer.cursor
    out: dict[str, Any] = {"workload": w.kwargs()}
    for phase in [p for p in PHASES if p in a.phases]:
        trainer.cursor = start
        out[phase] = await run_phase(trainer, phase, w, a, spans)
        print(f"[phase] {json.dumps({'turns': turns, 'phase': phase, **_r(out[phase])})}",
              flush=True)
        end = max(end, trainer.cursor)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    trainer.cursor = end  # the next setting's episodes are new ones
    tps = {p: out[p]["tokens_per_s"] if p in out else None for p in PHASES}
    out["speedup_vs_sync"] = _ratio(tps["loop"], tps["sync"])
    out["loop_vs_ceiling"] = _ratio(tps["loop"], tps["ceiling"])
    print(f"[progress] K={turns}: tokens/s {tps}; speedup {out['speedup_vs_sync']}, vs ceiling "
          f"{out['loop_vs_ceiling']}", flush=True)  # fmt: skip
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _r(x: Any, n: int = 4) -> Any:
    if isinstance(x, float):
        return round(x, n)
    if isinstance(x, dict):
        return {k: _r(v, n) for k, v in x.items()}
    return x


def table(card: str, results: dict[int, dict[str, Any]]) -> None:
    """The human table: one block per setting, a row per phase."""
    print(f"\nagent loop on {card}")
    for k, res in results.items():
        print(f"K={k} turns: speedup vs sync {_fmt(res['speedup_vs_sync'], '.2f')}x, loop vs "
              f"ceiling {_fmt(res['loop_vs_ceiling'], '.2f')}")  # fmt: skip
        print(f"  {'phase':8s} {'tokens/s':>10s} {'step s':>7s} {'busy':>6s} {'reuse':>6s} "
              f"{'peak GiB':>8s}  split (push update generation env_wait idle)")  # fmt: skip
        for phase in [p for p in PHASES if p in res]:
            r = res[phase]
            split = " ".join(f"{v:.2f}" for v in r["time_split"].values())
            cells = [_fmt(r["tokens_per_s"], ",.0f"), _fmt(r["step_s"], ".2f"),
                     _fmt(r["gpu_busy"], ".1%"), _fmt(r["prefix_reuse_frac"], ".2f"),
                     _fmt(r["peak_mem_gib"], ".1f")]  # fmt: skip
            print(f"  {phase:8s} {cells[0]:>10s} {cells[1]:>7s} {cells[2]:>6s} {cells[3]:>6s} "
                  f"{cells[4]:>8s}  {split}")  # fmt: skip
        if "loop" in res:
            print(f"  mismatch (loop): {_r(res['loop']['mismatch'], 6)}")


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


async def main_async(a: argparse.Namespace) -> dict[str, Any]:
    """Every setting on one trainer; the headline JSON."""
    trainer = build_trainer(a, workload(a, max(a.turns)), max(a.turns))
    spans = Spans()
    trainer.rollout.client = HistoryClient(trainer.rollout.client, spans)
    trainer.learner.step = spans.wrap("update", trainer.learner.step)  # type: ignore[method-assign]
    trainer.sync_weights = spans.wrap("push", trainer.sync_weights)  # type: ignore[method-assign]
    card = torch.cuda.get_device_name(0) if trainer.learner.device.type == "cuda" else "cpu"
    results: dict[int, dict[str, Any]] = {}
    try:
        await trainer.sync_weights()  # the engine serves the learner's version
        for k in a.turns:
            results[k] = await run_setting(trainer, a, k, spans)
    finally:
        await trainer.client.aclose()
    table(card, results)
    head_k = 8 if 8 in results else max(results)
    head = results[head_k]
    empty: dict[str, Any] = {}
    loop, sync, ceiling = (head.get(p, empty) for p in ("loop", "sync", "ceiling"))
    return {
        "loop_tokens_per_s": _r(loop.get("tokens_per_s"), 1),
        "sync_tokens_per_s": _r(sync.get("tokens_per_s"), 1),
        "speedup_vs_sync": _r(head["speedup_vs_sync"], 3),
        "loop_vs_ceiling": _r(head["loop_vs_ceiling"], 3),
        "prefix_reuse_frac": _r(loop.get("prefix_reuse_frac"), 4),
        "gpu_busy": _r(loop.get("gpu_busy"), 3),
        "time_split": _r(loop.get("time_split"), 4),
        "card": card,
        "headline_turns": head_k,
        "phases": [p for p in PHASES if p in head],
        "ceiling_tokens_per_s": _r(ceiling.get("tokens_per_s"), 1),
        "peak_mem_gib": _r(loop.get("peak_mem_gib"), 2),
        "mismatch": _r(loop.get("mismatch"), 6),
        "trl": TRL,
        "settings": {str(k): _r(v) for k, v in results.items()},
    }


def main() -> None:
    """Run, print the table, and last the JSON."""
    a = parse_args()
    if not a.dry_run and not torch.cuda.is_available():
        sys.exit("agent_loop_gpu.py needs a CUDA device (or --dry-run)")
    print(json.dumps(asyncio.run(main_async(a))))


if __name__ == "__main__":
    main()
