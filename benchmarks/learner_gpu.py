"""The learner's GSPO-token update on a GPU, lever by lever, and TRL's loss path side by side.

Batch (the issue's): 32 sequences of a 512-token prompt and a 256-2,048-token response (uniform,
seeded), random token ids, one advantage per sequence, a Qwen3-0.6B-shaped model built from
config with seeded random weights (no download). One update = one optimizer step over the 32
sequences (TRL: micro-batches of 4 with gradient accumulation; agentrl: packed micro-batches of
``--micro-batch-tokens``). Tokens counted: real prompt + response tokens (no padding).

agentrl variants, each from the same initial weights (``--variants`` picks):

* ``transformers``: transformers' forward on packed rows (sdpa + block mask), float32 head;
* ``packed``: :mod:`agentrl.kernels.packed_body` (varlen FlashAttention, no mask), float32 head;
* ``packed+bf16head``: the head matmuls with bf16 inputs (float32 accumulation and softmax);
* ``packed+bf16head+compile``: the per-layer functions ``torch.compile``d (the headline);
* ``...+16k``: 16,384-token micro-batches instead of ``--micro-batch-tokens`` (12,288):
  fewer micro-batches are faster and need more activation memory;
* ``...+sel``: selective recomputation (only matmul and attention outputs kept);
* ``...+triton``: ``attention_kernel="triton"`` (:mod:`agentrl.kernels.attention`) instead of
  FlashAttention-2;
* ``...+tuned``: ``compile_tuning`` (inductor's coordinate-descent tuning of the fused kernels);
* ``...+ckpt`` / ``...+ckpt-half``: all / half of the layers checkpointed.

Times are medians of ``--repeats`` updates after ``--warmup`` (5) updates: the compiled
kernels autotune for the first few batch shapes they meet, so early steps are slower; both
sides get the same warm-up.

TRL (``benchmarks/trl_side/``; TRL's wheel carried with ``benchmarks/trl_wheels.sh``):
``GRPOTrainer``'s own loss path in the GSPO settings, bf16 weights, without and with gradient
checkpointing.

Headline: the fastest agentrl variant without checkpointing whose peak memory is at most TRL's
without checkpointing (the issue's "same checkpointing setting").

Correctness: the headline configuration's first step (loss, gradient norm) against a float32
reference (transformers body, float32 everything) from the same weights and batch; both with
``recompute_old_logprobs`` so that ratios are exactly 1 in each.

MFU = 6 x parameters x tokens/s / the card's measured bf16 matmul peak (8192^3 matmul).

Long sequences (``--seq-lens 8192 16384 32768``): one variant (``--long-variant``) on batches of
``--long-tokens`` tokens made of sequences of exactly each length (a ``--prompt-len`` prompt and a
trained response filling the rest); the micro-batch is raised to the length where it is shorter,
so every sequence is whole in one micro-batch. Prints tokens/s, MFU with and without attention
(:func:`train_flops`, prime-rl's convention) and peak memory per length, beside prime-rl's
published 11.9k tokens/s (MFU 11%) for Qwen3-0.6B at 16k on one H100.

Usage: ``python benchmarks/learner_gpu.py [--variants ...] [--no-trl]``
(``--model tiny`` runs the same code on a CPU in seconds, for a smoke test).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from agentrl.learner import Learner, LearnerConfig, TrainSample
from agentrl.learner.distributed import StepStats
from agentrl.learner.update import _Prepared
from agentrl.tiny import QWEN3_0_6B_SHAPE, tiny_config

sys.path.insert(0, str(Path(__file__).parent))
from harness import (  # noqa: E402,F401 (sync: for learner_profile)
    add_common_args,
    card,
    emit,
    free,
    median,
    side_by_side,
    sync,
    timed,
)
from learner_step import peak_matmul_tflops  # noqa: E402

GIB = 2**30
FAST: dict[str, Any] = dict(body="packed", head_dtype="bfloat16", compile=True)
VARIANTS: dict[str, dict[str, Any]] = {
    "transformers": dict(body="transformers", head_dtype="float32"),
    "packed": dict(body="packed", head_dtype="float32"),
    "packed+bf16head": dict(body="packed", head_dtype="bfloat16"),
    "packed+bf16head+compile": FAST,
    "packed+bf16head+compile+16k": dict(FAST, micro_batch_tokens=16384),
    "packed+bf16head+compile+sel": dict(FAST, selective_recompute=True),
    "packed+bf16head+compile+sel+16k": dict(
        FAST, selective_recompute=True, micro_batch_tokens=16384
    ),
    "packed+bf16head+compile+sel+16k+triton": dict(
        FAST, selective_recompute=True, micro_batch_tokens=16384, attention_kernel="triton"
    ),
    "packed+bf16head+compile+sel+16k+tuned": dict(
        FAST, selective_recompute=True, micro_batch_tokens=16384, compile_tuning=True
    ),
    "packed+bf16head+compile+ckpt": dict(FAST, gradient_checkpointing=True),
    # the exact mode: batch-invariant kernels, uncompiled (compare with packed+bf16head)
    "packed+bf16head+exact": dict(body="packed", head_dtype="bfloat16", batch_invariant=True),
    "packed+bf16head+compile+ckpt-half": dict(FAST, checkpoint_layers=-2),
}
HEADLINE = "packed+bf16head+compile"
PEAK_BF16_TFLOPS = 989.4  # H100 SXM dense bf16 (no sparsity); the H200 has the same compute
PRIME_RL_16K_TOKENS_PER_S = 11_900.0  # prime-rl's baseline: Qwen3-0.6B, 16k, one H100, MFU 11%


def train_flops(config: Any, seq_len: int, loss_tokens: int) -> tuple[float, float]:
    """(matmul, attention) FLOPs of one training step (forward + backward) over one sequence.

    Model FLOPs, as prime-rl and PaLM count them: a matmul is 2 FLOPs per multiply-add forward
    and twice that backward (input and weight gradients), so training = 3x forward; recomputation
    (selective recompute, checkpointing, FlashAttention's backward) is not counted, so MFU does
    not rise when a run recomputes more.

    * matmuls: 6 x the matmul weights a token meets: per layer q (hidden x heads*head_dim), k and
      v (hidden x kv_heads*head_dim each), o (heads*head_dim x hidden), the SwiGLU MLP
      (3 x hidden x intermediate); plus the LM head (vocab x hidden) on the ``loss_tokens`` the
      learner's head runs on (only trained positions). Embedding lookups and norms: none.
    * attention, causal: query i scores keys 0..i, so per layer and head the forward's Q K^T
      costs 2 * head_dim * (1 + 2 + ... + T) = head_dim * T(T+1) FLOPs and P V as much again;
      training: 3 * L * heads * 2*head_dim * T(T+1). For Qwen3-0.6B at 16k that is 5.64 GFLOP a
      token, what prime-rl's ``12 * L * hidden * T`` gave there, whose 11% MFU at 11.9k tokens/s
      it reproduces (6 x 596M + 5.64 GFLOP = 9.21 GFLOP/token; 109.6 of 989.4 TFLOP/s). Later
      prime-rl counts the full square (2x this); this keeps the causal half, the work done.
    """
    layers, heads = config.num_hidden_layers, config.num_attention_heads
    hidden, dim = config.hidden_size, config.head_dim
    kv = config.num_key_value_heads
    per_layer = 2 * hidden * heads * dim + 2 * hidden * kv * dim
    per_layer += 3 * hidden * config.intermediate_size
    matmul = 6.0 * (layers * per_layer * seq_len + config.vocab_size * hidden * loss_tokens)
    attention = 3.0 * layers * heads * (dim + dim) * seq_len * (seq_len + 1)
    return matmul, attention


def build_model(args: argparse.Namespace, device: torch.device) -> Qwen3ForCausalLM:
    if args.model == "tiny":
        config = tiny_config(107)
    else:
        config = Qwen3Config(**QWEN3_0_6B_SHAPE)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with device:
        return Qwen3ForCausalLM(config).float()


Batch = tuple[list[list[int]], list[list[int]], list[float]]


def make_batch(args: argparse.Namespace, vocab: int) -> Batch:
    g = torch.Generator().manual_seed(0)
    prompts, completions = [], []
    for _ in range(args.num_seqs):
        r = int(torch.randint(args.response_min, args.response_max + 1, (1,), generator=g))
        prompts.append(torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist())
        completions.append(torch.randint(3, vocab, (r,), generator=g).tolist())
    advantages = torch.randn(args.num_seqs, generator=g).tolist()
    return prompts, completions, advantages


def samples_for(
    prompts: list[list[int]], completions: list[list[int]], advantages: list[float]
) -> list[TrainSample]:
    """Train samples whose engine log-probs are zeros until :func:`with_engine_logprobs`."""
    out = []
    for p, c, a in zip(prompts, completions, advantages, strict=True):
        mask = [0] * len(p) + [1] * len(c)
        out.append(TrainSample(p + c, mask, [0.0] * len(mask), [0] * len(mask), [a] * len(mask)))
    return out


def with_engine_logprobs(learner: Learner, samples: list[TrainSample]) -> list[TrainSample]:
    """The samples with this learner's own pre-update log-probs as the engine's (ratio 1)."""
    minibatches, micro = learner._plan(samples)
    prepared = _Prepared(learner._build, samples)
    own = learner._recompute(samples, micro, prepared, StepStats())
    out = []
    for i, s in enumerate(samples):
        values = iter(own[i].float().cpu().tolist())
        lp = [next(values) if m else 0.0 for m in s.loss_mask]
        out.append(TrainSample(s.tokens, s.loss_mask, lp, s.versions, s.advantages))
    return out


def learner_config(
    args: argparse.Namespace, overrides: dict[str, Any], **extra: Any
) -> LearnerConfig:
    cuda = args.device.type == "cuda"
    kw: dict[str, Any] = dict(
        lr=1e-6,
        num_minibatches=1,
        micro_batch_tokens=args.micro_batch_tokens,
        dtype="bfloat16" if cuda else "float32",
        logprob_chunk_size=args.chunk_size,
    )
    kw.update(overrides, **extra)
    if kw.get("checkpoint_layers") == -2:  # half the layers
        kw["checkpoint_layers"] = args.num_layers // 2
    if not cuda:  # the CPU smoke run: no inductor C++ build
        kw["compile"] = False
    return LearnerConfig(**kw)


def run_variant(
    args: argparse.Namespace,
    init: dict[str, torch.Tensor],
    samples: list[TrainSample],
    name: str,
    **extra: Any,
) -> dict[str, Any]:
    device = args.device
    model = build_model(args, device)
    model.load_state_dict(init)
    learner = Learner(model, learner_config(args, {**VARIANTS[name], **extra}))
    batch = with_engine_logprobs(learner, samples)
    t0 = time.perf_counter()
    first = learner.step(batch)  # warm-up (compiles), and the first step's figures
    for _ in range(args.warmup - 1):
        learner.step(batch)
    warm_s = time.perf_counter() - t0
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = timed(partial(learner.step, batch), device, 0, args.repeats)
    peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else 0.0
    del learner, model
    free(device)
    step_s = median(times)
    return dict(
        step_s=step_s,
        tokens_per_s=sum(len(s.tokens) for s in samples) / step_s,
        peak_gib=peak,
        warmup_s=warm_s,
        first_loss=first["loss/policy"],
        first_grad_norm=first["loss/grad_norm"],
    )


def first_step_check(
    args: argparse.Namespace,
    init: dict[str, torch.Tensor],
    samples: list[TrainSample],
    name: str,
) -> dict[str, float]:
    """Loss and grad norm of the first step: variant ``name`` vs a float32 reference."""
    out = {}
    ref = dict(body="transformers", dtype="float32", head_dtype="float32")
    for label, overrides in (("fast", VARIANTS[name]), ("float32", ref)):
        model = build_model(args, args.device)
        model.load_state_dict(init)
        learner = Learner(model, learner_config(args, overrides, recompute_old_logprobs=True))
        m = learner.step(samples)
        out[f"{label}_loss"], out[f"{label}_grad_norm"] = m["loss/policy"], m["loss/grad_norm"]
        del learner, model
        free(args.device)
    out["loss_rel_diff"] = abs(out["fast_loss"] - out["float32_loss"]) / abs(out["float32_loss"])
    out["grad_norm_rel_diff"] = (
        abs(out["fast_grad_norm"] - out["float32_grad_norm"]) / out["float32_grad_norm"]
    )
    return out


def run_trl(
    args: argparse.Namespace,
    init: dict[str, torch.Tensor],
    batch: Batch,
    checkpointing: bool,
) -> dict[str, Any]:
    from trl_side import trl_figures

    def build() -> Qwen3ForCausalLM:
        model = build_model(args, args.device)
        model.load_state_dict(init)
        return model

    return trl_figures(build, batch, args.device, checkpointing, args.warmup, args.repeats)


def run_long(args: argparse.Namespace, init: dict[str, torch.Tensor], machine: str) -> None:
    """``--seq-lens``: the variant on sequences of each length; a table and the JSON line."""
    config = build_model(args, torch.device("meta")).config
    cuda = args.device.type == "cuda"
    spec = cuda and any(k in machine for k in ("H100", "H200"))
    dtype = torch.bfloat16 if cuda else torch.float32
    peak = PEAK_BF16_TFLOPS if spec else peak_matmul_tflops(args.device, dtype)
    g = torch.Generator().manual_seed(0)
    rows: dict[str, dict[str, Any]] = {}
    for length in args.seq_lens:
        n = max(1, args.long_tokens // length)
        prompts = [torch.randint(3, config.vocab_size, (args.prompt_len,), generator=g).tolist()]
        completions = [torch.randint(3, config.vocab_size, (length - args.prompt_len,),
                                     generator=g).tolist() for _ in range(n)]  # fmt: skip
        samples = samples_for(prompts * n, completions, torch.randn(n, generator=g).tolist())
        variant_micro = VARIANTS[args.long_variant].get("micro_batch_tokens", 0)
        micro = max(variant_micro or args.micro_batch_tokens, length)  # whole sequences
        r = run_variant(args, init, samples, args.long_variant, micro_batch_tokens=micro)
        matmul, attention = train_flops(config, length, length - args.prompt_len)
        achieved = r["tokens_per_s"] / length  # sequences/s
        rows[str(length)] = {
            "sequences": n,
            "micro_batch_tokens": micro,
            "tokens_per_s": round(r["tokens_per_s"], 1),
            "step_s": round(r["step_s"], 4),
            "mfu": round((matmul + attention) * achieved / (peak * 1e12), 4),
            "mfu_no_attention": round(matmul * achieved / (peak * 1e12), 4),
            "attention_flops_frac": round(attention / (matmul + attention), 4),
            "peak_mem_gib": round(r["peak_gib"], 3),
            "warmup_s": round(r["warmup_s"], 1),
        }
        print(f"# {length}: {rows[str(length)]}", flush=True)
    print(f"\ncard: {machine}; peak {peak:.1f} TFLOP/s ({'spec' if spec else 'measured'})")
    print(f"variant {args.long_variant}; {args.long_tokens} tokens per update")
    print(f"{'seq len':>8}{'seqs':>6}{'tokens/s':>11}{'MFU':>8}{'MFU no attn':>13}{'peak GiB':>10}")
    for length, row in rows.items():
        print(f"{length:>8}{row['sequences']:>6}{row['tokens_per_s']:>11.0f}{row['mfu']:>8.3f}"
              f"{row['mfu_no_attention']:>13.3f}{row['peak_mem_gib']:>10.2f}")  # fmt: skip
    at16k = rows.get("16384", {}).get("tokens_per_s")
    print(json.dumps({
        "benchmark": "learner_long",
        "variant": args.long_variant,
        "long_tokens": args.long_tokens,
        "seq_lens": rows,
        "prime_rl_16k_tokens_per_s": PRIME_RL_16K_TOKENS_PER_S,
        "speedup_vs_prime_rl_16k": round(at16k / PRIME_RL_16K_TOKENS_PER_S, 3) if at16k else None,
        "peak_tflops": peak,
        "peak_source": "spec" if spec else "measured",
        "card": machine,
        "torch": torch.__version__,
    }))  # fmt: skip


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["qwen3-0.6b-shape", "tiny"], default="qwen3-0.6b-shape")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--num-seqs", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--response-min", type=int, default=256)
    parser.add_argument("--response-max", type=int, default=2048)
    parser.add_argument("--micro-batch-tokens", type=int, default=12288)
    parser.add_argument("--chunk-size", type=int, default=1024, help="head chunk (tokens)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    add_common_args(parser, warmup=5, repeats=3)
    parser.add_argument("--no-trl", action="store_true", help="skip TRL's side")
    parser.add_argument("--no-check", action="store_true", help="skip the float32 first-step check")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[],
                        help="long-sequence mode: tokens per sequence, e.g. 8192 16384 32768")
    parser.add_argument("--long-tokens", type=int, default=65536,
                        help="long-sequence mode: tokens per update (at least one sequence)")
    parser.add_argument("--long-variant", default="packed+bf16head+compile+sel",
                        choices=list(VARIANTS))  # fmt: skip
    args = parser.parse_args()
    args.device = torch.device(args.device)
    if args.model == "tiny":
        args.prompt_len, args.response_min, args.response_max = 16, 8, 64
        args.micro_batch_tokens, args.chunk_size = 256, 64
    longest = 1024 if args.model == "tiny" else QWEN3_0_6B_SHAPE["max_position_embeddings"]
    for length in args.seq_lens:  # bounded before any allocation
        if not args.prompt_len < length <= longest:
            parser.error(f"--seq-lens: expected {args.prompt_len} < length <= {longest} "
                         f"(prompt < sequence <= the model's context), got {length}")  # fmt: skip
    if args.long_tokens < 1:
        parser.error(f"--long-tokens: expected >= 1, got {args.long_tokens}")
    return args


def main() -> None:
    args = parse_args()
    device = args.device
    model = build_model(args, device)
    init = {k: v.cpu() for k, v in model.state_dict().items()}  # off the card: peaks compare
    num_params = sum(p.numel() for p in model.parameters())
    args.num_layers = model.config.num_hidden_layers
    del model
    machine = card(device)
    if args.seq_lens:
        run_long(args, init, machine)
        return
    batch = make_batch(args, 107 if args.model == "tiny" else QWEN3_0_6B_SHAPE["vocab_size"])
    samples = samples_for(*batch)
    args.tokens = sum(len(s.tokens) for s in samples)
    peak_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    peak_tflops = peak_matmul_tflops(device, peak_dtype)

    def mfu(tokens_per_s: float) -> float:
        return 6 * num_params * tokens_per_s / (peak_tflops * 1e12)

    rows = side_by_side(
        {name: partial(run_variant, args, init, samples, name) for name in args.variants},
        lambda name, row: print(f"# {name}: {row}", flush=True),
    )
    trl: dict[str, dict[str, Any]] = {}
    if not args.no_trl:
        trl = side_by_side(
            {"trl": partial(run_trl, args, init, batch, False),
             "trl+ckpt": partial(run_trl, args, init, batch, True)},
            lambda name, row: print(f"# trl ckpt={name == 'trl+ckpt'}: {row}", flush=True),
        )  # fmt: skip
    # the headline: the fastest agentrl configuration whose peak memory is at most TRL's
    # (same checkpointing setting: none); without TRL, the fastest
    budget = trl["trl"]["peak_gib"] if trl else float("inf")
    fitting = {k: r for k, r in rows.items() if "ckpt" not in k and r["peak_gib"] <= budget}
    headline = max(fitting or rows, key=lambda k: (fitting or rows)[k]["tokens_per_s"])
    best = rows[headline]
    check = {} if args.no_check else first_step_check(args, init, samples, headline)

    print(f"\ncard: {machine}; measured {peak_dtype} matmul peak {peak_tflops:.0f} TFLOP/s")
    print(f"batch: {args.num_seqs} sequences, {args.tokens} tokens; {num_params / 1e6:.0f}M params")
    head = f"{'run':<38}{'tokens/s':>10}{'step ms':>10}{'peak GiB':>10}{'MFU':>8}"
    print(head + f"{'warm-up s':>11}")
    for name, r in {**rows, **trl}.items():
        warm = f"{r['warmup_s']:>11.1f}" if "warmup_s" in r else ""
        print(
            f"{name:<38}{r['tokens_per_s']:>10.0f}{r['step_s'] * 1e3:>10.0f}"
            f"{r['peak_gib']:>10.2f}{mfu(r['tokens_per_s']):>8.3f}{warm}"
        )
    if check:
        print(
            f"first step ({headline}) vs float32: loss {check['fast_loss']:.6f} vs "
            f"{check['float32_loss']:.6f}"
            f" (rel {check['loss_rel_diff']:.2e}), grad norm {check['fast_grad_norm']:.5f} vs "
            f"{check['float32_grad_norm']:.5f} (rel {check['grad_norm_rel_diff']:.2e})"
        )
    print(f"headline (fastest within TRL's peak memory, no checkpointing): {headline}")
    figures: dict[str, Any] = {
        "agentrl_tokens_per_s": round(best["tokens_per_s"], 1),
        "agentrl_config": headline,
        "trl_tokens_per_s": round(trl["trl"]["tokens_per_s"], 1) if trl else None,
        "speedup_vs_trl": round(best["tokens_per_s"] / trl["trl"]["tokens_per_s"], 3)
        if trl
        else None,
        "mfu": round(mfu(best["tokens_per_s"]), 4),
        "peak_mem_gib": round(best["peak_gib"], 3),
        "trl_peak_mem_gib": round(trl["trl"]["peak_gib"], 3) if trl else None,
        "variants": {k: round(v["tokens_per_s"], 1) for k, v in rows.items()},
        "variant_peak_gib": {k: round(v["peak_gib"], 3) for k, v in rows.items()},
        "trl_ckpt_tokens_per_s": round(trl["trl+ckpt"]["tokens_per_s"], 1) if trl else None,
        "trl_ckpt_peak_mem_gib": round(trl["trl+ckpt"]["peak_gib"], 3) if trl else None,
        "first_step": {k: round(v, 8) for k, v in check.items()},
        "peak_tflops": round(peak_tflops, 1),
        "tokens": args.tokens,
        "micro_batch_tokens": args.micro_batch_tokens,
        "card": machine,
        "torch": torch.__version__,
    }
    emit(figures)


if __name__ == "__main__":
    main()
