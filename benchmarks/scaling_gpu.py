"""The learner on 1, 2 and 4 GPUs (FSDP2), the whole loop on 1 vs 2, and the NCCL vs disk push.

* **Learner scaling** (weak scaling, as the issue asks): 32 sequences *per GPU* of a 512-token
  prompt and a 256-2,048-token response (seeded, as in ``learner_gpu.py``), Qwen3-0.6B and
  Qwen3-1.7B shapes built from config (random weights, no download), one optimizer step per
  update. Every rank gets the whole batch and trains its token-balanced share
  (:mod:`agentrl.learner.distributed`). Tokens/s counts the whole batch's tokens;
  ``scaling_efficiency_N = tokens/s on N GPUs / (N x tokens/s on 1 GPU)``; peak memory is the
  largest of the ranks'. Every GPU count runs the same learner settings, so the ratio measures
  the sharding: by default the packed body with every lever of ``learner_gpu.py``'s headline
  (bf16 autocast and bf16 head, compiled layers, selective recomputation, Triton attention
  where Triton is installed), which runs under FSDP2 as in one process;
  ``--body transformers`` measures transformers' forward instead.
* **Loop** (``--loop``, :mod:`_scaling_loop`): ``agentrl train``'s trainer on 1, 2 and 4 GPUs
  (``torchrun``; each rank's engine on its card), warm, over ``--loop-steps`` timed
  steps: weak and strong scaling of a short and a generation-bound workload, each rank's split
  of a step, with the same learner body and levers (``loop_weak_efficiency_N``,
  ``loop_strong_speedup_N``, ``loop_profile``); ``--loop-dedicated`` adds the dedicated-inference
  layout on N >= 2 cards (``loop_dedicated_vs_colocated_N``).
* **Push**: ``benchmarks/weight_push.py``'s measurement for both shapes: the safetensors write
  plus ``/update_weights_from_disk`` vs the bucketed broadcast to ``agentrl serve`` on another
  card (NCCL; gloo on a CPU host).

Usage on a 4-GPU host: ``python benchmarks/scaling_gpu.py`` (it launches
``torchrun --nproc-per-node N`` for each N itself; ``--gpus 1 2`` on a 2-GPU host). One
measurement alone: ``torchrun --nproc-per-node 2 benchmarks/scaling_gpu.py --worker --out F``.
``--no-learner``: the loop and the push only.
CPU dry run (gloo, a tiny shape, seconds): ``python benchmarks/scaling_gpu.py --device cpu``.
Last line: JSON with ``tokens_per_s_by_gpus``, ``scaling_efficiency_2``, ``scaling_efficiency_4``
(per shape), ``peak_mem_gib_by_gpus``, ``loop_tokens_per_s_by_gpus``, ``nccl_push_s``,
``disk_push_s`` and ``card``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from agentrl.learner import Learner, LearnerConfig, TrainSample
from agentrl.tiny import QWEN3_0_6B_SHAPE, tiny_config

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _scaling_loop  # noqa: E402 - benchmarks/ is a folder of scripts

GIB = 2**30
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {},
    "qwen3-0.6b": dict(QWEN3_0_6B_SHAPE),
    "qwen3-1.7b": dict(QWEN3_0_6B_SHAPE, hidden_size=2048, intermediate_size=6144),
}


# ---------------------------------------------------------------- one measurement (a rank)


def build_model(shape: str, device: torch.device) -> Any:
    """The shape's model with seeded random weights (the same on every rank), float32."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = tiny_config(107) if shape == "tiny" else Qwen3Config(**SHAPES[shape])
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with device:
        return Qwen3ForCausalLM(config).float()


def make_samples(args: argparse.Namespace, world: int, vocab: int) -> list[TrainSample]:
    """``num_seqs`` sequences per GPU (seeded: every rank builds the same batch)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(args.num_seqs * world):
        r = int(torch.randint(args.response_min, args.response_max + 1, (1,), generator=g))
        tokens = torch.randint(3, vocab, (args.prompt_len + r,), generator=g).tolist()
        mask = [0] * args.prompt_len + [1] * r
        adv = float(torch.randn(1, generator=g))
        # engine log-probs of a typical size: the ratio's value does not change the work done
        out.append(TrainSample(tokens, mask, [-3.0 * m for m in mask], [0] * len(mask),
                               [adv] * len(mask)))  # fmt: skip
    return out


def body_levers(args: argparse.Namespace) -> dict[str, Any]:
    """The learner body and its levers (``LearnerConfig`` fields), for the learner and the loop.

    On a card: bf16 autocast and a bf16 head; the packed body (``--body packed``, the default,
    or ``auto``) adds ``learner_gpu.py``'s headline levers: compiled layers, selective
    recomputation and the Triton attention kernel (FlashAttention-2 without Triton).
    """
    cuda = args.device == "cuda"
    dtype = "bfloat16" if cuda else "float32"
    kw: dict[str, Any] = dict(body=args.body, dtype=dtype, head_dtype=dtype,
                              fsdp_reduce=args.fsdp_reduce, fsdp_unit=args.fsdp_unit)  # fmt: skip
    if args.fsdp_bf16_gather and cuda:
        kw["fsdp_gather_dtype"] = "bfloat16"
    if args.body != "transformers" and cuda:
        kw.update(compile=True, selective_recompute=True)
        if importlib.util.find_spec("triton") is not None:
            kw["attention_kernel"] = "triton"
    return kw


def learner_config(args: argparse.Namespace, shape: str) -> LearnerConfig:
    kw: dict[str, Any] = dict(
        lr=1e-6,
        num_minibatches=1,
        micro_batch_tokens=args.micro_batch_tokens,
        logprob_chunk_size=args.chunk_size,
        **body_levers(args),
    )
    if shape == "qwen3-1.7b" and not args.no_checkpointing:
        kw["gradient_checkpointing"] = True  # float32 master weights and AdamW take 27 GB
    return LearnerConfig(**kw)


def measure_learner(args: argparse.Namespace, shape: str) -> dict[str, Any]:
    """Median update time of ``shape`` on this process group; every rank calls."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if args.device == "cuda" \
        else torch.device("cpu")  # fmt: skip
    model = build_model(shape, device)
    samples = make_samples(args, world, model.config.vocab_size)
    learner = Learner(model, learner_config(args, shape))
    t_warm = time.perf_counter()
    for k in range(args.warmup):
        learner.step(samples)
        if rank == 0:
            print(f"[worker] {shape} on {world}: warm-up step {k + 1}/{args.warmup} at "
                  f"{time.perf_counter() - t_warm:.0f} s", file=sys.stderr, flush=True)  # fmt: skip
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(args.repeats):
        dist.barrier()
        t = time.perf_counter()
        learner.step(samples)  # ends with the merged metrics: every rank is done
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else 0.0
    if args.profile:  # one more update, rank 0 under the profiler (every rank steps)
        profile_step(learner, samples, device, rank == 0, f"{shape} on {world}")
    peaks: list[Any] = [None] * world
    dist.all_gather_object(peaks, peak)
    body = learner.body
    del learner, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    step_s = statistics.median(times)
    tokens = sum(len(s.tokens) for s in samples)
    return {"gpus": world, "rank": rank, "step_s": step_s, "tokens": tokens,
            "tokens_per_s": tokens / step_s, "peak_gib": max(peaks), "body": body}  # fmt: skip


def profile_step(
    learner: Learner, samples: list[TrainSample], device: torch.device, on: bool, what: str
) -> None:
    """One update; on rank 0 under ``torch.profiler`` (printed to stderr, which the driver
    streams): device busy and gaps, top kernels."""
    if not on:
        learner.step(samples)
        return
    sys.path.insert(0, str(HERE))
    from learner_profile import profile_update

    profile_update(learner, samples, device, gaps=12, rows=25, label=f"{what}, rank 0",
                   file=sys.stderr)  # fmt: skip


def worker(args: argparse.Namespace) -> None:
    """Under torchrun: measure every shape on this process group; rank 0 writes ``--out``."""
    timeout = timedelta(seconds=1800)
    if args.device == "cuda":
        local = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", timeout=timeout, device_id=local)
    else:
        dist.init_process_group("gloo", timeout=timeout)
    results = {shape: measure_learner(args, shape) for shape in args.shapes}
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------- the driver


def forwarded(args: argparse.Namespace) -> list[str]:
    """The learner options, for the workers' command lines."""
    out = ["--device", args.device, "--body", args.body, "--shapes", *args.shapes]
    for name in ("num_seqs", "prompt_len", "response_min", "response_max", "micro_batch_tokens",
                 "chunk_size", "warmup", "repeats", "fsdp_reduce", "fsdp_unit"):  # fmt: skip
        out += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    out += ["--fsdp-bf16-gather"] if args.fsdp_bf16_gather else []
    out += ["--profile"] if args.profile else []
    return out + (["--no-checkpointing"] if args.no_checkpointing else [])


def run_workers(args: argparse.Namespace, gpus: int, work: Path) -> dict[str, Any]:
    out = work / f"learner-{gpus}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={gpus}", str(Path(__file__).resolve()), "--worker",
           "--out", str(out), *forwarded(args)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run(cmd, env=env, stdout=sys.stderr)  # the workers' output as it comes
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}"}
    return dict(json.loads(out.read_text()))


def run_loop(
    args: argparse.Namespace, gpus: int, work: Path, dedicated: bool = False
) -> list[dict[str, Any]]:
    """Every loop measurement on ``gpus`` ranks, in one torchrun launch (``_scaling_loop``);
    ``dedicated``: ``gpus // 2`` learner ranks, their engines on the other cards."""
    out = work / f"loop-{gpus}{'-dedicated' if dedicated else ''}.json"
    ranks = gpus // 2 if dedicated else gpus
    steps = ["--loop-warmup", str(args.loop_warmup), "--loop-steps", str(args.loop_steps),
             "--loop-max-staleness", str(args.loop_max_staleness)]
    for w in ("short", "gen"):
        steps += [f"--loop-{w}-tasks", str(getattr(args, f"loop_{w}_tasks")),
                  f"--loop-{w}-tokens", str(getattr(args, f"loop_{w}_tokens"))]  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={ranks}", str(Path(__file__).resolve()), "--worker", "--out",
           str(out), "--device", args.device, "--body", args.body, *steps,
           "--loop-plan", json.dumps(_scaling_loop.plan(args, gpus, dedicated))]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run(cmd, env=env, stdout=sys.stderr)  # the workers' output as it comes
    if proc.returncode != 0:
        return [{"gpus": gpus, "error": f"exit {proc.returncode}"}]
    return [_scaling_loop.summary(per_rank) for per_rank in json.loads(out.read_text())]


def run_push(args: argparse.Namespace) -> dict[str, Any]:
    sys.path.insert(0, str(HERE))
    from weight_push import measure

    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    shapes = ["tiny"] if args.device == "cpu" else [s for s in args.shapes if s != "tiny"]
    out = {}
    for s in shapes:
        out[s] = asyncio.run(measure(s, args.repeats, gpus))
        progress(f"push {s}: {out[s]}")
    return out


def progress(line: str) -> None:
    """One measurement, printed (flushed) as soon as it is made."""
    print(f"[progress] {line}", flush=True)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--gpus", type=int, nargs="+", default=None, help="GPU counts (1 2 4)")
    ap.add_argument("--shapes", nargs="+", default=None, choices=list(SHAPES))
    ap.add_argument("--body", choices=["transformers", "packed", "auto"], default="packed",
                    help="packed: with every lever (compile, selective, Triton, bf16 head)")
    ap.add_argument("--num-seqs", type=int, default=32, help="sequences per GPU")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--response-min", type=int, default=256)
    ap.add_argument("--response-max", type=int, default=2048)
    ap.add_argument("--micro-batch-tokens", type=int, default=12288)
    ap.add_argument("--chunk-size", type=int, default=1024)
    ap.add_argument("--no-checkpointing", action="store_true", help="none on the 1.7B shape")
    ap.add_argument("--fsdp-reduce", choices=["auto", "micro_batch", "mini_batch"],
                    default="auto", help="learner.fsdp_reduce (default: the learner's default)")
    ap.add_argument("--fsdp-unit", choices=["auto", "block", "model"], default="auto",
                    help="learner.fsdp_unit: FSDP2 units per decoder block or one for the model")
    ap.add_argument("--fsdp-bf16-gather", action="store_true",
                    help="learner.fsdp_gather_dtype=bfloat16 (on a card)")
    ap.add_argument("--profile", action="store_true",
                    help="profile one more update on rank 0 (printed by the workers)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--learner", action=argparse.BooleanOptionalAction, default=True,
                    help="measure learner scaling (--no-learner: the loop and the push only)")
    ap.add_argument("--loop", action=argparse.BooleanOptionalAction, default=True,
                    help="the whole loop's weak and strong scaling (_scaling_loop.py)")
    _scaling_loop.add_args(ap)
    ap.add_argument("--dry-run", action="store_true",
                    help="on the CPU: gloo ranks, a tiny model, a few steps (= --device cpu)")
    ap.add_argument("--push", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--worker", action="store_true", help="(internal) one torchrun measurement")
    ap.add_argument("--out", default=None, help="(worker) result file")
    args = ap.parse_args()
    if args.dry_run:
        args.device = "cpu"
    cpu = args.device == "cpu"
    if args.shapes is None:
        args.shapes = ["tiny"] if cpu else ["qwen3-0.6b", "qwen3-1.7b"]
    if cpu and not args.worker:  # the dry run: a tiny batch, seconds on two cores
        args.num_seqs, args.prompt_len, args.response_min, args.response_max = 4, 16, 8, 48
        args.micro_batch_tokens, args.chunk_size, args.warmup, args.repeats = 256, 64, 1, 2
        _scaling_loop.dry_run(args)
    if args.gpus is None:
        have = 2 if cpu else torch.cuda.device_count()
        args.gpus = [n for n in (1, 2, 4) if n <= have]
    return args


def main() -> None:
    args = parse_args()
    if args.worker and args.loop_plan is not None:
        _scaling_loop.worker(args)
        return
    if args.worker:
        worker(args)
        return
    work = Path(tempfile.mkdtemp(prefix="scaling_"))
    learner: dict[int, dict[str, Any]] = {}
    for n in args.gpus if args.learner else []:  # each figure as soon as it is measured
        learner[n] = run_workers(args, n, work)
        progress(f"learner on {n} GPU(s): {learner[n]}")
    loop: list[dict[str, Any]] = []
    for n in args.gpus if args.loop else []:
        for dedicated in (False, True) if args.loop_dedicated and n >= 2 else (False,):
            for r in run_loop(args, n, work, dedicated):
                loop.append(r)
                progress(f"loop on {n} GPU(s){' (dedicated)' * dedicated}: {r}")
    loop_ok = [r for r in loop if "error" not in r]
    push = run_push(args) if args.push and (args.device == "cpu" or max(args.gpus) >= 2) else {}
    card = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu (dry run)"

    by_gpus = {s: {n: r[s]["tokens_per_s"] for n, r in learner.items() if s in r}
               for s in args.shapes}  # fmt: skip
    peaks = {s: {n: r[s]["peak_gib"] for n, r in learner.items() if s in r} for s in args.shapes}

    def efficiency(n: int) -> dict[str, float | None]:
        return {s: (v[n] / (n * v[1]) if n in v and 1 in v else None) for s, v in by_gpus.items()}

    print(f"learner scaling on {card} ({args.num_seqs} sequences per GPU, body {args.body})")
    print(f"{'shape':<12}{'GPUs':>5}{'tokens/s':>11}{'step s':>9}{'peak GiB':>10}{'eff.':>7}")
    for s in args.shapes:
        for n, r in learner.items():
            if s not in r:
                print(f"{s:<12}{n:>5}  failed: {r.get('error')}")
                continue
            eff = by_gpus[s][n] / (n * by_gpus[s][1]) if 1 in by_gpus[s] else float("nan")
            print(f"{s:<12}{n:>5}{r[s]['tokens_per_s']:>11.0f}{r[s]['step_s']:>9.3f}"
                  f"{r[s]['peak_gib']:>10.2f}{eff:>7.1%}")  # fmt: skip
    if loop_ok:
        print(f"the loop on {card}: sampled tokens/s (over {args.loop_steps} timed steps "
              f"after {args.loop_warmup} untimed) and each rank's median split of a step (s)")
        _scaling_loop.print_table(loop_ok)
    for s, r in push.items():
        print(f"push {s}: disk {r['disk_s']:.3f} s, distributed {r['push_s']:.3f} s "
              f"({r['speedup']:.1f}x), {r['bytes'] / 1e9:.2f} GB")  # fmt: skip
    nccl = args.device == "cuda"
    print(json.dumps({
        "tokens_per_s_by_gpus": {s: {n: round(v, 1) for n, v in d.items()} for s, d in
                                 by_gpus.items()},
        "scaling_efficiency_2": efficiency(2),
        "scaling_efficiency_4": efficiency(4),
        "peak_mem_gib_by_gpus": {s: {n: round(v, 2) for n, v in d.items()} for s, d in
                                 peaks.items()},
        "loop_tokens_per_s_by_gpus": {r["gpus"]: r["tokens_per_s"] for r in loop_ok
                                      if r["workload"] == "short" and r["mode"] != "strong"},
        **_scaling_loop.figures(loop_ok),
        "loop_errors": [r for r in loop if "error" in r],
        "nccl_push_s": {s: r["push_s"] for s, r in push.items()} if nccl else None,
        "gloo_push_s": None if nccl else {s: r["push_s"] for s, r in push.items()},
        "disk_push_s": {s: r["disk_s"] for s, r in push.items()},
        "body": args.body, "fsdp_reduce": args.fsdp_reduce,
        "fsdp_bf16_gather": args.fsdp_bf16_gather, "fsdp_unit": args.fsdp_unit,
        "num_seqs_per_gpu": args.num_seqs, "card": card,
        "gpus": torch.cuda.device_count() if nccl else 0, "torch": torch.__version__,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
