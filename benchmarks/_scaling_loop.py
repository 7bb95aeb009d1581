"""``scaling_gpu.py --loop``: the whole loop (``agentrl train``) on 1, 2 and 4 cards, warm.

One ``torchrun --nproc-per-node N`` launch per card count runs every measurement of that
count in turn, in its processes (what the CLI runs: :func:`agentrl.loop.ranks.process_group`
and a :class:`~agentrl.loop.trainer.Trainer` per measurement). Each measurement trains
``loop_warmup`` untimed steps (compiled graphs, the engine's CUDA graphs and caches built) and
then ``loop_steps`` timed ones; tokens/s is the timed steps' sampled tokens over their time,
the split of a step is each part's median over them.

* **workloads**: ``short``, gpu-small-like (its 25M-parameter shape, 64-token responses, 64
  tasks x 8 episodes a card) and ``gen``, generation-bound (a Qwen3-0.6B shape, 2,048-token
  responses, 16 tasks x 8 a card); ``rollout.ignore_eos`` fixes every response's length, so
  each step does the same work;
* **weak scaling**: ``N x`` the tasks on ``N`` cards, ``loop_weak_efficiency_N = tokens/s on N
  / (N x tokens/s on 1)``; **strong scaling**: the 1-card tasks on ``N`` cards,
  ``loop_strong_speedup_N = tokens/s on N / tokens/s on 1`` (sampled tokens a second of step);
* **per-rank profile**: each rank's median split of a step: ``generate_s`` (its own share of
  the rollouts), ``gather_s`` (waiting at the all-gather of the groups: the slowest rank's
  generation shows here on the others), ``update_s`` (the learner step, its FSDP collectives
  included), ``push_s`` (the weight push), ``wait_s`` (the other collectives: broadcasts and
  barriers) and ``other_s`` (the rest: advantages, records, logs);
* **dedicated** (``--loop-dedicated``, on N >= 2 cards): the strong-scaling batch with the
  learner on N/2 cards and ``inference.engine_gpus = N/2`` engines (``agentrl serve``, one a
  card, weights over NCCL) on the others, against the colocated layout on all N:
  ``loop_dedicated_vs_colocated_N`` (tokens/s of the dedicated layout over colocated ``strong``).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from agentrl.tiny import QWEN3_0_6B_SHAPE

GPU_SMALL_SHAPE = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8,
                   "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64}  # fmt: skip
PARTS = ("generate_s", "gather_s", "update_s", "push_s", "wait_s", "other_s")


def add_args(ap: argparse.ArgumentParser) -> None:
    """The loop measurement's options."""
    ap.add_argument("--loop-workloads", nargs="+", choices=["short", "gen"],
                    default=["short", "gen"])  # fmt: skip
    ap.add_argument("--loop-warmup", type=int, default=3, help="untimed steps first")
    ap.add_argument("--loop-steps", type=int, default=10, help="timed steps")
    ap.add_argument("--loop-short-tasks", type=int, default=64, help="short: tasks a step on 1")
    ap.add_argument("--loop-short-tokens", type=int, default=64, help="short: response tokens")
    ap.add_argument("--loop-gen-tasks", type=int, default=16, help="gen: tasks a step on 1")
    ap.add_argument("--loop-gen-tokens", type=int, default=2048, help="gen: response tokens")
    ap.add_argument("--loop-max-staleness", type=int, default=0,
                    help="train.max_staleness (0: the synchronous loop; 1: overlapped)")
    ap.add_argument("--loop-dedicated", action=argparse.BooleanOptionalAction, default=False,
                    help="also the dedicated-inference layout on N >= 2 cards (engine_gpus=N/2)")
    ap.add_argument("--loop-plan", default=None, help="(internal) the worker's measurements")


def dry_run(args: argparse.Namespace) -> None:
    """The CPU dry run's sizes: a tiny model, a few steps, seconds on two cores."""
    args.loop_warmup, args.loop_steps = 0, 1  # the code path, not figures: one step each
    args.loop_short_tasks, args.loop_short_tokens = 2, 4
    args.loop_gen_tasks, args.loop_gen_tokens = 2, 12


def plan(args: argparse.Namespace, gpus: int, dedicated: bool = False) -> list[dict[str, Any]]:
    """The measurements of one card count: the base on 1; weak and strong scaling on more.
    ``dedicated``: the launch of N/2 learner ranks whose engines take the other N/2 cards."""
    if dedicated:
        base = {"short": args.loop_short_tasks, "gen": args.loop_gen_tasks}
        return [{"workload": w, "mode": "dedicated", "tasks": base[w], "cards": gpus,
                 "engine_gpus": gpus // 2} for w in args.loop_workloads]  # fmt: skip
    out = []
    for w in args.loop_workloads:
        base = args.loop_short_tasks if w == "short" else args.loop_gen_tasks
        modes = {"base": base} if gpus == 1 else {"weak": gpus * base, "strong": base}
        out += [{"workload": w, "mode": m, "tasks": t} for m, t in modes.items()]
    return out


def loop_config(args: argparse.Namespace, m: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """One measurement's ``agentrl train`` config: the synchronous loop (``--loop-max-staleness
    1``: overlapped), untrained policy."""
    cuda = args.device == "cuda"
    short = m["workload"] == "short"
    tiny = {} if not cuda else dict(GPU_SMALL_SHAPE) if short else {
        k: QWEN3_0_6B_SHAPE[k] for k in GPU_SMALL_SHAPE}  # fmt: skip
    tokens = args.loop_short_tokens if short else args.loop_gen_tokens
    if tiny:  # the built model's context covers the prompt and the response (1,024 by default)
        tiny["max_position_embeddings"] = max(1024, tokens + 128)
    dtype = "bfloat16" if cuda else "float32"
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from scaling_gpu import body_levers

    inference: dict[str, Any] = {"max_batch_size": 512 if short else 256, "kv_cache_frac": 0.3}
    if m["mode"] == "dedicated":  # the engines own their cards: the colocated cache fraction
        inference["engine_gpus"] = m["engine_gpus"]
    return {
        "run_dir": str(run_dir),
        "model": {"device": "auto" if cuda else "cpu", "tiny": tiny, "dtype": dtype},
        "env": {"id": "arith-v0", "task_kwargs": {"digits": 3}, "num_train_tasks": 20000,
                "num_eval_tasks": 8},
        "rollout": {"group_size": 8, "max_turns": 1, "max_new_tokens": tokens,
                    "max_total_tokens": tokens + 32, "ignore_eos": True, "concurrency": 4096},
        # answers without a number are penalised: the untrained policy's groups get a signal
        "advantages": {"shapers": [{"name": "format", "penalty": 1.0}]},
        "inference": inference,
        "learner": {"lr": 1e-6, "num_minibatches": 1, **body_levers(args)},
        "train": {"steps": args.loop_warmup + args.loop_steps, "tasks_per_step": m["tasks"],
                  "eval_every": 0, "checkpoint_every": 0, "export": False,
                  "max_staleness": args.loop_max_staleness},
    }  # fmt: skip


# ---------------------------------------------------------------- the worker (every rank)


class Probe:
    """Each step's split on this rank, from the step's metrics and timed collectives.

    A step's period runs from the end of the previous step's ``after_step`` (its log, checkpoint
    and broadcast) to the end of its own; both loops (synchronous and overlapped) call it once a
    step."""

    def __init__(self, trainer: Any) -> None:
        self.steps: list[dict[str, float]] = []
        self.waits = {"gather": 0.0, "wait": 0.0}
        self._start = time.perf_counter()
        ranks = trainer.ranks
        for name, kind in (("all_gather", "gather"), ("broadcast", "wait"), ("barrier", "wait")):
            setattr(ranks, name, self._timed(getattr(type(ranks), name).__get__(ranks), kind))
        after = trainer.after_step

        async def after_step(metrics: dict[str, float], t_rl: float) -> bool:
            done = await after(metrics, t_rl)
            now = time.perf_counter()
            self._close(now, metrics)
            self._start, self.waits = now, {"gather": 0.0, "wait": 0.0}
            return bool(done)

        trainer.after_step = after_step

    def _timed(self, fn: Callable[..., Any], kind: str) -> Callable[..., Any]:
        def wrapped(*a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.waits[kind] += time.perf_counter() - t

        return wrapped

    def _close(self, now: float, m: dict[str, float]) -> None:
        period = now - self._start
        # the synchronous loop's rollout, or the overlapped loop's wait for a ready batch; the
        # all-gather of the groups (this rank waiting for the slowest) is inside either
        batch_s = m.get("time/rollout_s", m.get("time/wait_s", 0.0))
        parts = {"generate_s": batch_s - self.waits["gather"], "gather_s": self.waits["gather"],
                 "update_s": m.get("time/train_s", 0.0), "push_s": m.get("time/sync_s", 0.0),
                 "wait_s": self.waits["wait"]}  # fmt: skip
        parts["other_s"] = period - sum(parts.values())
        tokens = m["rollout/episodes"] * m["rollout/response_len_mean"]
        self.steps.append({"step_s": period, "tokens": tokens, **parts})


def measure(args: argparse.Namespace, m: dict[str, Any], work: Path) -> dict[str, Any]:
    """One measurement on this process group (every rank); this rank's timed steps."""
    import yaml

    from agentrl.config import load_config
    from agentrl.loop import ranks as dist_ranks
    from agentrl.loop.trainer import Trainer

    ranks = dist_ranks.active()
    run_dir = work / f"{m['workload']}-{m['mode']}-{ranks.world_size}"
    path = work / f"{run_dir.name}.rank{ranks.rank}.yaml"
    path.write_text(yaml.safe_dump(loop_config(args, m, run_dir)))
    trainer = Trainer(load_config(path), overwrite=True)
    probe = Probe(trainer)
    asyncio.run(trainer.run())
    steps = probe.steps[args.loop_warmup :]  # the warm-up steps are not timed
    del trainer, probe  # the engine's and learner's memory goes with them
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    ranks.barrier()
    if ranks.is_main:
        shutil.rmtree(run_dir, ignore_errors=True)  # its checkpoint: GBs on a card's shape
    return {**m, "gpus": ranks.world_size, "rank": ranks.rank, "steps": steps}


def worker(args: argparse.Namespace) -> None:
    """Under torchrun: every measurement of ``--loop-plan``; rank 0 writes ``--out``."""
    from agentrl.loop import ranks as dist_ranks
    from agentrl.loop.placement import resolve_device

    work = Path(args.out).parent
    device = resolve_device("auto" if args.device == "cuda" else "cpu")
    with dist_ranks.process_group(device, 1800.0) as ranks:
        results = []
        for m in json.loads(args.loop_plan):
            mine = measure(args, m, work)
            results.append(ranks.all_gather(mine))  # every rank's steps, in rank order
            if ranks.is_main:
                print(f"[loop] {summary(results[-1])}", file=sys.stderr, flush=True)
        if ranks.is_main:
            Path(args.out).write_text(json.dumps(results))


# ---------------------------------------------------------------- figures


def summary(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One measurement's figures: rank 0's tokens/s over its timed steps, each rank's median
    split of a step."""
    first = per_rank[0]
    steps = first["steps"]
    # the timed steps' tokens over their time (overlapped steps vary: a batch ready at once, then
    # one that waits for its tail; a median of the steps' own ratios misleads)
    period = sum(s["step_s"] for s in steps)
    tps = sum(s["tokens"] for s in steps) / period if period > 0 else 0.0
    profile = [{k: round(statistics.median(s[k] for s in r["steps"]), 4) if r["steps"] else None
                for k in ("step_s", *PARTS)} for r in per_rank]  # fmt: skip
    cards = first.get("cards", first["gpus"])  # dedicated: the learner ranks + the engines' cards
    return {"workload": first["workload"], "mode": first["mode"], "gpus": cards,
            "tasks": first["tasks"], "timed_steps": len(steps), "tokens_per_s": round(tps, 1),
            "profile": profile}  # fmt: skip


def figures(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON keys: ``loop_weak_efficiency_N``, ``loop_strong_speedup_N`` (per workload),
    ``loop_tokens_per_s`` and ``loop_profile`` (``{workload: {"mode-N": [per rank]}}``)."""
    base = {r["workload"]: r["tokens_per_s"] for r in results if r["gpus"] == 1}
    out: dict[str, Any] = {}
    for n in sorted({r["gpus"] for r in results if r["gpus"] > 1}):
        for mode, key, scale in (("weak", "loop_weak_efficiency", n), ("strong",
                                 "loop_strong_speedup", 1)):  # fmt: skip
            out[f"{key}_{n}"] = {
                r["workload"]: round(r["tokens_per_s"] / (scale * base[r["workload"]]), 4)
                for r in results
                if r["gpus"] == n and r["mode"] == mode and base.get(r["workload"])
            }
    for n in sorted({r["gpus"] for r in results if r["mode"] == "dedicated"}):
        colocated = {r["workload"]: r["tokens_per_s"] for r in results
                     if r["gpus"] == n and r["mode"] == "strong"}  # fmt: skip
        out[f"loop_dedicated_vs_colocated_{n}"] = {
            r["workload"]: round(r["tokens_per_s"] / colocated[r["workload"]], 4)
            for r in results
            if r["gpus"] == n and r["mode"] == "dedicated" and colocated.get(r["workload"])
        }
    tps: dict[str, dict[str, float]] = {}
    prof: dict[str, dict[str, Any]] = {}
    for r in results:
        label = f"{r['mode']}-{r['gpus']}"
        tps.setdefault(r["workload"], {})[label] = r["tokens_per_s"]
        prof.setdefault(r["workload"], {})[label] = r["profile"]
    return {**out, "loop_tokens_per_s": tps, "loop_profile": prof}


def print_table(results: list[dict[str, Any]]) -> None:
    """Tokens/s of each measurement and each rank's median split of a step."""
    print(f"{'workload':<9}{'mode':<8}{'GPUs':>5}{'tasks':>6}{'tokens/s':>11}  rank: "
          + " ".join(f"{p[:-2]:>8}" for p in ("step_s", *PARTS)))  # fmt: skip
    for r in results:
        for rank, p in enumerate(r["profile"]):
            head = (f"{r['workload']:<9}{r['mode']:<8}{r['gpus']:>5}{r['tasks']:>6}"
                    f"{r['tokens_per_s']:>11.0f}" if rank == 0 else " " * 39)  # fmt: skip
            cells = " ".join(f"{p[k]:>8.3f}" if p[k] is not None else f"{'-':>8}"
                             for k in ("step_s", *PARTS))  # fmt: skip
            print(f"{head}  {rank:>4}: {cells}")
