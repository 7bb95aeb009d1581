"""Causal varlen attention on a GPU: FlashAttention-2 (torch's ``varlen_attn``) vs a Triton kernel.

The learner's packed micro-batch: sequences of a 512-token prompt and a 256-2,048-token response
(seeded), packed to about ``--tokens`` tokens; Qwen3-0.6B's heads (16 query, 8 KV, dim 128),
bf16. Both kernels get the same inputs. Checks each output and gradient against a float32
reference per sequence; times forward and forward + backward (median of CUDA-event timings).

Usage: ``python benchmarks/attention_gpu.py`` (CUDA only).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

from agentrl.kernels.varlen import varlen_attention as flash_attention
from agentrl.kernels.varlen import varlen_kwargs


def _lengths(tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    out: list[int] = []
    while True:
        n = 512 + rng.randint(256, 2048)
        if sum(out) + n > tokens:
            return out
        out.append(n)


def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]
) -> torch.Tensor:
    outs, start = [], 0
    rep = q.shape[1] // k.shape[1]
    for n in lengths:
        s = slice(start, start + n)
        qs, ks, vs = (t[s].double().transpose(0, 1) for t in (q, k, v))
        ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=q.shape[-1] ** -0.5)
        outs.append(o.transpose(0, 1))
        start += n
    return torch.cat(outs)


def _time(fn: Callable[[], object], repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.manual_seed(0)
    lengths = _lengths(args.tokens, 0)
    total, hq, hkv, d = sum(lengths), 16, 8, 128
    cu = torch.tensor(
        [0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32
    )
    max_len, scale = max(lengths), d**-0.5
    q = torch.randn(total, hq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(total, hkv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(total, hkv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(total, hq, d, device="cuda", dtype=torch.bfloat16)
    fa_options = varlen_kwargs(hq, hkv)
    kernels = {
        "flash2": lambda: flash_attention(q, k, v, cu, max_len, scale, fa_options),
    }
    try:
        from agentrl.kernels.attention import varlen_attention

        kernels["triton"] = lambda: varlen_attention(q, k, v, cu, max_len, scale)
        compiled = torch.compile(varlen_attention, dynamic=True)
        kernels["triton-compiled"] = lambda: compiled(q, k, v, cu, max_len, scale)
    except ImportError as exc:
        print(f"triton kernel unavailable: {exc}")
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = _reference(qd, kd, vd, lengths)
    ref_grads = torch.autograd.grad(ref, (qd, kd, vd), grad.double())
    flops_fwd = sum(4 * n * n / 2 * hq * d for n in lengths)  # causal: half the square
    rows, result = [], {}
    for name, attend in kernels.items():
        try:
            out = attend()
            grads = torch.autograd.grad(out, (q, k, v), grad)
        except Exception as exc:  # report and go on to the next kernel
            print(f"{name}: {type(exc).__name__}: {str(exc)[:600]}")
            continue
        err = (out.double() - ref).abs().max().item()
        gerr = max(
            (g.double() - r).abs().max().item() for g, r in zip(grads, ref_grads, strict=True)
        )

        def step(attend: Callable[[], torch.Tensor] = attend) -> None:
            torch.autograd.grad(attend(), (q, k, v), grad)

        with torch.no_grad():
            fwd = _time(attend, args.repeats)
        both = _time(step, args.repeats)
        bwd = both - fwd
        rows.append((name, fwd, bwd, flops_fwd / fwd / 1e9, 2.5 * flops_fwd / bwd / 1e9, err, gerr))
        result[f"{name}_fwd_bwd_ms"] = round(both, 3)
        result[f"{name}_max_err"] = err
        result[f"{name}_max_grad_err"] = gerr
    print(
        f"{torch.cuda.get_device_name()}: {len(lengths)} sequences, {total} tokens, heads 16/8/128"
    )
    head = ("kernel", "fwd ms", "bwd ms", "fwd TF/s", "bwd TF/s", "err", "grad err")
    print(f"{head[0]:<14}" + "".join(f"{h:>10}" for h in head[1:]))
    for name, fwd, bwd, tf, tb, err, gerr in rows:
        print(f"{name:<14}{fwd:10.3f}{bwd:10.3f}{tf:10.0f}{tb:10.0f}{err:10.2e}{gerr:10.2e}")
    if "triton_fwd_bwd_ms" in result:
        result["speedup"] = round(result["flash2_fwd_bwd_ms"] / result["triton_fwd_bwd_ms"], 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
