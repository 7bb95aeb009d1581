"""MoE learner update tokens/s on one GPU: agentrl's packed body vs TRL's loss path, side by side.

Model: Qwen3-30B-A3B's shape (``agentrl.tiny.QWEN3_30B_A3B_SHAPE``: hidden 2,048, 32/4 heads of
128, 128 experts of 768, 8 routed per token, 152k vocabulary) with ``--layers`` decoder layers
(4 by default: 3.1B parameters, so float32 master weights, gradients and AdamW states, 16 bytes a
parameter, fit one 80 GB card with the activations), built from config with seeded random
weights (no download). Batch: ``benchmarks/learner_gpu.py``'s, 32 sequences of a 512-token
prompt and a 256-2,048-token response (57,167 real tokens); one optimizer step per update.

agentrl (``--variants``), each from the same initial weights: the packed body
(:mod:`agentrl.kernels.packed_body`, MoE layers through :mod:`agentrl.kernels.moe`: the router
module, then grouped expert matmuls), bf16 autocast over float32 master weights, bf16 head
matmuls, ``compile``; ``sel`` adds selective recomputation, ``triton`` this project's attention
kernel, ``16k`` 16,384-token micro-batches, ``c4096`` head chunks of 4,096 tokens (default
``--chunk-size``), ``rm25`` follows the routing metrics on 25% of the micro-batches
(``learner.routing_metrics_sample``), ``nometrics`` turns ``learner.routing_metrics`` off (on
by default for MoE: a no-grad forward of the batch after the update for the routing metrics,
which TRL's loss path has no counterpart of; the best variant with them on is reported beside
the headline);
``transformers`` is agentrl's learner on transformers' own forward (its default ``grouped_mm``
experts, sdpa with a block mask).

TRL (``benchmarks/trl_side/``, TRL 1.16 ``GRPOTrainer``'s loss path, GSPO settings): bf16
weights and AdamW states, micro-batches of 4 sequences padded as TRL pads a generation batch,
transformers' experts as configured (``--trl-experts``; transformers 5's default is
``grouped_mm``, its grouped-GEMM experts, not a Python loop).

Headline: the fastest agentrl variant (none checkpoints whole layers) against TRL without
checkpointing. Peak memory is reported for both; agentrl's starts higher (float32 master
weights and AdamW states: 16 bytes a parameter vs TRL's 8).

Times are medians of ``--repeats`` updates after ``--warmup`` updates. MFU counts the active
parameters (every non-expert weight but the untied input embedding, a lookup, and ``top_k /
num_experts`` of the experts'):
6 x active parameters x tokens/s / the card's measured bf16 matmul peak.

Usage: ``python benchmarks/learner_moe_gpu.py [--layers 4] [--variants ...] [--no-trl] [--profile]``
(``--model tiny`` runs the same code on a CPU in seconds: a smoke test).
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from agentrl.learner import Learner, LearnerConfig, TrainSample
from agentrl.tiny import QWEN3_30B_A3B_SHAPE, tiny_moe_config

sys.path.insert(0, str(Path(__file__).parent))
from harness import add_common_args, card, emit, free, median, sync, timed  # noqa: E402
from learner_gpu import Batch, make_batch, samples_for, with_engine_logprobs  # noqa: E402
from learner_step import peak_matmul_tflops  # noqa: E402

GIB = 2**30
# a variant is "transformers" or parts joined by "+": each part adds settings (NNk: micro-batches
# of NN x 1,024 tokens; cNNNN: head chunks of NNNN tokens)
PARTS: dict[str, dict[str, Any]] = {
    "transformers": dict(body="transformers", head_dtype="bfloat16"),
    "packed": dict(body="packed", head_dtype="bfloat16"),
    "compile": dict(compile=True),
    "sel": dict(selective_recompute=True),
    "triton": dict(attention_kernel="triton"),
    "nometrics": dict(routing_metrics=False),
}


def variant_config(name: str) -> dict[str, Any]:
    """The learner settings of variant ``name`` (see :data:`PARTS`)."""
    kw: dict[str, Any] = {}
    for part in name.split("+"):
        if part.endswith("k") and part[:-1].isdigit():
            kw["micro_batch_tokens"] = int(part[:-1]) * 1024
        elif part.startswith("c") and part[1:].isdigit():  # head chunk (default --chunk-size)
            kw["logprob_chunk_size"] = int(part[1:])
        elif part.startswith("rm") and part[2:].isdigit():  # routing metrics on NN% of micro
            kw["routing_metrics_sample"] = int(part[2:]) / 100
        elif part in PARTS:
            kw.update(PARTS[part])
        else:
            raise ValueError(
                f"variant {name!r}: unknown part {part!r} "
                f"(parts: {', '.join(PARTS)}, NNk, cNNNN, rmNN)"
            )
    return kw


def build_model(args: argparse.Namespace, experts: str | None = None) -> Qwen3MoeForCausalLM:
    if args.model == "tiny":
        config = tiny_moe_config(107)
    else:
        config = Qwen3MoeConfig(**dict(QWEN3_30B_A3B_SHAPE, num_hidden_layers=args.layers))
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with args.device:
        model = Qwen3MoeForCausalLM(config).float()
    if experts is not None:
        model.set_experts_implementation(experts)
    return model


def active_params(model: Qwen3MoeForCausalLM) -> int:
    """Weights one token multiplies by: all but the experts and an untied input embedding (a
    lookup), and ``top_k / num_experts`` of the experts'."""
    cfg: Any = model.config
    share = cfg.num_experts_per_tok / cfg.num_experts
    lookup = model.get_input_embeddings().weight
    tied = model.get_output_embeddings().weight is lookup
    total = 0.0
    for name, p in model.named_parameters():
        if p is lookup and not tied:
            continue
        total += p.numel() * (share if ".experts." in name else 1.0)
    return int(total)


def learner_config(args: argparse.Namespace, overrides: dict[str, Any]) -> LearnerConfig:
    cuda = args.device.type == "cuda"
    kw: dict[str, Any] = dict(
        lr=1e-6,
        num_minibatches=1,
        micro_batch_tokens=args.micro_batch_tokens,
        dtype="bfloat16" if cuda else "float32",
        logprob_chunk_size=args.chunk_size,
    )
    kw.update(overrides)
    if not cuda:  # the CPU smoke run: no inductor C++ build, no Triton
        kw.update(compile=False, attention_kernel="flash", head_dtype="float32")
    return LearnerConfig(**kw)


def run_variant(
    args: argparse.Namespace, init: dict[str, torch.Tensor], samples: list[TrainSample], name: str
) -> dict[str, Any]:
    device = args.device
    model = build_model(args)
    model.load_state_dict(init)
    learner = Learner(model, learner_config(args, variant_config(name)))
    batch = with_engine_logprobs(learner, samples)
    t0 = time.perf_counter()
    first = learner.step(batch)  # warm-up (compiles), and the first step's figures
    for _ in range(args.warmup - 1):
        learner.step(batch)
    warm_s = time.perf_counter() - t0
    sync(device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        retries = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
    times = timed(partial(learner.step, batch), device, 0, args.repeats)
    peak = torch.cuda.max_memory_allocated(device) / GIB if cuda else 0.0
    reserved = torch.cuda.max_memory_reserved(device) / GIB if cuda else 0.0
    # cudaMalloc failures the caching allocator answered by freeing its cache and retrying:
    # each one synchronises the device (a card close to full pays them every step)
    retries = torch.cuda.memory_stats(device).get("num_alloc_retries", 0) - retries if cuda else 0
    if args.profile and name == args.variants[0]:
        from learner_profile import profile_update

        profile_update(learner, batch, device)
    body, metrics_on = learner.body, learner.config.routing_metrics
    del learner, model
    free(device)
    step_s = median(times)
    return dict(
        body=body,
        step_s=step_s,
        tokens_per_s=args.tokens / step_s,
        peak_gib=peak,
        reserved_gib=reserved,
        alloc_retries=retries,
        routing_metrics=metrics_on,
        warmup_s=warm_s,
        first_loss=first["loss/policy"],
        first_grad_norm=first["loss/grad_norm"],
    )



def run_trl(
    args: argparse.Namespace, init: dict[str, torch.Tensor], batch: Batch
) -> dict[str, Any]:
    from trl_side import trl_figures

    seen: dict[str, Any] = {}

    def build() -> Qwen3MoeForCausalLM:
        model = build_model(args, experts=args.trl_experts)
        model.load_state_dict(init)
        seen["experts"] = model.config._experts_implementation
        return model

    figures = trl_figures(build, batch, args.device, False, args.warmup, args.repeats)
    figures["settings"] = dict(figures["settings"], experts_implementation=seen["experts"])
    return figures


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model", choices=["qwen3-30b-a3b-shape", "tiny"], default="qwen3-30b-a3b-shape"
    )
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the 30B-A3B shape")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--num-seqs", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--response-min", type=int, default=256)
    parser.add_argument("--response-max", type=int, default=2048)
    parser.add_argument("--micro-batch-tokens", type=int, default=12288)
    parser.add_argument("--chunk-size", type=int, default=1024, help="head chunk (tokens)")
    parser.add_argument(
        "--variants",
        nargs="+",
        default=[
            "packed+compile+sel+32k+triton+nometrics+c4096",
            "packed+compile+sel+32k+triton+c4096",
            "packed+compile+sel+32k+triton+c4096+rm25",
        ],
        help="'transformers' or parts joined by '+': " + ", ".join(PARTS) + ", NNk, cNNNN, rmNN",
    )
    parser.add_argument(
        "--profile", action="store_true", help="profile one update of the first variant"
    )
    add_common_args(parser, warmup=4, repeats=3)
    parser.add_argument("--no-trl", action="store_true", help="skip TRL's side")
    parser.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="seconds from the first timed run (TRL's side) past which no further variant "
        "starts (the first always runs)",
    )
    parser.add_argument(
        "--trl-experts",
        default=None,
        help="transformers' experts_implementation for TRL's model (default: transformers')",
    )
    args = parser.parse_args()
    for name in args.variants:
        try:
            variant_config(name)
        except ValueError as e:
            parser.error(str(e))
    args.device = torch.device(args.device)
    if args.model == "tiny":
        args.prompt_len, args.response_min, args.response_max = 16, 8, 64
        args.micro_batch_tokens, args.chunk_size = 256, 64
    return args


def main() -> None:
    args = parse_args()
    device = args.device
    model = build_model(args)
    init = {k: v.cpu() for k, v in model.state_dict().items()}  # off the card: peaks compare
    num_params = sum(p.numel() for p in model.parameters())
    n_active = active_params(model)
    cfg: Any = model.config
    del model
    free(device)
    vocab = cfg.vocab_size
    batch = make_batch(args, vocab)
    samples = samples_for(*batch)
    args.tokens = sum(len(s.tokens) for s in samples)
    peak_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    peak_tflops = peak_matmul_tflops(device, peak_dtype)
    card_name = card(device)

    def mfu(tokens_per_s: float) -> float:
        return 6 * n_active * tokens_per_s / (peak_tflops * 1e12)

    t_start = time.perf_counter()
    # TRL first: its figure is there even when the last variants run out of --time-budget
    trl = None if args.no_trl else run_trl(args, init, batch)
    if trl is not None:
        print(f"# trl: {trl}", flush=True)
    rows: dict[str, dict[str, Any]] = {}
    failed: dict[str, str] = {}
    for name in args.variants:
        elapsed = time.perf_counter() - t_start
        if args.time_budget is not None and rows and elapsed > args.time_budget:
            failed[name] = f"skipped: {elapsed:.0f} s past the start, over --time-budget"
            print(f"# {name}: {failed[name]}", flush=True)
            continue
        try:
            rows[name] = run_variant(args, init, samples, name)
        except torch.OutOfMemoryError as e:  # a variant too big for the card: say so, go on
            failed[name] = f"out of memory: {str(e).splitlines()[0]}"
        if name in failed:  # out of the except clause: its traceback no longer holds the learner
            print(f"# {name}: {failed[name]}", flush=True)
            free(device)
            continue
        print(f"# {name}: {rows[name]}", flush=True)
    if not rows:
        raise SystemExit(f"every variant failed: {failed}")
    headline = max(rows, key=lambda k: rows[k]["tokens_per_s"])
    best = rows[headline]

    print(f"\ncard: {card_name}; measured {peak_dtype} matmul peak {peak_tflops:.0f} TFLOP/s")
    print(
        f"model: {cfg.num_hidden_layers} layers, {cfg.num_experts} experts "
        f"(top {cfg.num_experts_per_tok}), {num_params / 1e9:.2f}B params, "
        f"{n_active / 1e6:.0f}M active; "
        f"batch: {args.num_seqs} sequences, {args.tokens} tokens"
    )
    print(
        f"{'run':<50}{'tokens/s':>10}{'step ms':>10}{'peak GiB':>10}{'rsvd GiB':>10}"
        f"{'retries':>9}{'MFU':>8}{'warm-up s':>11}"
    )
    table = {**rows, **({"trl (GRPOTrainer loss path)": trl} if trl else {})}
    for name, r in table.items():
        warm = f"{r['warmup_s']:>11.1f}" if "warmup_s" in r else ""
        rsvd = f"{r['reserved_gib']:>10.2f}{r['alloc_retries']:>9}" if "reserved_gib" in r else ""
        print(
            f"{name:<50}{r['tokens_per_s']:>10.0f}{r['step_s'] * 1e3:>10.0f}"
            f"{r['peak_gib']:>10.2f}{rsvd or ' ' * 19}{mfu(r['tokens_per_s']):>8.3f}{warm}"
        )
    for name, why in failed.items():
        print(f"{name:<50}{why}")
    if trl:
        print(f"trl settings: {trl['settings']}")
    speedup = best["tokens_per_s"] / trl["tokens_per_s"] if trl else None
    # the routing metrics (on by default for MoE) add a no-grad forward after the update that
    # TRL's loss path has no counterpart of: the best variant that pays it, reported beside
    with_metrics = [k for k in rows if rows[k]["routing_metrics"]]
    best_metrics = max(with_metrics, key=lambda k: rows[k]["tokens_per_s"], default=None)
    speedup_metrics = (
        rows[best_metrics]["tokens_per_s"] / trl["tokens_per_s"] if trl and best_metrics else None
    )
    figures: dict[str, Any] = {
        "moe_learner_tokens_per_s": round(best["tokens_per_s"], 1),
        "trl_moe_tokens_per_s": round(trl["tokens_per_s"], 1) if trl else None,
        "moe_speedup_vs_trl": round(speedup, 3) if speedup else None,
        "agentrl_config": headline,
        "routing_metrics": best["routing_metrics"],
        "moe_speedup_vs_trl_with_routing_metrics": (
            round(speedup_metrics, 3) if speedup_metrics else None
        ),
        "mfu": round(mfu(best["tokens_per_s"]), 4),
        "peak_mem_gib": round(best["peak_gib"], 3),
        "trl_peak_mem_gib": round(trl["peak_gib"], 3) if trl else None,
        "trl_experts_implementation": trl["settings"]["experts_implementation"] if trl else None,
        "variants": {k: round(v["tokens_per_s"], 1) for k, v in rows.items()},
        "variant_peak_gib": {k: round(v["peak_gib"], 3) for k, v in rows.items()},
        "variant_alloc_retries": {k: v["alloc_retries"] for k, v in rows.items()},
        "variants_failed": failed,
        "first_loss": {k: round(v["first_loss"], 6) for k, v in table.items()},
        "layers": cfg.num_hidden_layers,
        "params": num_params,
        "active_params": n_active,
        "tokens": args.tokens,
        "peak_tflops": round(peak_tflops, 1),
        "card": card_name,
        "torch": torch.__version__,
    }
    emit(figures)


if __name__ == "__main__":
    main()
