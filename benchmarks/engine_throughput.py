"""LocalEngine throughput: 1, 8 and 64 concurrent requests against sequential `model.generate`.

Also a multi-turn mode (`--turns 4 --obs-tokens 32`): episodes whose every turn appends the
previous output and an observation; measured with and without prefix reuse (prefill tokens
computed, episodes/s), and the mismatch of the engine's log-probs against the learner's
(`LogprobModel` with the packed body, bf16 autocast over the same float32 weights), per token
position and per turn. On a GPU the model is float32 (the learner's master weights) and the
engine computes in bf16 (`compute_dtype`), as the colocated training loop runs it.

Same model, same prompt length, same number of new tokens (EOS ignored), temperature 1 with
full-vocabulary sampling. `--model tiny` (default) runs anywhere on CPU; `--model
qwen3-0.6b-shape` builds a Qwen3-0.6B-shaped model from its config with random weights (bf16 on
a GPU). Also measures how far the engine's returned log-probs are from a teacher-forced forward
pass of the same model (the mismatch the learner sees).

``--split-decode on off`` times the levels (and the long histories) again on a fresh engine
with flash-decoding off (``split_decode_compare``).

Prints a table, then as the last line one JSON object with the headline figures:
`batching_speedup_64` = engine tokens/s with 64 concurrent requests / sequential `model.generate`
tokens/s (one request at a time).

Long contexts (``--history-tokens 8192 --turns 16``): ``--history-episodes`` episodes at once,
each a history of that many tokens prefilled first (cold prefill tokens/s), then ``--turns``
turns that re-send the whole conversation with ``--obs-tokens`` more each turn: generated
tokens/s over the turns (their observation prefills included), the share of re-sent tokens the
prefix cache served (the engine's ``cached_tokens`` / ``computed_tokens``), the KV budget against
what the episodes need, and peak memory. An episode longer than the whole KV cache is refused
before any work, with one line (the engine itself refuses such a request with a 400).

    python benchmarks/engine_throughput.py                       # CPU, tiny model
    python benchmarks/engine_throughput.py --model qwen3-0.6b-shape --new-tokens 256
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import platform
import time
from typing import Any

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from agentrl.errors import ServerError
from agentrl.inference.base import SamplingParams
from agentrl.inference.engine import LocalEngine, paged_runner
from agentrl.tiny import QWEN3_0_6B_SHAPE, build_tiny


def build_model(name: str, device: str, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    if name == "tiny":
        model, tokenizer = build_tiny()
        return model.to(device), tokenizer
    config = Qwen3Config(**QWEN3_0_6B_SHAPE, eos_token_id=151645, pad_token_id=151643)
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


async def multi_turn(
    engine: LocalEngine, args: argparse.Namespace, vocab: int
) -> tuple[float, list[list[int]], list[list[Any]]]:
    """``args.episodes`` episodes of ``args.turns`` turns at once: episodes/s, inputs, outputs."""
    gen = torch.Generator().manual_seed(7)
    params = SamplingParams(max_new_tokens=args.turn_tokens, temperature=1.0, ignore_eos=True)

    async def episode(i: int) -> tuple[list[int], list[Any]]:
        ids = torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist()
        outs = []
        for turn in range(args.turns):
            if turn:
                ids = ids + outs[-1].output_ids
                ids += torch.randint(3, vocab, (args.obs_tokens,), generator=gen).tolist()
            outs.append(await engine.generate(list(ids), params))
        return ids, outs

    start = time.perf_counter()
    done = await asyncio.gather(*(episode(i) for i in range(args.episodes)))
    elapsed = time.perf_counter() - start
    return args.episodes / elapsed, [d[0] for d in done], [d[1] for d in done]


def check_fits(engine: LocalEngine, args: argparse.Namespace) -> tuple[int, int]:
    """KV cache tokens and one long episode's tokens; exits with one line if it cannot fit."""
    if engine._paged is None:
        raise SystemExit("error: --history-tokens needs the paged engine (CUDA, or --paged)")
    cache = engine._paged.cache
    capacity = (cache.num_pages - 1) * cache.page_size  # the scratch page holds nothing
    episode_len = args.history_tokens + args.turns * (args.turn_tokens + args.obs_tokens)
    if episode_len > capacity or episode_len > engine.max_model_len:
        raise SystemExit(
            f"error: an episode of {episode_len} tokens does not fit the KV cache "
            f"({capacity} tokens) or the context ({engine.max_model_len}): lower --history-tokens"
            " or --turns, or raise --kv-cache-gib"
        )
    return capacity, episode_len


async def long_context(engine: LocalEngine, args: argparse.Namespace, vocab: int) -> dict:
    """``--history-tokens``: cold prefill of long histories, then ``--turns`` turns on top."""
    runner = engine._paged
    assert runner is not None
    cache = runner.cache
    capacity, episode_len = check_fits(engine, args)
    gen = torch.Generator().manual_seed(11)
    n = args.history_episodes
    histories = torch.randint(3, vocab, (n, args.history_tokens), generator=gen).tolist()
    first = SamplingParams(max_new_tokens=1, temperature=1.0, ignore_eos=True)
    params = SamplingParams(max_new_tokens=args.turn_tokens, temperature=1.0, ignore_eos=True)
    device = str(runner.device)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    sync(device)
    start = time.perf_counter()
    await asyncio.gather(*(engine.generate(h, first) for h in histories))
    sync(device)
    prefill_s = time.perf_counter() - start
    obs = [[torch.randint(3, vocab, (args.obs_tokens,), generator=gen).tolist()
            for _ in range(args.turns)] for _ in range(n)]  # fmt: skip
    before = engine.prefill_stats()

    async def episode(i: int) -> None:
        ids = list(histories[i])
        for turn in range(args.turns):
            out = await engine.generate(list(ids), params)
            ids += out.output_ids + obs[i][turn]

    start = time.perf_counter()
    await asyncio.gather(*(episode(i) for i in range(n)))
    sync(device)
    turns_s = time.perf_counter() - start
    after = engine.prefill_stats()
    total = after["tokens"] - before["tokens"]
    cached = after["cached_tokens"] - before["cached_tokens"]
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else 0.0
    return {
        "history_tokens": args.history_tokens,
        "history_turns": args.turns,
        "history_episodes": n,
        "history_prefill_tokens_per_s": round(n * args.history_tokens / prefill_s, 1),
        "history_decode_tokens_per_s": round(n * args.turns * args.turn_tokens / turns_s, 1),
        "history_prefill_tokens": total,
        "history_cached_tokens": cached,
        "history_computed_tokens": after["computed_tokens"] - before["computed_tokens"],
        "history_prefix_reuse_frac": round(cached / max(total, 1), 4),
        "kv_cache_gib": round((cache.k.nbytes + cache.v.nbytes) / 2**30, 3),
        "kv_cache_tokens": capacity,
        "kv_tokens_needed": n * episode_len,
        "history_peak_mem_gib": round(peak, 3),
    }


def result_rows(rows: dict[int, float]) -> dict[str, float]:
    """The concurrency levels' tokens/s under their JSON keys."""
    return {f"engine_{level}_tokens_per_s": round(tps, 1) for level, tps in rows.items()}


def learner_mismatch(
    model: Any, finals: list[list[int]], outs: list[list[Any]], exact: bool = False
) -> tuple[float, list[float], list[float]]:
    """Max |engine - learner| log-prob: overall, per turn, per output position (buckets of 16).

    The learner is ``LogprobModel`` with the packed body under bf16 autocast and a bf16 head,
    on the same float32 weights, over each episode's last input plus its last output
    (``exact``: the packed body and head in the exact mode, ``batch_invariant``).
    """
    from agentrl.kernels.packed_body import PackedBody
    from agentrl.learner.logprobs import LogprobModel

    learner = LogprobModel(
        model,
        temperature=1.0,
        chunk_size=1024,
        autocast_dtype=torch.bfloat16,
        head_dtype=torch.bfloat16,
        body=PackedBody(model, batch_invariant=exact),
    )
    device = next(model.parameters()).device
    per_turn = [0.0] * len(outs[0])
    per_pos: list[float] = []
    for final, turns in zip(finals, outs, strict=True):
        seq = final + turns[-1].output_ids
        index, targets, engine_lp, tags = [], [], [], []
        for t, turn_out in enumerate(turns):
            begin = turn_out.prompt_tokens  # the turn's input length = where its output starts
            for j, (tok, lp) in enumerate(zip(turn_out.output_ids, turn_out.logprobs, strict=True)):
                if begin + j >= len(seq) or seq[begin + j] != tok:
                    break
                index.append(begin + j - 1)
                targets.append(tok)
                engine_lp.append(lp)
                tags.append((t, j))
        ids = torch.tensor([seq], device=device)
        with torch.inference_mode():
            got, _ = learner(
                ids,
                torch.arange(len(seq), device=device)[None],
                None,
                torch.tensor(index, device=device),
                torch.tensor(targets, device=device),
                (len(seq),),
            )
        diff = (got.float().cpu() - torch.tensor(engine_lp)).abs().tolist()
        for (t, j), d in zip(tags, diff, strict=True):
            per_turn[t] = max(per_turn[t], d)
            while len(per_pos) <= j // 16:
                per_pos.append(0.0)
            per_pos[j // 16] = max(per_pos[j // 16], d)
    return max(per_turn), per_turn, per_pos


async def run(args: argparse.Namespace) -> dict[str, Any]:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = build_model(args.model, device)
    vocab = model.config.vocab_size
    levels = [int(c) for c in args.concurrency.split(",")]
    cuda = device.startswith("cuda")
    kw: dict[str, Any] = {"compute_dtype": torch.bfloat16} if cuda else {}
    if args.paged:
        kw["paged"] = True
    if args.kv_cache_gib is not None:
        kw["kv_cache_gib"] = args.kv_cache_gib
    kw["emulate_precision_casts"] = args.emulate_precision_casts
    engine_model = copy.deepcopy(model)  # the engine owns its copy; the learner reads model
    steps = [int(k) for k in args.decode_steps.split(",")] if args.decode_steps else []
    if steps:
        kw["decode_steps"] = steps[0]
    split_default = paged_runner.SPLIT_DECODE
    paged_runner.SPLIT_DECODE = args.split_decode[0] == "on"  # read when a runner is built
    engine = LocalEngine(
        engine_model, tokenizer, max_batch_size=max(levels), seed=0, compile=args.compile, **kw
    )
    if args.history_tokens:  # refused before any work
        check_fits(engine, args)
    await bench_engine(engine, prompts(2, args.prompt_len, vocab, 99), 4, device)  # warm-up
    hf_tps = float("nan")
    if args.hf_requests:
        bench_hf(engine_model, prompts(1, args.prompt_len, vocab, 98), 4, device)
        hf_tps = bench_hf(
            engine_model,
            prompts(args.hf_requests, args.prompt_len, vocab, 1),
            args.new_tokens,
            device,
        )
    rows: dict[int, float] = {}
    mismatch = 0.0
    for level in levels:
        batch = prompts(level, args.prompt_len, vocab, 2 + level)
        await bench_engine(engine, batch, 2, device)  # captures this level's graph bucket
        rows[level], outs = await bench_engine(engine, batch, args.new_tokens, device)
        if not cuda:
            mismatch = max(mismatch, logprob_mismatch(engine_model, batch, outs, device))
    compare: dict[str, dict[int, float]] = {}
    for k in steps[1:]:  # the same levels with other runs of decode steps, side by side
        other = LocalEngine(
            engine_model, tokenizer, max_batch_size=max(levels), seed=0, compile=args.compile,
            **(kw | {"decode_steps": k}),
        )  # fmt: skip
        compare[str(k)] = {}
        for level in levels:
            batch = prompts(level, args.prompt_len, vocab, 2 + level)
            await bench_engine(other, batch, 2, device)
            compare[str(k)][level], _ = await bench_engine(other, batch, args.new_tokens, device)
        await other.aclose()
    splits: dict[str, dict[str, float]] = {}
    for setting in args.split_decode[1:]:  # flash-decoding on/off side by side, fresh engines
        paged_runner.SPLIT_DECODE = setting == "on"
        other = LocalEngine(
            engine_model, tokenizer, max_batch_size=max(levels), seed=0, compile=args.compile,
            **kw,
        )  # fmt: skip
        await bench_engine(other, prompts(2, args.prompt_len, vocab, 99), 4, device)
        splits[setting] = {}
        for level in levels:
            batch = prompts(level, args.prompt_len, vocab, 2 + level)
            await bench_engine(other, batch, 2, device)
            tps, _ = await bench_engine(other, batch, args.new_tokens, device)
            splits[setting][f"engine_{level}_tokens_per_s"] = round(tps, 1)
        if args.history_tokens:
            hist = await long_context(other, args, vocab)
            splits[setting]["history_decode_tokens_per_s"] = hist["history_decode_tokens_per_s"]
        await other.aclose()
    paged_runner.SPLIT_DECODE = split_default
    turns: dict[str, Any] = {}
    if args.history_tokens:  # the long-context episodes replace the short multi-turn mode
        turns = await long_context(engine, args, vocab)
        await engine.aclose()
    elif args.turns and engine.paged:
        before = engine.prefill_stats()
        eps_reuse, finals, outs_mt = await multi_turn(engine, args, vocab)
        after = engine.prefill_stats()
        total = after["tokens"] - before["tokens"]
        cached = after["cached_tokens"] - before["cached_tokens"]
        await engine.aclose()
        cold = LocalEngine(
            engine_model,
            tokenizer,
            max_batch_size=max(levels),
            seed=0,
            prefix_cache=False,
            compile=args.compile,
            **kw,
        )
        await bench_engine(cold, prompts(2, args.prompt_len, vocab, 99), 4, device)
        eps_cold, _, _ = await multi_turn(cold, args, vocab)
        await cold.aclose()
        worst, per_turn, per_pos = learner_mismatch(model, finals, outs_mt)
        turns = {
            "episodes_per_s_prefix_reuse": round(eps_reuse, 2),
            "episodes_per_s_no_reuse": round(eps_cold, 2),
            "prefill_tokens_total": total,
            "prefill_tokens_cached": cached,
            "prefix_reuse_frac": round(cached / max(total, 1), 4),
            "logprob_max_abs_diff_vs_learner": worst,
            "logprob_diff_vs_learner_per_turn": per_turn,
            "logprob_diff_vs_learner_per_16_positions": per_pos,
        }
    else:
        await engine.aclose()
    exact: dict[str, Any] = {}
    if args.batch_invariant:  # the exact mode side by side: its speed and its mismatch
        inv = LocalEngine(
            engine_model, tokenizer, max_batch_size=max(levels), seed=0,
            **(kw | {"batch_invariant": True, "emulate_precision_casts": False}),
        )  # fmt: skip
        await bench_engine(inv, prompts(2, args.prompt_len, vocab, 99), 4, device)
        for level in levels:
            batch = prompts(level, args.prompt_len, vocab, 2 + level)
            await bench_engine(inv, batch, 2, device)
            tps, _ = await bench_engine(inv, batch, args.new_tokens, device)
            exact[f"exact_engine_{level}_tokens_per_s"] = round(tps, 1)
            exact[f"exact_speed_vs_default_{level}"] = round(tps / rows[level], 3)
        if args.turns:
            _, finals, outs_mt = await multi_turn(inv, args, vocab)
            worst, per_turn, _ = learner_mismatch(model, finals, outs_mt, exact=True)
            exact["exact_logprob_max_abs_diff_vs_learner"] = worst
            exact["exact_logprob_diff_vs_learner_per_turn"] = per_turn
        await inv.aclose()
    machine = torch.cuda.get_device_name() if device.startswith("cuda") else cpu_name()
    print(f"\nLocalEngine throughput ({args.model}, {device}: {machine})")
    print(f"prompt {args.prompt_len} tokens, {args.new_tokens} new tokens per request\n")
    print(f"{'setup':<34}{'tokens/s':>12}{'vs sequential':>16}")
    print(f"{'sequential model.generate':<34}{hf_tps:>12.1f}{1.0:>15.2f}x")
    for key, value in (turns | exact).items():
        print(f"multi-turn {key}: {value}" if key in turns else f"{key}: {value}")
    for level, tps in rows.items():
        print(f"{f'LocalEngine, {level} concurrent':<34}{tps:>12.1f}{tps / hf_tps:>15.2f}x")
    for k, by_level in compare.items():
        for level, tps in by_level.items():
            name = f"  decode_steps={k}, {level} concurrent"
            print(f"{name:<34}{tps:>12.1f}{tps / hf_tps:>15.2f}x  ({rows[level] / tps:.2f}x)")
    split_first = args.split_decode[0]
    for setting, figures in splits.items():
        for key, value in figures.items():
            base = turns.get(key) or result_rows(rows).get(key)
            print(f"  split decode {setting}: {key} {value} (split decode {split_first}: {base})")
    print(f"\nmax |engine logprob - teacher-forced| = {mismatch:.2e}")
    result: dict[str, Any] = {
        "benchmark": "engine_throughput",
        "model": args.model,
        "device": device,
        "machine": machine,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "hf_sequential_tokens_per_s": None if hf_tps != hf_tps else round(hf_tps, 1),
        **result_rows(rows),
        "logprob_max_abs_diff": mismatch,
        "paged": engine.paged,
        "decode_steps": steps[0] if steps else None,
        "emulate_precision_casts": kw["emulate_precision_casts"],
        "decode_steps_compare": compare,
        "split_decode": split_first,
        "split_decode_compare": splits,
        **turns,
        **exact,
    }
    if 64 in rows and hf_tps == hf_tps:
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
    parser.add_argument("--turns", type=int, default=4, help="multi-turn mode: turns (0: off)")
    parser.add_argument("--obs-tokens", type=int, default=32, help="observation between turns")
    parser.add_argument("--turn-tokens", type=int, default=64, help="new tokens per turn")
    parser.add_argument("--episodes", type=int, default=64, help="multi-turn episodes at once")
    parser.add_argument("--history-tokens", type=int, default=0,
                        help="long-context mode: history tokens per episode (0: off)")
    parser.add_argument("--history-episodes", type=int, default=8,
                        help="long-context mode: episodes at once")
    parser.add_argument("--kv-cache-gib", type=float, default=None,
                        help="KV cache budget (default: the engine's share of free memory)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the engine layers")
    parser.add_argument("--paged", action="store_true", help="the paged path on CPU too")
    parser.add_argument(
        "--batch-invariant",
        action="store_true",
        help="also run the exact mode (CUDA): its tokens/s per level and its multi-turn "
        "log-prob gap to the exact learner (expected 0)",
    )
    parser.add_argument(
        "--decode-steps",
        default="",
        help="paged engine: decode steps per plan; a list (8,1) also times the others side by side",
    )
    parser.add_argument(
        "--split-decode",
        nargs="+",
        choices=["on", "off"],
        default=["on" if paged_runner.SPLIT_DECODE else "off"],
        help="flash-decoding (a decode row's keys over several programs where the rows leave "
        "SMs idle); 'on off' also times the levels and long histories with the other, side by side",
    )
    parser.add_argument(
        "--emulate-precision-casts",
        action="store_true",
        help="compiled engine layers round as the eager learner does (the engine's option of "
        "that name; off by default) instead of once per fused op",
    )
    args = parser.parse_args()
    for name in ("history_tokens", "turns", "obs_tokens"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')}: expected >= 0, got {getattr(args, name)}")
    if args.history_episodes < 1 or args.turn_tokens < 1:
        parser.error("--history-episodes and --turn-tokens: expected >= 1")
    try:
        result = asyncio.run(run(args))
    except ServerError as e:  # a request the engine refused (too long for its KV cache)
        raise SystemExit(f"error: {e}") from None
    print(json.dumps(result))


if __name__ == "__main__":
    main()
