"""The whole RL loop on one GPU, and TRL 1.16's ``GRPOTrainer`` whole loop side by side.

Workloads (both from config with seeded random weights, no download; the tiny character
tokenizer, so the vocabulary is ~110 tokens on both sides):

* ``gpu-small``: ``recipes/math_agent.py``'s ``gpu-small`` model (25M parameters, float32),
  three-digit questions, 8 new tokens at most, 32 tasks x 8 samples a step;
* ``qwen3-0.6b``: Qwen3-0.6B's body (28 layers, 1024 wide, GQA 16/8), bf16, responses of
  ``--response-tokens`` tokens exactly (EOS ignored on both sides), 16 tasks x 4 samples a step.

The reward is a seeded hash of the response (a random model never answers right, and a
constant reward gives no group a signal), so every step trains every sequence on both sides.

agentrl: ``Trainer`` with ``model.device=auto`` (policy, learner and embedded engine on the
card), the overlapped loop (``max_staleness=1``, with ``max_inflight_groups`` = all the
staleness bound admits, two steps' groups: ``--inflight-groups``), one optimizer step per batch
(one learner micro-batch of up to 32,768 tokens: ``--micro-batch-tokens``). TRL:
``GRPOTrainer.train()`` with its own generation (``use_vllm=False``), GSPO settings as in
``benchmarks/trl_side/`` (sequence-level ratio, epsilon 3e-4/4e-4, beta 0), one optimizer
step per generation batch of the same size. Trained tokens = prompt + response tokens of the
trained sequences; the first ``--warmup`` steps of each side are not timed.

Reported for agentrl: loop tokens/s, the per-step wall split (waiting for rollouts, update,
weight push, the rest), the GPU-busy fraction (``gpu_busy``: the union of every kernel's
interval on the card, from a CUDA-only ``torch.profiler`` trace of the timed steps, over their
wall time; ``gpu_busy_nvidia_smi``: ``nvidia-smi`` utilisation sampled every 100
ms over the timed steps: the share of time a kernel was running; both stop at the last timed
step, before the run's final evaluation and checkpoint), the engine's running rows (sampled
every 10 ms over the timed steps, with the share of samples where requests were open but none
ran: queued, settling after a resume, or in their first prefill; a ``[timeline]`` line gives
each sample's running and waiting requests beside each timed step's end, wait, update and
push, the card's busy share every 10 ms and its idle gaps (``_card_busy.card_timeline``), and
the in-process engine's plans, pauses, resumes, pushes and arrivals (``EngineSteps``)), the
in-process weight push (``time/sync_s``) and response tokens whose groups finished during
updates (overlap).

The engine decodes every row the pipeline may start together (``--engine-rows``, default
``(max_staleness + 1) x tasks x group``); ``--tasks`` sets both sides' tasks a step;
``--decode-steps`` sets the engine's decode steps between two visits of the host
(``inference.decode_steps``), ``--resume-settle-ms`` how long it waits after a resume for the
re-sent requests to arrive (``RESUME_SETTLE_MAX_S``; rows paused in place wait too; the
in-process engine only); ``--count-syncs`` counts agentrl's device-to-host synchronisations
in the timed steps by part (engine, learner) and call site (torch's sync debug mode; it slows
the steps a little);
``--stream-gaps`` splits each CUDA stream's idle time in the timed steps into the part before
the next kernel was even launched (its thread was late: host-bound) and the part it waited
once launched (the card), with the launching threads (``stream_gaps``; untried on a card
yet); ``allocator_per_step`` counts the caching allocator's device allocations, frees and
retries (each free synchronises the device).

``--prefill-graphs on off`` runs the engine's prefills as CUDA graphs or eagerly, side by side;
``--deliver-at-launch on off`` hands a step's finished requests their results once the next
step is launched, or at once (the engine before 2026-11-28); ``--gc-sites`` counts where young
collections begin (``[gc]``: thread and frames; they sample where tracked objects are made);
``--stacks`` samples every Python thread's stack each ms and prints (``[stacks]``) where each
thread was while the card idled 5 ms or more (it holds the GIL as it samples: leave it off
for the headline figures). ``[progress]`` counts the
timed steps' garbage collections by generation (``gc [young, middle, full] [ms]``).

``--engine process`` runs agentrl's engine in a process of its own on the same card
(``agentrl serve --config`` with the run's config) and trains over HTTP with
``inference.weight_sync=tensor`` (weights pushed by CUDA IPC handle), so the engine and the
learner no longer share one interpreter's GIL. Its ``gpu_busy`` is ``nvidia-smi``'s (the
profiler sees only its own process: ``gpu_busy_learner_process`` is that share);
``--engine thread process`` measures both side by side.

Timed steps: 12 of agentrl's by default (with 4, the same setting moved by 15% between two
calls on one card: the groups of two steps end together or not); 3 of TRL's, whose steps are
long (10-20 s) and even.

Usage: ``python benchmarks/loop_gpu.py [--workloads gpu-small qwen3-0.6b] [--steps 12]``
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import agentrl.inference.engine.local_engine as engine_module
import agentrl.inference.engine.prefill_graphs as prefill_module

sys.path.insert(0, str(Path(__file__).parent))

# benchmarks/ is a folder of scripts, not a package
from _card_busy import GpuBusy, KernelBusy  # noqa: E402
from _engine_probes import (  # noqa: E402
    EngineRows,
    EngineSteps,
    SyncCount,
    allocator_counts,
    server_running_rows,
)
from _gc_pauses import GcPauses  # noqa: E402
from _loop_args import parse_args  # noqa: E402
from _serve import start_server, stop_server  # noqa: E402
from _stack_sampler import StackSampler  # noqa: E402
from trl_side import trl_loop  # noqa: E402

from agentrl.config import dump_config, load_config  # noqa: E402
from agentrl.tiny import QWEN3_0_6B_SHAPE  # noqa: E402

GPU_SMALL_MODEL = {
    "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
}  # fmt: skip
Q06_MODEL = {k: v for k, v in QWEN3_0_6B_SHAPE.items() if k != "vocab_size"}


WORKLOADS: dict[str, dict[str, Any]] = {
    "gpu-small": {"model": GPU_SMALL_MODEL, "dtype": "float32", "tasks": 32, "group": 8,
                  "new_tokens": 8, "ignore_eos": False, "lr": 3e-5},
    "qwen3-0.6b": {"model": Q06_MODEL, "dtype": "bfloat16", "tasks": 16, "group": 4,
                   "new_tokens": 256, "ignore_eos": True, "lr": 1e-6},
}  # fmt: skip


MISMATCH_KEYS = (  # engine vs learner log-probs: the version trained, older ones
    "mismatch/numeric_mean_abs",
    "mismatch/numeric_max_abs",
    "mismatch/lag_mean_abs",
    "mismatch/lag_max_abs",
)


def agentrl_loop(
    name: str,
    steps: int,
    warmup: int,
    staleness: int = 1,
    engine_rows: int | None = None,
    count_syncs: bool = False,
    switch_ms: float | None = None,
    engine_process: bool = False,
    gaps: bool = False,
    inflight: int | None = None,
    interrupt_mode: str = "abort",
    decode_steps: int | None = None,
    settle_ms: float | None = None,
    stacks: bool = False,
    deliver_at_launch: bool = True,
    gc_sites: bool = False,
) -> dict[str, Any]:
    """agentrl's whole loop on the card; throughput, wall split, GPU busy, push time.

    ``engine_rows`` (default: every row the pipeline may start, ``(staleness + 1)`` steps'
    worth) caps the rows the engine decodes together; ``count_syncs`` counts the timed steps'
    device-to-host synchronisations by call site (it slows them a little); ``engine_process``
    serves the engine from a process of its own on the card (weights pushed by handle);
    ``gaps`` splits each stream's idle time into host-late and device-side parts
    (``_card_busy.stream_gaps``; exports the timed steps' trace, slow for long runs).
    """
    from agentrl.loop.trainer import Trainer

    if settle_ms is not None:  # a module constant, not a setting: set for this run only
        engine_module.RESUME_SETTLE_MAX_S = settle_ms / 1e3

    w = WORKLOADS[name]
    rows = engine_rows or (staleness + 1) * w["tasks"] * w["group"]
    inflight = (inflight or (staleness + 1) * w["tasks"]) if staleness else None
    bf16 = w["dtype"] == "bfloat16"
    run_dir = tempfile.mkdtemp(prefix=f"loop_gpu_{name}_")
    config = load_config({
        "run_dir": run_dir, "seed": 0,
        "model": {"tiny": dict(w["model"], max_position_embeddings=4096), "dtype": w["dtype"],
                  "device": "auto"},
        "inference": {"max_batch_size": rows,
                      **({"decode_steps": decode_steps} if decode_steps else {})},
        "env": {"id": "bench-hash-v0", "num_train_tasks": 4096, "num_eval_tasks": 1},
        "rollout": {"group_size": w["group"], "max_turns": 1, "max_new_tokens": w["new_tokens"],
                    "max_total_tokens": w["new_tokens"] + 64, "ignore_eos": w["ignore_eos"],
                    "temperature": 1.0, "concurrency": 4096,
                    "interrupt_mode": interrupt_mode},
        "learner": {"lr": w["lr"], "num_minibatches": 1, "dtype": w["dtype"],
                    "micro_batch_tokens": w.get("micro_batch_tokens", 32768),
                    # bf16: the learner levers of the recipes' GPU presets
                    **({"attention_kernel": "triton", "compile": True,
                        "selective_recompute": True} if bf16 else {})},
        "train": {"steps": steps + warmup, "tasks_per_step": w["tasks"], "eval_every": 0,
                  "max_staleness": staleness, "gil_switch_interval_ms": switch_ms,
                  "max_inflight_groups": inflight},
    })  # fmt: skip
    free, total = torch.cuda.mem_get_info()
    print(
        f"  {name}: engine {'process' if engine_process else 'thread'}, "
        f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB free",
        file=sys.stderr,
        flush=True,
    )
    server, url = None, ""
    if engine_process:  # the run's engine, served apart; its KV cache a share of the card
        served = config.model_copy(
            update={"inference": config.inference.model_copy(update={"kv_cache_frac": 0.25})}
        )
        dump_config(served, path := Path(run_dir, "serve.yaml"))
        server, url = start_server(["--config", str(path)], Path(run_dir, "serve.log"), 300.0)
        inference = config.inference.model_copy(
            update={"endpoints": [url], "weight_sync": "tensor"}
        )
        config = config.model_copy(update={"inference": inference})
    try:
        trainer = Trainer(config)
    except BaseException:
        if server is not None:
            stop_server(server)
        raise
    busy, kernels, syncs, gcp = GpuBusy(), KernelBusy(gaps), SyncCount(), GcPauses(gc_sites)
    sampler = StackSampler() if stacks else None
    rows_seen = EngineRows(
        (lambda: server_running_rows(url)) if url else
        (lambda: tuple(trainer.client.stats()[k]
                       for k in ("num_running_reqs", "num_waiting_reqs")))
    )  # fmt: skip
    engine_steps = None if url else EngineSteps(trainer.client, trainer)
    if not deliver_at_launch and not url:  # the engine before: results before the next launch
        batcher = trainer.client._batcher
        apply = batcher.apply

        def apply_then_deliver(*args: Any) -> None:
            apply(*args)
            batcher.deliver()

        batcher.apply = apply_then_deliver
    marks: dict[int, float] = {}

    t_start = time.perf_counter()

    def on_step(rec: dict[str, Any]) -> None:
        if "perf/tokens" in rec:
            if int(rec["step"]) in (warmup, warmup + steps):  # the timed window's ends
                # (a sync at every step would hold the event loop, and with it the engine's
                # next plan, until the card is idle: a gap of the measurement's own a step)
                torch.cuda.synchronize()
            marks[int(rec["step"])] = time.perf_counter()
            print(f"  {name} step {rec['step']}: {marks[int(rec['step'])] - t_start:.1f} s",
                  file=sys.stderr, flush=True)  # fmt: skip
            if int(rec["step"]) == warmup:
                seen["alloc0"] = allocator_counts()
                busy.start()
                kernels.start()
                rows_seen.start()
                gcp.start(rows_seen.t0)
                if sampler is not None:
                    sampler.start(rows_seen.t0)
                if engine_steps is not None:
                    engine_steps.start(rows_seen.t0)
                if count_syncs:
                    syncs.start()
            if int(rec["step"]) == warmup + steps:  # before the run's final eval and checkpoint
                syncs.stop()
                # the collections first: reading the kernel trace makes ~9,000 young ones
                # (counted in the timed steps' until 2026-11-28: their "0.4-0.6 s" was this)
                seen.update(gc=gcp.stop(), running=rows_seen.stop(), smi=busy.stop(),
                            kernels=kernels.stop())  # fmt: skip
                if sampler is not None:
                    sampler.stop()
                seen["engine_steps"] = engine_steps.stop() if engine_steps else None
                end = allocator_counts()
                seen["alloc"] = {k: (end[k] - seen["alloc0"][k]) / steps for k in end}

    seen: dict[str, Any] = {}
    trainer.on_step = on_step
    try:
        asyncio.run(trainer.run())
    finally:
        if server is not None:
            stop_server(server)
    running, gpu_busy_smi, gpu_busy = seen["running"], seen["smi"], seen["kernels"]
    recs = [json.loads(ln) for ln in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in recs if "perf/tokens" in r and r["step"] > warmup]
    wall = marks[warmup + steps] - marks[warmup]
    tokens = sum(r["perf/tokens"] for r in timed)
    per_step = {
        "rollout_wait": sum(r["time/wait_s"] for r in timed) / steps,
        "update": sum(r["time/train_s"] for r in timed) / steps,
        "weight_push": sum(r["time/sync_s"] for r in timed) / steps,
    }
    per_step["other"] = wall / steps - sum(per_step.values())
    return {
        "tokens_per_s": tokens / wall,
        "tokens_per_step": tokens / steps,
        "step_s": wall / steps,
        "time_split_s": per_step,
        # the profiler sees its own process only: with the engine apart, the card's figure
        "gpu_busy": gpu_busy_smi if engine_process else gpu_busy,
        "gpu_busy_nvidia_smi": gpu_busy_smi,
        "gpu_busy_learner_process": gpu_busy if engine_process else None,
        "engine": "process" if engine_process else "thread",
        "weight_push_s": min(r["time/sync_s"] for r in timed),
        "overlap_tokens_per_step": sum(r.get("pipeline/overlap_tokens", 0) for r in timed) / steps,
        # engine vs learner log-probs of the trained tokens, the timed steps' mean of each
        # figure: numeric (tokens of the version trained; rollout.interrupt_mode=in_place adds
        # its stale prefixes here) and lag (older versions)
        "mismatch": {k.split("/")[1]: _mean_of(timed, k) for k in MISMATCH_KEYS},
        "learner_tokens_per_s": tokens / sum(r["time/train_s"] for r in timed),
        "params": sum(p.numel() for p in trainer.model.parameters()),
        "engine_rows": rows,
        "decode_steps": config.inference.decode_steps,  # the setting's default unless given
        "inflight_groups": inflight,
        "engine_running_rows": running,
        "syncs_per_step": {k: v / steps for k, v in syncs.parts.items()},
        "gc": seen["gc"],  # the timed steps' collections by generation: count, ms, full ones
        # each thread's most sampled places (1 ms samples) while the card idled 5 ms or more
        "stacks": None
        if sampler is None
        else sampler.in_gaps(
            [
                (a + (kernels._t0 - rows_seen.t0) * 1e3, d)
                for a, d in kernels.timeline["idle_gaps"]
                if d >= 5
            ]
        ),  # fmt: skip
        # cudaMalloc / cudaFree (device-wide synchronisations) and allocator retries per step
        "allocator_per_step": seen["alloc"],
        "stream_gaps": kernels.gaps,
        # the engine's (ms, running, waiting) every 10 ms, and each timed step's end, wait,
        # update and push (s), on the sampler's clock: where the engine idles in a step
        "timeline": {
            "rows": rows_seen.timeline,
            "steps": [
                {
                    "end_ms": round((marks[int(r["step"])] - rows_seen.t0) * 1e3),
                    "wait_s": round(r["time/wait_s"], 4),
                    "update_s": round(r["time/train_s"], 4),
                    "push_s": round(r["time/sync_s"], 4),
                    "inflight": r.get("pipeline/inflight_groups"),
                    "buffered": r.get("pipeline/buffered_groups"),
                }
                for r in timed
            ],
            # the engine's computed plans, pauses, resumes, pushes and arrivals; the card's
            # busy share per 10 ms and idle gaps, its clock `card_offset_ms` ahead of this one
            "engine": seen["engine_steps"],
            "card": kernels.timeline,
            "card_offset_ms": round((kernels._t0 - rows_seen.t0) * 1e3, 2),
        },
        "sync_sites_per_step": {k: v / steps for k, v in syncs.sites.most_common(12)},
    }


def _mean_of(records: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in records if key in r]
    return sum(values) / len(values) if values else None


def main() -> None:
    """Run the workloads, print a table and, last, the headline JSON."""
    a = parse_args(__doc__.splitlines()[0], list(WORKLOADS))
    if not torch.cuda.is_available():
        sys.exit("loop_gpu.py needs a CUDA device")
    WORKLOADS["qwen3-0.6b"]["new_tokens"] = a.response_tokens
    for name in a.workloads if a.tasks else []:
        WORKLOADS[name]["tasks"] = a.tasks
    card = torch.cuda.get_device_name(0)
    results: dict[str, dict[str, Any]] = {}
    for name in a.workloads:
        runs: dict[str, dict[str, Any]] = {}
        settle_default = engine_module.RESUME_SETTLE_MAX_S
        for engine, switch_ms, mbt, inflight, mode, steps, settle, pg, dl in itertools.product(
            a.engine,
            a.switch_interval_ms,
            a.micro_batch_tokens,
            a.inflight_groups,
            a.interrupt_mode,
            a.decode_steps,
            a.resume_settle_ms,
            a.prefill_graphs,
            a.deliver_at_launch,
        ):
            prefill_module.PREFILL_GRAPHS = pg == "on"
            engine_module.RESUME_SETTLE_MAX_S = settle_default
            WORKLOADS[name]["micro_batch_tokens"] = mbt
            ours = agentrl_loop(name, a.steps, a.warmup, a.max_staleness, a.engine_rows,
                                a.count_syncs, switch_ms, engine == "process",
                                a.stream_gaps, inflight, mode, steps, settle,
                                a.stacks, dl == "on", a.gc_sites)  # fmt: skip
            label = (f"engine {engine}, switch interval {switch_ms} ms, micro-batch {mbt}, "
                     f"in-flight groups {ours['inflight_groups']}, interrupt {mode}, "
                     f"decode steps {ours['decode_steps']}, resume settle "
                     f"{settle_default * 1e3 if settle is None else settle:g} ms, "
                     f"prefill graphs {pg}, deliver at launch {dl}")  # fmt: skip
            keys = ("tokens_per_s", "gpu_busy", "gpu_busy_nvidia_smi", "step_s",
                    "learner_tokens_per_s", "weight_push_s", "time_split_s",
                    "engine_running_rows", "mismatch", "gc")  # fmt: skip
            runs[label] = {k: ours[k] for k in keys}
            update = ours["time_split_s"]["update"]
            if ours["stream_gaps"]:
                print(f"[gaps] {json.dumps(ours['stream_gaps'])}", flush=True)
            print(f"[timeline] {json.dumps(ours['timeline'])}", flush=True)
            if ours["gc"]["sites"]:
                print(f"[gc] {json.dumps(ours['gc']['sites'])}", flush=True)
            if ours["stacks"] is not None:
                print(f"[stacks] {json.dumps(ours['stacks'])}", flush=True)
            print(f"[progress] {name}, {label}: {ours['tokens_per_s']:,.0f} tokens/s, "
                  f"GPU busy {ours['gpu_busy']:.1%}, update {update:.2f} s, "
                  f"push {ours['weight_push_s'] * 1e3:.1f} ms, engine rows running "
                  f"{ours['engine_running_rows']}, mismatch {ours['mismatch']}, "
                  f"gc {ours['gc']['collections']} {ours['gc']['ms']} ms",
                  flush=True)  # fmt: skip
            gc.collect()  # the trainer's cycles, then its cached blocks
            torch.cuda.empty_cache()
        ours["runs"] = runs
        trl = None if a.no_trl else trl_loop(WORKLOADS[name], a.trl_steps, a.warmup)
        torch.cuda.empty_cache()
        results[name] = {"agentrl": ours, "trl": trl}
        split = ", ".join(f"{k} {v:.2f}" for k, v in ours["time_split_s"].items())
        print(f"\n{name} on {card} ({ours['params'] / 1e6:.0f}M parameters)")
        rows = [("agentrl loop", ours), ("TRL loop", trl)] if trl else [("agentrl loop", ours)]
        for label, r in rows:
            print(
                f"  {label:13s} {r['tokens_per_s']:10,.0f} tokens/s  {r['step_s']:.2f} s/step"
                f"  ({r['tokens_per_step']:,.0f} tokens/step)"
            )
        print(f"    agentrl per step (s): {split}")
        print(
            f"    GPU busy {ours['gpu_busy']:.1%} (nvidia-smi {ours['gpu_busy_nvidia_smi']:.1%},"
            f" engine {ours['engine']})"
            f"  weight push {ours['weight_push_s'] * 1e3:.1f} ms"
            f"  learner alone {ours['learner_tokens_per_s']:,.0f} tokens/s"
            f"  overlap tokens/step {ours['overlap_tokens_per_step']:,.0f}"
        )
        seen = ours["engine_running_rows"]
        print(f"    engine rows {ours['engine_rows']}; running: mean {seen['mean']:.1f}, "
              f"any {seen['active']:.1%} of {seen['samples']} samples; none running but some "
              f"queued {seen['queued']:.1%}")  # fmt: skip
        print(f"    allocator per step {ours['allocator_per_step']}")
        if ours["syncs_per_step"]:
            print(f"    syncs per step {ours['syncs_per_step']}")
            for site, k in ours["sync_sites_per_step"].items():
                print(f"      {k:8.1f}  {site}")
        if trl:
            print(f"    speedup vs TRL {ours['tokens_per_s'] / trl['tokens_per_s']:.2f}x")
    head = results[a.workloads[-1]]
    ours, trl = head["agentrl"], head["trl"]
    print(json.dumps({
        "workload": a.workloads[-1],
        "loop_tokens_per_s": round(ours["tokens_per_s"], 1),
        "trl_loop_tokens_per_s": None if trl is None else round(trl["tokens_per_s"], 1),
        "loop_speedup_vs_trl": None if trl is None else
        round(ours["tokens_per_s"] / trl["tokens_per_s"], 3),
        "time_split": {k: round(v, 4) for k, v in ours["time_split_s"].items()},
        "gpu_busy": round(ours["gpu_busy"], 3),
        "gpu_busy_nvidia_smi": round(ours["gpu_busy_nvidia_smi"], 3),
        "weight_push_s": round(ours["weight_push_s"], 4),
        "all": results,
        "card": card,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
