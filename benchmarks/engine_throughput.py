"""LocalEngine throughput: 1, 8 and 64 concurrent requests against sequential `model.generate`.

Same model, same prompt length, same number of new tokens (EOS ignored), temperature 1 with
full-vocabulary sampling. `--model tiny` (default) runs anywhere on CPU; `--model
qwen3-0.6b-shape` builds a Qwen3-0.6B-shaped model from its config with random weights (bf16 on
a GPU). Also measures how far the engine's returned log-probs are from a teacher-forced forward
pass of the same model (the mismatch the learner sees).

Prints a table, then as the last line one JSON object with the headline figures:
`batching_speedup_64` = engine tokens/s with 64 concurrent requests / sequential `model.generate`
tokens/s (one request at a time).

    python benchmarks/engine_throughput.py                       # CPU, tiny model
    python benchmarks/engine_throughput.py --model qwen3-0.6b-shape --new-tokens 256
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import time
from typing import Any

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from agentrl.inference.base import SamplingParams
from agentrl.inference.engine import LocalEngine
from agentrl.tiny import QWEN3_0_6B_SHAPE, build_tiny


def build_model(name: str, device: str) -> tuple[Any, Any]:
    if name == "tiny":
        model, tokenizer = build_tiny()
        return model.to(device), tokenizer
    config = Qwen3Config(**QWEN3_0_6B_SHAPE, eos_token_id=151645, pad_token_id=151643)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(dtype)
    return model.eval(), None  # no tokenizer needed: ids in, ids out


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            name = next(
                line.split(":", 1)[1].strip() for line in f if line.startswith("model name")
            )
    except (OSError, StopIteration):
        name = platform.processor() or platform.machine() or "cpu"
    return f"{name} ({os.cpu_count()} cpus, {torch.get_num_threads()} torch threads)"


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=gen).tolist()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bench_hf(model: Any, batch: list[list[int]], new_tokens: int, device: str) -> float:
    """Sequential `model.generate`, one prompt at a time: total tokens/s."""
    sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        for prompt in batch:
            ids = torch.tensor([prompt], device=device)
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                pad_token_id=0,
            )
            assert out.shape[1] == len(prompt) + new_tokens
    sync(device)
    return len(batch) * new_tokens / (time.perf_counter() - start)


async def bench_engine(
    engine: LocalEngine, batch: list[list[int]], new_tokens: int, device: str
) -> tuple[float, list[Any]]:
    """All of `batch` at once through the engine: total tokens/s and the outputs."""
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True)
    sync(device)
    start = time.perf_counter()
    outs = await asyncio.gather(*(engine.generate(p, params) for p in batch))
    sync(device)
    elapsed = time.perf_counter() - start
    assert all(len(o.output_ids) == new_tokens for o in outs)
    return len(batch) * new_tokens / elapsed, outs


def logprob_mismatch(model: Any, batch: list[list[int]], outs: list[Any], device: str) -> float:
    """Max |engine log-prob - teacher-forced log-prob| over a few sampled sequences."""
    worst = 0.0
    with torch.inference_mode():
        for prompt, out in zip(batch[:4], outs[:4], strict=False):
            ids = torch.tensor([prompt + out.output_ids], device=device)
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
            ref = torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt) :, None])[:, 0]
            got = torch.tensor(out.logprobs, device=device)
            worst = max(worst, (ref - got).abs().max().item())
    return worst


async def run(args: argparse.Namespace) -> dict[str, Any]:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = build_model(args.model, device)
    vocab = model.config.vocab_size
    levels = [int(c) for c in args.concurrency.split(",")]
    engine = LocalEngine(model, tokenizer, max_batch_size=max(levels), seed=0)
    await bench_engine(engine, prompts(2, args.prompt_len, vocab, 99), 4, device)  # warm-up
    bench_hf(model, prompts(1, args.prompt_len, vocab, 98), 4, device)
    hf_tps = bench_hf(
        model, prompts(args.hf_requests, args.prompt_len, vocab, 1), args.new_tokens, device
    )
    rows: dict[int, float] = {}
    mismatch = 0.0
    for level in levels:
        batch = prompts(level, args.prompt_len, vocab, 2 + level)
        rows[level], outs = await bench_engine(engine, batch, args.new_tokens, device)
        mismatch = max(mismatch, logprob_mismatch(model, batch, outs, device))
    await engine.aclose()
    machine = torch.cuda.get_device_name() if device.startswith("cuda") else cpu_name()
    print(f"\nLocalEngine throughput ({args.model}, {device}: {machine})")
    print(f"prompt {args.prompt_len} tokens, {args.new_tokens} new tokens per request\n")
    print(f"{'setup':<34}{'tokens/s':>12}{'vs sequential':>16}")
    print(f"{'sequential model.generate':<34}{hf_tps:>12.1f}{1.0:>15.2f}x")
    for level, tps in rows.items():
        print(f"{f'LocalEngine, {level} concurrent':<34}{tps:>12.1f}{tps / hf_tps:>15.2f}x")
    print(f"\nmax |engine logprob - teacher-forced| = {mismatch:.2e}")
    result: dict[str, Any] = {
        "benchmark": "engine_throughput",
        "model": args.model,
        "device": device,
        "machine": machine,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "hf_sequential_tokens_per_s": round(hf_tps, 1),
        **{f"engine_{level}_tokens_per_s": round(tps, 1) for level, tps in rows.items()},
        "logprob_max_abs_diff": mismatch,
    }
    if 64 in rows:
        result["batching_speedup_64"] = round(rows[64] / hf_tps, 2)
        if 1 in rows:
            result["engine_speedup_64_vs_1"] = round(rows[64] / rows[1], 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["tiny", "qwen3-0.6b-shape"], default="tiny")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--concurrency", default="1,8,64")
    parser.add_argument("--hf-requests", type=int, default=4, help="sequential baseline requests")
    args = parser.parse_args()
    result = asyncio.run(run(args))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
