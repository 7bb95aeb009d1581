"""Where the bf16 engine's log-probs part from the learner's: the gap per cause, on the CPU.

The learner is ``LogprobModel`` with the packed body under bf16 autocast over float32 weights and
a bf16 head (as ``engine_throughput.py``'s ``learner_mismatch``). Every row below scores the same
sampled tokens and reports max |logp - learner logp|:

- ``engine``: the paged engine itself (``compute_dtype=bfloat16``): prefill, decode steps,
  prefix reuse across turns, its sampling's log-probs;
- ``engine teacher-forced``: the engine's layer code over the whole sequence in one forward
  (the same ops as the engine, the learner's batch shape);
- ``variant: ...``: a plain reimplementation of the learner's forward with one choice changed
  (residual stream in bf16, bf16 weights everywhere, bf16 rotary, ...): what that difference
  alone would cost;
- ``floor: ...``: the learner against itself with only the batch shape changed (the sequence
  packed after another one, or scored as a shorter prefix): the rounding noise no choice of
  dtypes removes.

    python benchmarks/engine_mismatch.py --layers 4        # Qwen3-0.6B widths, 4 layers

Prints a table, then as the last line one JSON object (``gap_<name>`` per row).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import platform
from typing import Any

import torch
import torch.nn.functional as F
from engine_throughput import multi_turn  # this folder: run as a script
from transformers import Qwen3Config, Qwen3ForCausalLM

from agentrl.inference.engine import LocalEngine
from agentrl.kernels.packed_body import PackedBody, _rotate_half
from agentrl.kernels.paged_attention import QueryBlocks, tile_rows
from agentrl.learner.logprobs import LogprobModel
from agentrl.tiny import QWEN3_0_6B_SHAPE

BF16 = torch.bfloat16


def build(layers: int, vocab: int, device: str = "cpu") -> Any:
    shape = {**QWEN3_0_6B_SHAPE, "num_hidden_layers": layers, "max_position_embeddings": 4096}
    shape["vocab_size"] = vocab
    torch.manual_seed(0)
    with torch.device(device):
        return Qwen3ForCausalLM(Qwen3Config(**shape, eos_token_id=1, pad_token_id=0)).eval()


async def episodes(engine: LocalEngine, args: argparse.Namespace, vocab: int) -> list[Any]:
    """``args.episodes`` multi-turn episodes: (final input, outputs per turn).

    The same workload as ``engine_throughput.py``'s multi-turn mode (seeded the same way).
    """
    _, finals, outs = await multi_turn(engine, args, vocab)
    return list(zip(finals, outs, strict=True))


def scored(final: list[int], turns: list[Any]) -> tuple[list[int], list[int], list[float]]:
    """The whole sequence, the index predicting each sampled token, the engine's log-probs."""
    seq = final + turns[-1].output_ids
    index, engine_lp = [], []
    for out in turns:
        begin = out.prompt_tokens
        for j, lp in enumerate(out.logprobs):
            index.append(begin + j - 1)
            engine_lp.append(lp)
    return seq, index, engine_lp


def learner_logprobs(model: Any, seqs: list[list[int]], index: list[int]) -> torch.Tensor:
    """The learner's log-probs of the tokens after ``index`` of the LAST sequence of the pack."""
    learner = LogprobModel(
        model, temperature=1.0, chunk_size=1024, autocast_dtype=BF16, head_dtype=BF16,
        body=PackedBody(model),
    )  # fmt: skip
    dev = next(model.parameters()).device
    flat = torch.tensor([t for s in seqs for t in s], device=dev)
    off = len(flat) - len(seqs[-1])
    pos = torch.tensor([p for s in seqs for p in range(len(s))], device=dev)
    idx = torch.tensor(index, device=dev) + off
    with torch.inference_mode():
        got, _ = learner(flat[None], pos[None], None, idx, flat[idx + 1], tuple(map(len, seqs)))
    return got.float().cpu()


def variant_logprobs(model: Any, seq: list[int], index: list[int], **opt: Any) -> torch.Tensor:
    """The learner's forward written out op by op, with one choice changed by ``opt``.

    Defaults reproduce bf16 autocast over float32 weights: float32 residual stream and norms,
    matmul inputs cast to bf16 (bf16 outputs), float32 rotary, bf16 attention, bf16 head inputs
    with float32 logits.
    """
    res = BF16 if opt.get("bf16_residual") else torch.float32
    wdt = BF16 if opt.get("bf16_weights") else torch.float32  # norm weights, embedding, rotary
    base: Any = model.base_model
    cfg: Any = model.config
    eps, hd = float(cfg.rms_norm_eps), int(cfg.head_dim)

    def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        if opt.get("fused_norm"):
            return w.to(wdt).float() * x32 if x.dtype != torch.float32 else w.to(wdt) * x32
        return w.to(wdt) * x32.to(x.dtype)

    def lin(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(BF16), w.to(BF16))

    dev = next(model.parameters()).device
    ids, at = torch.tensor(seq, device=dev), torch.tensor(index, device=dev)
    n = len(seq)
    with torch.inference_mode():
        x = F.embedding(ids, base.embed_tokens.weight.to(wdt)).to(res)
        pos = torch.arange(n, device=dev)[None]
        cos, sin = base.rotary_emb(x[None].float(), pos)
        cos, sin = cos[0].to(wdt), sin[0].to(wdt)
        if opt.get("bf16_rotary"):
            cos, sin = cos.to(BF16), sin.to(BF16)
        for layer in base.layers:
            att, mlp = layer.self_attn, layer.mlp
            h = norm(x, layer.input_layernorm.weight)
            q = lin(h, att.q_proj.weight).reshape(n, -1, hd)
            k = lin(h, att.k_proj.weight).reshape(n, -1, hd)
            v = lin(h, att.v_proj.weight).reshape(n, -1, hd)
            q, k = norm(q, att.q_norm.weight), norm(k, att.k_norm.weight)
            c, s = cos[:, None], sin[:, None]
            q, k = q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s
            if opt.get("fp32_attention"):
                a = F.scaled_dot_product_attention(
                    q.to(BF16).float().transpose(0, 1), k.to(BF16).float().transpose(0, 1),
                    v.float().transpose(0, 1), is_causal=True, enable_gqa=True, scale=hd**-0.5,
                ).transpose(0, 1).to(BF16)  # fmt: skip
            else:
                a = F.scaled_dot_product_attention(
                    q.to(BF16).transpose(0, 1), k.to(BF16).transpose(0, 1), v.transpose(0, 1),
                    is_causal=True, enable_gqa=True, scale=hd**-0.5,
                ).transpose(0, 1)  # fmt: skip
            x = (x + lin(a.flatten(1), att.o_proj.weight)).to(res)
            h = norm(x, layer.post_attention_layernorm.weight)
            gate, up = lin(h, mlp.gate_proj.weight), lin(h, mlp.up_proj.weight)
            act = F.silu(gate) * up
            if opt.get("fused_swiglu"):  # one rounding, as a fused kernel without emulation
                act = (F.silu(gate.float()) * up.float()).to(BF16)
            x = (x + lin(act, mlp.down_proj.weight)).to(res)
        h = norm(x, base.norm.weight)[at]
        head = model.get_output_embeddings().weight
        if opt.get("fp32_head"):
            logits = h.float() @ head.float().t()
        else:
            logits = h.to(BF16).float() @ head.to(BF16).float().t()
        if opt.get("bf16_logits"):
            logits = logits.to(BF16).float()
        lp = torch.log_softmax(logits, -1)
        return lp.gather(1, ids[at + 1][:, None])[:, 0].cpu()


def engine_teacher_forced(engine: LocalEngine, seq: list[int], index: list[int]) -> torch.Tensor:
    """The engine's own layer code over the whole sequence in one forward (one prefill)."""
    runner = engine._paged
    assert runner is not None
    n, dev = len(seq), runner.device
    pages = list(range(1, 1 + -(-n // runner.page_size)))
    runner.block_table[0, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
    slots = torch.arange(n, device=dev) + runner.page_size  # pages 1.. in order
    per = 32
    starts = torch.arange(0, n, per, device=dev)
    blocks = QueryBlocks(
        torch.zeros_like(starts), starts, (n - starts).clamp(max=per), tile_rows(runner.group, per)
    )
    ids, at = torch.tensor(seq, device=dev), torch.tensor(index, device=dev)
    with torch.inference_mode():
        hidden = runner._forward(ids, torch.arange(n, device=dev), slots, blocks)
        lp = torch.log_softmax(runner._logits(hidden[at]), -1)
    return lp.gather(1, ids[at + 1][:, None])[:, 0].cpu()


VARIANTS: dict[str, dict[str, bool]] = {
    "variant: bf16 residual stream": {"bf16_residual": True},
    "variant: bf16 weights (model.to(bf16))": {"bf16_residual": True, "bf16_weights": True},
    "variant: bf16 rotary tables": {"bf16_rotary": True},
    "variant: norms rounded once (fused)": {"fused_norm": True},
    "variant: SwiGLU rounded once (fused)": {"fused_swiglu": True},
    "variant: float32 attention": {"fp32_attention": True},
    "variant: float32 head": {"fp32_head": True},
    "variant: bf16 logits": {"bf16_logits": True},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=QWEN3_0_6B_SHAPE["vocab_size"])
    parser.add_argument("--episodes", type=int, default=3)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--obs-tokens", type=int, default=16)
    parser.add_argument("--turn-tokens", type=int, default=24)
    parser.add_argument(
        "--compile", action="store_true", help="compiled engines, emulated casts on and off"
    )
    args = parser.parse_args()
    model = build(args.layers, args.vocab, args.device)
    engines: dict[str, LocalEngine] = {}
    for emulate in (True, False) if args.compile else (True,):
        name = "engine" + ("" if not args.compile else ", compiled" + ("" if emulate else
                           ", casts not emulated"))  # fmt: skip
        engines[name] = LocalEngine(
            copy.deepcopy(model), None, seed=0, paged=True, compute_dtype=BF16, max_batch_size=8,
            compile=args.compile, emulate_precision_casts=emulate, kv_cache_gib=0.5,
        )  # fmt: skip
    runs = {name: asyncio.run(episodes(eng, args, args.vocab)) for name, eng in engines.items()}
    rows: dict[str, float] = {}

    def gap(name: str, a: torch.Tensor, b: torch.Tensor) -> None:
        rows[name] = max(rows.get(name, 0.0), (a - b).abs().max().item())

    first = next(iter(runs.values()))
    for name, eng in engines.items():
        for final, turns in runs[name]:
            seq, index, engine_lp = scored(final, turns)
            ref = learner_logprobs(model, [seq], index)
            gap(name, torch.tensor(engine_lp), ref)
            gap(name + ", teacher-forced", engine_teacher_forced(eng, seq, index), ref)
    for final, turns in first:
        seq, index, _ = scored(final, turns)
        ref = learner_logprobs(model, [seq], index)
        gap("variant: none (learner written out)", variant_logprobs(model, seq, index), ref)
        for name, opt in VARIANTS.items():
            gap(name, variant_logprobs(model, seq, index, **opt), ref)
        other = first[0][0][: 40 + len(seq) % 7]
        packed = learner_logprobs(model, [other, seq], index)
        gap("floor: packed after another sequence", packed, ref)
        cut = [i for i in index if i < len(seq) - 20]
        shorter = learner_logprobs(model, [seq[: cut[-1] + 2]], cut)
        gap("floor: scored as a shorter prefix", shorter, ref[: len(cut)])
    for eng in engines.values():
        asyncio.run(eng.aclose())
    if args.device.startswith("cuda"):
        machine = torch.cuda.get_device_name()
    else:
        machine = f"{platform.processor() or platform.machine()} ({os.cpu_count()} cpus)"
    print(f"\nbf16 engine vs learner, max |logp diff| ({args.layers} layers, Qwen3-0.6B widths)")
    print(f"{args.device}: {machine}")
    for name, value in rows.items():
        print(f"{name:<52}{value:>12.2e}")
    key = {name: "gap_" + "_".join("".join(c if c.isalnum() else " " for c in name).split())
           for name in rows}  # fmt: skip
    result = {"benchmark": "engine_mismatch", "device": args.device, "machine": machine}
    result |= {"layers": args.layers, "torch": torch.__version__}
    print(json.dumps(result | {key[k]: v for k, v in rows.items()}))


if __name__ == "__main__":
    main()
