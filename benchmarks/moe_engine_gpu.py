"""Qwen3-MoE decode: the paged engine (grouped experts, CUDA graphs) vs the transformers path.

The Qwen3-30B-A3B shape (hidden 2048, 32 query / 4 KV heads of 128, 128 experts, 8 routed per
token, expert width 768, Qwen's vocabulary) with ``--layers`` decoder layers (48 in the real
model) and random weights, in bf16 on one card. The same model runs ``--concurrency`` requests
at once (prompt ``--prompt-len`` random ids, ``--new-tokens`` new ones, EOS ignored,
temperature 1) through ``LocalEngine(paged=False)`` (transformers' forward: its experts loop
over the experts hit) and then ``LocalEngine(paged=True)``, each after a warm-up round (compile
and graph capture are not timed). Also: the largest gap between the paged engine's log-probs
and a teacher-forced transformers pass over a few of its sequences (bf16 both), and the share of
routed experts the paged engine recorded that the teacher-forced routers chose too.

Last line: one JSON object, ``hf_tokens_per_s``, ``paged_tokens_per_s``, ``speedup`` (the
issue's target: >= 10 at 64 concurrent), ``card`` and the settings.

    python benchmarks/moe_engine_gpu.py                  # one card, ~1-2 minutes
    python benchmarks/moe_engine_gpu.py --dry-run        # the tiny MoE on the CPU, seconds
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from agentrl.inference.base import SamplingParams
from agentrl.inference.engine import LocalEngine
from agentrl.routing import RoutingCapture, expert_overlap
from agentrl.tiny import QWEN3_30B_A3B_SHAPE, build_tiny_moe

sys.path.insert(0, str(Path(__file__).parent))
from engine_throughput import (  # noqa: E402
    bench_engine,
    cpu_name,
    logprob_mismatch,
    prompts,
    sync,
)


def build(args: argparse.Namespace) -> Any:
    """The model on ``args.device``: the 30B-A3B shape in bf16, or the tiny MoE (dry run)."""
    torch.manual_seed(0)
    model: Any
    if args.dry_run:
        model, _ = build_tiny_moe(seed=0, num_hidden_layers=args.layers)
        return model.to(args.device).eval()
    config = Qwen3MoeConfig(
        **{**QWEN3_30B_A3B_SHAPE, "num_hidden_layers": args.layers,
           "max_position_embeddings": args.prompt_len + args.new_tokens + 64},
        rms_norm_eps=1e-6,
        router_aux_loss_coef=0.0,
        eos_token_id=151645,
        pad_token_id=151643,
    )
    with torch.device(args.device):
        model = Qwen3MoeForCausalLM(config)
    return model.to(torch.bfloat16).eval()


def routing_agreement(model: Any, batch: list[list[int]], outs: list[Any], device: str) -> float:
    """Share of the paged engine's recorded experts the teacher-forced routers chose too."""
    shares = []
    for prompt, out in zip(batch[:4], outs[:4], strict=False):
        seq = prompt + out.output_ids
        with RoutingCapture(model) as cap, torch.inference_mode():
            model(input_ids=torch.tensor([seq[:-1]], device=device))
        shares.append(expert_overlap(torch.from_numpy(out.routed_experts), cap.pop()).mean())
    return float(torch.stack(shares).mean())


async def timed(
    engine: LocalEngine, batch: list[list[int]], args: argparse.Namespace
) -> tuple[float, list[Any]]:
    """Tokens/s of ``batch`` at once, after an untimed warm-up round of the same batch size."""
    await bench_engine(engine, batch, min(args.new_tokens, 8), args.device)
    return await bench_engine(engine, batch, args.new_tokens, args.device)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    model = build(args)
    vocab = int(model.config.vocab_size)
    batch = prompts(args.concurrency, args.prompt_len, vocab, seed=0)
    common: dict[str, Any] = dict(
        max_batch_size=args.concurrency,
        seed=0,
        max_prefill_tokens=args.concurrency * args.prompt_len,
        return_routed_experts=False,
    )
    hf = LocalEngine(model, None, paged=False, **common)
    try:
        hf_tps, _ = await timed(hf, batch, args)
    finally:
        await hf.aclose()
    sync(args.device)
    common["return_routed_experts"] = True  # recorded as a rollout records them
    paged = LocalEngine(
        model, None, paged=True, kv_cache_gib=args.kv_cache_gib, compile=args.compile, **common
    )
    try:
        paged_tps, _ = await timed(paged, batch, args)
        params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, ignore_eos=True)
        few = batch[:4]
        outs = await asyncio.gather(
            *(paged.generate(p, params, return_routed_experts=True) for p in few)
        )
        path = f"{paged.path} ({paged.path_reason})"
    finally:
        await paged.aclose()
    return {
        "benchmark": "moe_engine_gpu",
        "model": "tiny-moe" if args.dry_run else "qwen3-30b-a3b-shape",
        "layers": args.layers,
        "concurrency": args.concurrency,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "hf_tokens_per_s": round(hf_tps, 1),
        "paged_tokens_per_s": round(paged_tps, 1),
        "speedup": round(paged_tps / hf_tps, 2),
        "target_speedup": 10.0,
        "logprob_mismatch": logprob_mismatch(model, few, outs, args.device),
        "routing_agreement": routing_agreement(model, few, outs, args.device),
        "paged_path": path,
        "card": torch.cuda.get_device_name() if args.device.startswith("cuda") else cpu_name(),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (48 in the model)")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--kv-cache-gib", type=float, default=4.0)
    parser.add_argument("--no-compile", dest="compile", action="store_false",
                        help="paged layers uncompiled (faster start)")  # fmt: skip
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--dry-run", action="store_true",
                        help="the tiny MoE on the CPU: checks the code path")  # fmt: skip
    args = parser.parse_args(argv)
    if args.dry_run:
        args.device = args.device or "cpu"
        args.layers, args.concurrency = min(args.layers, 2), min(args.concurrency, 4)
        args.prompt_len, args.new_tokens, args.kv_cache_gib = 8, 4, 0.05
        args.compile = False
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if not args.dry_run and not args.device.startswith("cuda"):
        sys.exit("moe_engine_gpu: needs a CUDA device (or --dry-run)")
    if not 1 <= args.concurrency <= 1024 or not 1 <= args.layers <= 48:
        sys.exit("moe_engine_gpu: --concurrency in 1..1024 and --layers in 1..48")
    result = asyncio.run(run(args))
    print(
        f"{result['model']} x{result['layers']} layers, {result['concurrency']} concurrent: "
        f"transformers {result['hf_tokens_per_s']:.0f} tok/s, paged "
        f"{result['paged_tokens_per_s']:.0f} tok/s ({result['speedup']:.1f}x) on {result['card']}"
    )
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
