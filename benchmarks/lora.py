"""Full fine-tuning vs LoRA (``learner.lora``) on the same model and batch.

For each of ``full`` and ``lora``, from the same base weights:

- the learner's GSPO-token update: tokens/s (median of ``--repeats``), peak memory (CUDA's
  ``max_memory_allocated``; on a CPU the resident tensors plus the tracked peak of the step's
  CPU storages, ``learner_step.PeakMemory``), and the AdamW state's bytes;
- the push to an embedded engine in this process (full: ``update_weights_from_state_dict``;
  LoRA: ``load_lora_adapter_tensors``, only the adapter tensors), and to a real
  ``agentrl serve`` over HTTP (full: write the checkpoint + ``/update_weights_from_disk``; LoRA:
  write the peft adapter + ``/load_lora_adapter``, the old one unloaded);
- with ``--steps N``: held-out success after each of N ``agentrl train`` steps on a small task
  (two-digit addition on the tiny model, after a short full cold start that both arms share).

    python benchmarks/lora.py --model qwen3-4b-shape --device cuda      # one GPU (H100/H200)
    python benchmarks/lora.py --dry-run                                  # tiny model, CPU

``qwen3-4b-shape`` is :mod:`agentrl.standin`'s Qwen3-4B (random weights) written to a temp dir.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from _serve import start_server, stop_server  # noqa: E402
from learner_step import make_batch, peak_bytes, resident_bytes  # noqa: E402

from agentrl.inference.client.sglang_client import SGLangClient  # noqa: E402
from agentrl.inference.engine import LocalEngine  # noqa: E402
from agentrl.learner import Learner, LearnerConfig  # noqa: E402
from agentrl.learner.config import LoraConfig  # noqa: E402

LORA = {"rank": 32, "alpha": 64.0}  # every linear layer (the default targets)


def base_dir(args: argparse.Namespace, work: Path) -> Path:
    """The base model as a Hugging Face directory (what ``agentrl serve --model`` reads)."""
    out = work / "base"
    if args.model == "tiny":
        from agentrl.tiny import build_tiny

        model, tok = build_tiny(seed=0)
        model.save_pretrained(out)
        tok.save_pretrained(out)
        return out
    from agentrl.standin import build_standin

    return build_standin("qwen3-4b", out, dtype="bfloat16", device=args.device)


def load(path: Path, device: torch.device) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    return model, AutoTokenizer.from_pretrained(path)


def optimizer_bytes(learner: Learner) -> int:
    return sum(
        v.numel() * v.element_size()
        for s in learner.optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )


async def push_in_process(learner: Learner, engine: Any, lora: bool, repeats: int) -> float:
    """Median seconds of one push to the embedded engine (after one warm-up push)."""
    try:
        return await _pushes(learner, engine, lora, repeats)
    finally:
        await engine.aclose()


async def _pushes(learner: Learner, engine: Any, lora: bool, repeats: int) -> float:
    times = []
    for k in range(repeats + 1):
        harness.sync(learner.device)
        t = time.perf_counter()
        if lora:
            old = list(engine.loaded_lora_adapters)
            scaling = LORA["alpha"] / LORA["rank"]
            adapter = learner.adapter_state()
            await engine.load_lora_adapter_tensors(f"v{k}", adapter, scaling, weight_version=k)
            for name in old:
                await engine.unload_lora_adapter(name)
        else:
            await engine.update_weights_from_state_dict(learner.live_weights(), k)
        harness.sync(learner.device)
        if k:
            times.append(time.perf_counter() - t)
    return harness.median(times)


async def push_http(
    learner: Learner, tok: Any, url: str, work: Path, lora: bool, repeats: int
) -> float:
    """Median seconds of one push to ``agentrl serve`` at ``url``: write, then load."""
    times = []
    async with SGLangClient(url, timeout_s=1200) as client:
        for k in range(repeats + 1):
            t = time.perf_counter()
            if lora:
                path = learner.save_adapter(work / f"adapter-{k}")
                await client.load_lora_adapter(f"v{k}", str(path))
                await client.use_lora_adapter(f"v{k}", k)
            else:
                learner.save_pretrained(work / "push", tokenizer=tok)
                await client.update_weights_from_disk(str(work / "push"), k)
            if k:
                times.append(time.perf_counter() - t)
    return harness.median(times)


def arm(args: argparse.Namespace, base: Path, work: Path, url: str, lora: bool) -> dict[str, Any]:
    """One arm's figures; ``url``: the ``agentrl serve`` both arms push to (its base first)."""
    device = torch.device(args.device)
    harness.free(device)  # the other arm's learner and engine
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    model, tok = load(base, device)
    # the engine serves the base (copied before the learner adds adapters), in its own dtype
    engine_model = copy.deepcopy(model).to(dtype)
    config = LearnerConfig(
        lr=1e-5 if lora else 1e-6,
        dtype=args.dtype,
        micro_batch_tokens=args.micro_batch_tokens,
        num_minibatches=1,
        lora=LoraConfig(**LORA) if lora else None,
    )
    learner = Learner(model, config)
    shape = argparse.Namespace(**vars(args), chunk_size=config.logprob_chunk_size)
    batch = make_batch(model, shape, args.dtype)
    tokens = sum(len(s.tokens) for s in batch)
    step_s = harness.median(
        harness.timed(lambda: learner.step(batch), device, args.warmup, args.repeats)
    )
    peak = peak_bytes(lambda: learner.step(batch), device, resident_bytes(learner))
    out: dict[str, Any] = {
        "tokens_per_s": tokens / step_s,
        "peak_mem_gib": peak / 2**30,
        "optimizer_state_bytes": optimizer_bytes(learner),
        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }
    engine = LocalEngine(engine_model, tok, device=device, dtype=dtype, kv_cache_gib=1.0)
    out["push_in_process_s"] = asyncio.run(push_in_process(learner, engine, lora, args.repeats))
    del engine, engine_model
    harness.free(device)
    mode = "lora" if lora else "full"
    out["push_http_s"] = asyncio.run(push_http(learner, tok, url, work / mode, lora, args.repeats))
    return out


def held_out(steps: int, work: Path, lora: bool | None, base: str = "tiny") -> list[float]:
    """Held-out success after each of ``steps`` RL steps (two-digit addition, tiny model).

    ``lora=None``: the shared base, a full cold start to 30% held-out success (``steps`` 0),
    exported for the two arms (``recipes/math_agent.py``'s cpu-tiny and cpu-tiny-lora).
    """
    from agentrl.config import load_config
    from agentrl.loop.trainer import Trainer

    run = work / {None: "held-out-base", True: "held-out-lora", False: "held-out-full"}[lora]
    learner: dict[str, Any] = {"lr": 1e-3, "lora": LORA} if lora else {"lr": 1e-4}
    cold = {"steps": 600, "lr": 1e-3, "batch_size": 64, "target_success": 0.3, "check_every": 25}
    tree = {
        "run_dir": str(run), "seed": 0, "model": {"path": base},
        "env": {"id": "math-v0", "kwargs": {"prompt_template": "{question}=",
                                            "extract": "last_number"},
                "task_kwargs": {"source": "addition"}, "num_train_tasks": 4096,
                "num_eval_tasks": 200},
        "rollout": {"group_size": 8, "max_turns": 1, "max_new_tokens": 6,
                    "max_total_tokens": 64},
        "cold_start": cold if lora is None else {"steps": 0},
        "learner": {**learner, "micro_batch_tokens": 1024},
        "train": {"steps": steps, "tasks_per_step": 32, "eval_every": 1, "checkpoint_every": 0,
                  "export": lora is None},
    }  # fmt: skip
    asyncio.run(Trainer(load_config(tree)).run())
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["eval/success_rate"] for r in records if "eval/success_rate" in r]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["tiny", "qwen3-4b-shape"], default="qwen3-4b-shape")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    ap.add_argument("--num-seqs", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--response-min", type=int, default=256)
    ap.add_argument("--response-max", type=int, default=1024)
    ap.add_argument("--micro-batch-tokens", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=0, help="held-out success per RL step (tiny)")
    ap.add_argument("--dry-run", action="store_true", help="tiny model, CPU, small batch")
    harness.add_common_args(ap, warmup=1, repeats=3)
    args = ap.parse_args()
    if args.dry_run:
        args.model, args.device, args.num_seqs, args.prompt_len = "tiny", "cpu", 4, 8
        args.response_min, args.response_max, args.micro_batch_tokens = 8, 24, 1024
        args.warmup, args.repeats = 1, 1
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory(prefix="lora_bench_") as tmp:
        work = Path(tmp)
        base = base_dir(args, work)

        def report(label: str, r: dict[str, Any]) -> None:
            print(
                f"{label:5s} {r['tokens_per_s']:>10,.0f} tokens/s  peak {r['peak_mem_gib']:.3f} "
                f"GiB  optimizer {r['optimizer_state_bytes'] / 2**20:,.1f} MiB  push "
                f"{r['push_in_process_s'] * 1e3:,.1f} ms in process, "
                f"{r['push_http_s'] * 1e3:,.1f} ms over HTTP",
                flush=True,
            )

        served = ["--model", str(base), "--device", args.device, "--weights-dir", str(work)]
        if device.type == "cuda":  # the learner shares the card: a small cache, not half of it
            served += ["--kv-cache-gib", "2"]
        proc, url = start_server(served, work / "serve.log")
        try:
            arms = harness.side_by_side(
                {"full": lambda: arm(args, base, work, url, False),
                 "lora": lambda: arm(args, base, work, url, True)},
                report,
            )  # fmt: skip
        finally:
            stop_server(proc)
        success = {}
        if args.steps:
            held_out(0, work, None)
            start = str(work / "held-out-base" / "export")
            success = {m: held_out(args.steps, work, m == "lora", start) for m in ("full", "lora")}
            for m, s in success.items():
                print(f"{m:5s} held-out success per step: {s}")
    full, lora = arms["full"], arms["lora"]
    harness.emit({
        "model": args.model, "card": harness.card(device), "dtype": args.dtype,
        "full": full, "lora": lora,
        "push_speedup_in_process": full["push_in_process_s"] / lora["push_in_process_s"],
        "push_speedup_http": full["push_http_s"] / lora["push_http_s"],
        "peak_mem_ratio": lora["peak_mem_gib"] / full["peak_mem_gib"],
        "optimizer_state_ratio": lora["optimizer_state_bytes"] / full["optimizer_state_bytes"],
        "held_out_success": success, "versions": harness.versions("torch", "transformers"),
    })  # fmt: skip


if __name__ == "__main__":
    main()
