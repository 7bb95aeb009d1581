"""One GSPO-token learner update: tokens/s, MFU, peak memory, recompute cost, chunked head.

Runs on CUDA when available, else on CPU. What it measures:

* ``engine``: :meth:`Learner.step` with the engine's log-probs as old log-probs (the default);
* ``recompute``: the same step with ``recompute_old_logprobs=True`` (one more forward pass);
  ``recompute_time_ratio`` = recompute time / engine time (expected about 4/3);
* ``chunked`` vs ``full``: forward + backward of the sampled tokens' log-probs on one packed
  micro-batch, through the learner's chunked head or through the model's full ``(tokens,
  vocab)`` logits; ``chunked_peak_mem_ratio`` = chunked peak / full peak (memory above the
  weights). The gap grows with the vocabulary: ``tiny`` has 107 tokens, Qwen3 151,936
  (``tiny-bigvocab`` puts Qwen3's vocabulary on the tiny body to show it on a CPU).

MFU = 6 x parameters x tokens / step time / measured peak, the peak being a large matmul timed
here (bf16 on a GPU; float32 on a CPU, the dtype CPU runs train in). Peak memory: CUDA's
``max_memory_allocated`` on a GPU; on a CPU, weights + optimizer state + the largest sum of
live tensors that the step's operators allocated (tracked with a dispatch mode, in a separate
untimed run).

Usage:
    python benchmarks/learner_step.py                          # CPU, tiny model
    python benchmarks/learner_step.py --model tiny-bigvocab    # CPU, Qwen3 vocabulary
    python benchmarks/learner_step.py --model qwen3-0.6b-shape # GPU, 8k-token micro-batches
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import Qwen3Config, Qwen3ForCausalLM

from agentrl.learner import Learner, LearnerConfig, TrainSample
from agentrl.learner.logprobs import LogprobModel
from agentrl.learner.packing import build_packed_batch, pack_sequences
from agentrl.tiny import QWEN3_0_6B_SHAPE, build_tiny_model

sys.path.insert(0, str(Path(__file__).parent))
import harness  # noqa: E402
from harness import card, median, sync  # noqa: E402

QWEN3_06B = QWEN3_0_6B_SHAPE
# per model: (sequences, prompt tokens, response min, response max, micro-batch tokens)
SHAPES = {
    "tiny": (32, 64, 32, 192, 2048),
    "tiny-bigvocab": (8, 64, 32, 192, 1024),
    "qwen3-0.6b-shape": (32, 512, 256, 2048, 8192),
}


class PeakMemory(TorchDispatchMode):
    """Largest total size of live CPU tensor storages allocated by operators in the block."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = 0
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            self.current -= self.live.pop(key)[1]
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                if storage._cdata not in self.live:
                    self.live[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
                    self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        return out


def build_model(name: str, device: torch.device, attn: str) -> Qwen3ForCausalLM:
    if name == "tiny":
        model = build_tiny_model()
    else:
        shape = QWEN3_06B if name == "qwen3-0.6b-shape" else dict(vocab_size=151936)
        base = build_tiny_model().config.to_dict() if name == "tiny-bigvocab" else {}
        config = Qwen3Config(**{**base, **shape})
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(config)
    model.config._attn_implementation = attn
    return model.to(device)


def make_batch(model: Qwen3ForCausalLM, args: argparse.Namespace, dtype: str) -> list[TrainSample]:
    """Random token sequences whose engine log-probs are this model's teacher-forced ones."""
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    device = next(model.parameters()).device
    module = LogprobModel(
        model,
        temperature=1.0,
        chunk_size=args.chunk_size,
        autocast_dtype=torch.bfloat16 if dtype == "bfloat16" else None,
    )
    seqs, masks = [], []
    for _ in range(args.num_seqs):
        r = int(torch.randint(args.response_min, args.response_max + 1, (1,), generator=g))
        seqs.append(torch.randint(3, vocab, (args.prompt_len + r,), generator=g).tolist())
        masks.append([0] * args.prompt_len + [1] * r)
    logprobs: dict[int, list[float]] = {}
    for micro in pack_sequences([len(s) for s in seqs], args.micro_batch_tokens):
        batch = build_packed_batch(
            [seqs[i] for i in micro],
            [masks[i] for i in micro],
            attn_implementation=model.config._attn_implementation,
            device=device,
        )
        with torch.no_grad():
            flat = iter(module.run(batch)[0].float().cpu().tolist())
        for i in micro:
            logprobs[i] = [next(flat) if m else 0.0 for m in masks[i]]
    adv = torch.randn(args.num_seqs, generator=g).tolist()
    return [
        TrainSample(s, m, logprobs[i], [0 if x else -1 for x in m], [adv[i]] * len(s))
        for i, (s, m) in enumerate(zip(seqs, masks, strict=True))
    ]


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median wall time of ``fn`` after one warm-up call."""
    return median(harness.timed(fn, device, 1, repeats))


def interleaved(fns: list[Callable[[], object]], device: torch.device, repeats: int) -> list[float]:
    """Median wall time of each of ``fns``, run in turn (so load drift hits them alike)."""
    times: list[list[float]] = [[] for _ in fns]
    for r in range(repeats + 1):
        for fn, acc in zip(fns, times, strict=True):
            sync(device)
            t = time.perf_counter()
            fn()
            sync(device)
            if r:  # the first round warms up
                acc.append(time.perf_counter() - t)
    return [statistics.median(acc) for acc in times]


def peak_bytes(fn: Callable[[], object], device: torch.device, resident: int = 0) -> int:
    """Peak memory of ``fn``: CUDA's allocator peak, or ``resident`` + tracked CPU peak."""
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        sync(device)
        return int(torch.cuda.max_memory_allocated(device))
    with PeakMemory() as tracker:
        fn()
    return resident + tracker.peak


def resident_bytes(learner: Learner) -> int:
    tensors = list(learner.module.parameters())
    tensors += [
        v
        for s in learner.optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    ]
    return sum(t.numel() * t.element_size() for t in tensors)


def peak_matmul_tflops(device: torch.device, dtype: torch.dtype) -> float:
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = timed(lambda: a @ b, device, repeats=10 if device.type == "cuda" else 3)
    return 2 * n**3 / seconds / 1e12


def head_pass(
    model: Qwen3ForCausalLM,
    samples: list[TrainSample],
    args: argparse.Namespace,
    dtype: str,
    chunked: bool,
) -> Callable[[], None]:
    """Forward + backward of the log-probs of one packed micro-batch's sampled tokens."""
    device = next(model.parameters()).device
    micro = pack_sequences([len(s.tokens) for s in samples], args.micro_batch_tokens)[0]
    batch = build_packed_batch(
        [samples[i].tokens for i in micro],
        [samples[i].loss_mask for i in micro],
        attn_implementation=model.config._attn_implementation,
        device=device,
    )
    autocast = torch.bfloat16 if dtype == "bfloat16" else None
    module = LogprobModel(
        model, temperature=1.0, chunk_size=args.chunk_size, autocast_dtype=autocast
    )

    def run() -> None:
        if chunked:
            logprobs, _ = module.run(batch)
        else:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast is not None):
                logits = model(
                    input_ids=batch.input_ids,
                    position_ids=batch.position_ids,
                    attention_mask=batch.attention_mask,
                    use_cache=False,
                ).logits
            lp = torch.log_softmax(logits[0].float(), -1)  # (N, V) float32
            logprobs = lp[batch.pred_index].gather(1, batch.targets[:, None])
        logprobs.sum().backward()
        model.zero_grad(set_to_none=True)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--attn", default="sdpa", help="sdpa, eager, flash_attention_2, ...")
    parser.add_argument("--num-seqs", type=int)
    parser.add_argument("--prompt-len", type=int)
    parser.add_argument("--response-min", type=int)
    parser.add_argument("--response-max", type=int)
    parser.add_argument("--micro-batch-tokens", type=int)
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    args = parser.parse_args()
    names = ("num_seqs", "prompt_len", "response_min", "response_max", "micro_batch_tokens")
    for name, default in zip(names, SHAPES[args.model], strict=True):
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    rows, figures = run(args, device, dtype)
    print(f"{'measure':<34}{'value':>16}")
    for label, value in rows:
        print(f"{label:<34}{value:>16}")
    print(json.dumps(figures))


def run(
    args: argparse.Namespace, device: torch.device, dtype: str
) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    model = build_model(args.model, device, args.attn)
    samples = make_batch(model, args, dtype)
    tokens = sum(len(s.tokens) for s in samples)
    num_params = sum(p.numel() for p in model.parameters())
    base = dict(
        lr=1e-6,
        micro_batch_tokens=args.micro_batch_tokens,
        dtype=dtype,
        logprob_chunk_size=args.chunk_size,
        gradient_checkpointing=args.gradient_checkpointing,
    )
    learner = Learner(model, LearnerConfig(**base))
    learner_rc = Learner(model, LearnerConfig(**base, recompute_old_logprobs=True))
    engine_s, recompute_s = interleaved(
        [lambda: learner.step(samples), lambda: learner_rc.step(samples)], device, args.repeats
    )
    step_peak = peak_bytes(lambda: learner.step(samples), device, resident_bytes(learner))
    passes = {chunked: head_pass(model, samples, args, dtype, chunked) for chunked in (True, False)}
    head_s = dict(
        zip(passes, interleaved(list(passes.values()), device, args.repeats), strict=True)
    )
    head_peak = {chunked: peak_bytes(fn, device) for chunked, fn in passes.items()}
    weights = num_params * 4
    peak_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    peak_tflops = peak_matmul_tflops(device, peak_dtype)
    tokens_per_s = tokens / engine_s
    mfu = 6 * num_params * tokens_per_s / (peak_tflops * 1e12)
    if device.type == "cuda":  # allocator peak includes the weights: compare what is above
        head_peak = {k: v - weights for k, v in head_peak.items()}
    ratio = head_peak[True] / head_peak[False]
    machine = card(device)
    gib = 2**30
    rows = [
        ("device", machine),
        ("model", args.model),
        ("parameters (M)", f"{num_params / 1e6:.1f}"),
        ("batch tokens", str(tokens)),
        ("sequences", str(len(samples))),
        ("micro-batch tokens", str(args.micro_batch_tokens)),
        ("dtype", dtype),
        ("step s (engine log-probs)", f"{engine_s:.3f}"),
        ("step s (recompute)", f"{recompute_s:.3f}"),
        ("recompute time ratio", f"{recompute_s / engine_s:.3f}"),
        ("tokens/s (engine)", f"{tokens_per_s:.0f}"),
        (f"measured peak TFLOP/s ({peak_dtype})", f"{peak_tflops:.2f}"),
        ("MFU", f"{mfu:.3f}"),
        ("step peak memory GiB", f"{step_peak / gib:.3f}"),
        ("head pass s, chunked / full", f"{head_s[True]:.3f} / {head_s[False]:.3f}"),
        ("head pass peak GiB, chunked", f"{head_peak[True] / gib:.4f}"),
        ("head pass peak GiB, full logits", f"{head_peak[False] / gib:.4f}"),
        ("chunked peak memory ratio", f"{ratio:.3f}"),
    ]
    figures = {
        "tokens_per_s": round(tokens_per_s, 1),
        "mfu": round(mfu, 4),
        "recompute_time_ratio": round(recompute_s / engine_s, 3),
        "chunked_peak_mem_ratio": round(ratio, 4),
        "step_s": round(engine_s, 4),
        "recompute_step_s": round(recompute_s, 4),
        "peak_mem_gib": round(step_peak / gib, 4),
        "peak_tflops": round(peak_tflops, 2),
        "peak_dtype": str(peak_dtype).split(".")[-1],
        "tokens": tokens,
        "params": num_params,
        "model": args.model,
        "dtype": dtype,
        "device": device.type,
        "machine": machine,
        "threads": torch.get_num_threads(),
    }
    return rows, figures


if __name__ == "__main__":
    main()
