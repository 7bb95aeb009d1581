"""The exact mode (``batch_invariant``): the engine's log-probs equal the learner's bit for bit.

On a GPU (marked ``gpu``): the batch-invariant kernels give a row the same bits whatever batch
it is in and agree with torch to rounding; the exact learner's attention has the varlen
kernel's gradients; a paged engine in the exact mode (concurrent requests, a second turn
over a reused prefix) returns log-probs equal to the exact learner's on sequences packed
together; ``agentrl train`` in the exact mode records no numeric mismatch. Without a card, the
engine and the learner refuse the exact mode with the reason (CPU tests).
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from agentrl.inference.base import SamplingParams
from agentrl.inference.engine import LocalEngine
from agentrl.kernels import invariant

ROOT = Path(__file__).parents[1]
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_exact_mode_is_refused_off_cuda(tiny: Any) -> None:
    model, tokenizer = tiny
    with pytest.raises(ValueError, match="batch_invariant"):
        LocalEngine(copy.deepcopy(model), tokenizer, paged=True, batch_invariant=True)
    with pytest.raises(ValueError, match="batch_invariant"):
        LocalEngine(copy.deepcopy(model), tokenizer, paged=False, batch_invariant=True)
    assert invariant.available(torch.device("cpu")) is not None


def test_learner_exact_mode_is_refused_with_a_reason(tiny: Any) -> None:
    from pydantic import ValidationError

    from agentrl.errors import ConfigError
    from agentrl.kernels.packed_body import PackedBody
    from agentrl.learner import Learner, LearnerConfig
    from agentrl.tiny import build_tiny_moe

    with pytest.raises(ValidationError, match="batch_invariant: needs dtype='bfloat16'"):
        LearnerConfig(batch_invariant=True)
    model, _ = tiny
    config = LearnerConfig(batch_invariant=True, dtype="bfloat16")
    with pytest.raises(ConfigError, match="batch_invariant: needs the packed body"):
        Learner(copy.deepcopy(model), config)  # auto on a CPU: transformers' forward
    with pytest.raises(ConfigError, match="batch_invariant: it needs a CUDA device"):
        Learner(copy.deepcopy(model), config.model_copy(update={"body": "packed"}))
    with pytest.raises(ValueError, match="batch_invariant: dense models only"):
        PackedBody(build_tiny_moe()[0], batch_invariant=True)


def test_learner_keys_are_laid_out_as_the_engine_caches_them() -> None:
    """Each sequence on its own pages, positions restarting at 0, query blocks covering all."""
    lengths = (20, 16, 1)
    cpu = torch.device("cpu")
    slots, pos, blocks, table, n_slots = invariant._paged_layout(lengths, 32, 64, cpu)
    page = invariant.PAGE
    assert pos.tolist() == list(range(20)) + list(range(16)) + [0]
    assert slots.tolist() == list(range(20)) + list(range(32, 48)) + [48]
    assert n_slots == 4 * page and table.tolist() == [[0, 1], [2, 3], [3, 4]]
    assert [blocks.row.tolist(), blocks.tok.tolist(), blocks.n.tolist()] == [
        [0, 1, 2], [0, 20, 36], [20, 16, 1],
    ]  # fmt: skip
    assert invariant._paged_layout(lengths, 32, 64, cpu)[0] is slots  # one layout for every layer


def _randn(*shape: int, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, device="cuda", generator=gen) * scale).bfloat16()


@pytest.mark.gpu
@GPU
def test_matmul_rows_do_not_depend_on_the_batch() -> None:
    a, w, b = _randn(1000, 1024), _randn(3072, 1024, scale=0.03, seed=1), _randn(3072, seed=2)
    for out_dtype in (torch.bfloat16, torch.float32):
        full = invariant.matmul(a, w, b, out_dtype=out_dtype)
        for lo, hi in ((0, 1), (0, 3), (5, 69), (600, 1000), (999, 1000)):
            assert torch.equal(invariant.matmul(a[lo:hi], w, b, out_dtype=out_dtype), full[lo:hi])
        ref = a.float() @ w.float().t() + b.float()
        tol = 1e-4 if out_dtype == torch.float32 else 1e-2
        assert (full.float() - ref).abs().max().item() <= tol * ref.abs().max().item()
    y = invariant.linear(a[:7].requires_grad_(), w)  # the backward is the ordinary one
    y.float().sum().backward()


@pytest.mark.gpu
@GPU
def test_norm_and_logprobs_agree_with_torch_and_do_not_depend_on_the_batch() -> None:
    from agentrl.kernels.fused_layer import _rms_norm

    x, weight = _randn(300, 1024).float(), _randn(1024, seed=3).float()
    got = invariant.rms_norm(x, weight, 1e-6)
    assert torch.equal(invariant.rms_norm(x[17:18], weight, 1e-6), got[17:18])
    assert (got - _rms_norm(x, weight, 1e-6)).abs().max().item() < 1e-4
    logits = _randn(64, 151936, scale=3.0, seed=4).float()
    inv_t = torch.full((64,), 1 / 0.7, device="cuda")
    targets = torch.arange(64, device="cuda") * 2000
    lp, lse = invariant.token_logprobs(logits, inv_t, targets)
    ref = torch.log_softmax(logits * inv_t[:, None], -1).gather(1, targets[:, None])[:, 0]
    assert (lp - ref).abs().max().item() < 1e-4
    sub = invariant.token_logprobs(logits[9:11], inv_t[9:11], targets[9:11])
    assert torch.equal(sub[0], lp[9:11]) and torch.equal(sub[1], lse[9:11])


@pytest.mark.gpu
@GPU
def test_packed_attention_matches_the_varlen_kernel_forward_and_backward() -> None:
    from agentrl.kernels.attention import varlen_attention

    lengths = [300, 17, 129]
    n, cu = sum(lengths), torch.tensor([0, 300, 317, 446], dtype=torch.int32, device="cuda")
    q, k, v = _randn(n, 16, 128), _randn(n, 8, 128, seed=5), _randn(n, 8, 128, seed=6)
    grads = []
    for fn in (invariant.packed_attention, varlen_attention):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves, cu, lengths if fn is invariant.packed_attention else 300, 128**-0.5)
        (out.float() * torch.linspace(-1, 1, 128, device="cuda")).sum().backward()
        grads.append([out.detach(), *(t.grad for t in leaves)])
    for mine, theirs in zip(*grads, strict=True):
        assert (mine.float() - theirs.float()).abs().max().item() < 2e-2


def _qwen3(layers: int) -> Any:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from agentrl.tiny import QWEN3_0_6B_SHAPE

    shape = {**QWEN3_0_6B_SHAPE, "num_hidden_layers": layers, "max_position_embeddings": 4096}
    torch.manual_seed(0)
    with torch.device("cuda"):
        return Qwen3ForCausalLM(Qwen3Config(**shape, eos_token_id=1, pad_token_id=0))


async def _episodes(engine: LocalEngine) -> list[tuple[list[int], list[int], list[float]]]:
    """Eight two-turn episodes at once: (whole sequence, its sampled positions, log-probs)."""
    gen = torch.Generator().manual_seed(0)

    async def episode(i: int) -> tuple[list[int], list[int], list[float]]:
        ids = torch.randint(3, 150000, (20 + 9 * i,), generator=gen).tolist()
        where: list[int] = []
        lps: list[float] = []
        for turn in range(2):
            params = SamplingParams(
                max_new_tokens=40 - 12 * turn, temperature=1.0, seed=i, ignore_eos=True
            )
            out = await engine.generate(ids, params)
            where += range(len(ids), len(ids) + len(out.output_ids))
            lps += out.logprobs
            ids = ids + out.output_ids + torch.randint(3, 150000, (10,), generator=gen).tolist()
        return ids[:-10], where, lps

    return await asyncio.gather(*(episode(i) for i in range(8)))


@pytest.mark.gpu
@GPU
def test_engine_logprobs_equal_the_exact_learners_bit_for_bit() -> None:
    from agentrl.kernels.packed_body import PackedBody
    from agentrl.learner.logprobs import LogprobModel

    model = _qwen3(4)
    eng = LocalEngine(
        copy.deepcopy(model), None, seed=0, max_batch_size=16, kv_cache_gib=1.0,
        compute_dtype=torch.bfloat16, batch_invariant=True,
    )  # fmt: skip

    async def run() -> list[tuple[list[int], list[int], list[float]]]:
        try:
            return await _episodes(eng)
        finally:
            await eng.aclose()

    episodes = asyncio.run(run())
    assert eng.prefill_stats()["cached_tokens"] > 0  # the second turns reused their prefixes
    learner = LogprobModel(
        model, temperature=1.0, chunk_size=1024, autocast_dtype=torch.bfloat16,
        head_dtype=torch.bfloat16, body=PackedBody(model, batch_invariant=True),
    )  # fmt: skip
    ids: list[int] = []
    index: list[int] = []
    targets: list[int] = []
    engine_lp: list[float] = []
    for seq, where, lps in episodes:  # all eight sequences packed into one row
        index += [len(ids) + p - 1 for p in where]
        targets += [seq[p] for p in where]
        engine_lp += lps
        ids += seq
    lengths = tuple(len(seq) for seq, _, _ in episodes)
    pos = torch.cat([torch.arange(n) for n in lengths]).cuda()[None]
    with torch.inference_mode():
        got, _ = learner(
            torch.tensor([ids], device="cuda"),
            pos,
            None,
            torch.tensor(index, device="cuda"),
            torch.tensor(targets, device="cuda"),
            lengths,
        )
    diff = (got.cpu().double() - torch.tensor(engine_lp, dtype=torch.float64)).abs()
    assert diff.max().item() == 0.0, (diff.max().item(), int((diff > 0).sum()))


@pytest.mark.gpu
@GPU
def test_agentrl_train_in_the_exact_mode_has_no_numeric_mismatch(tmp_path: Path) -> None:
    cmd = [
        sys.executable, "-m", "agentrl.cli", "train",
        str(ROOT / "recipes" / "configs" / "arith-gpu-small.toml"),
        f"--run_dir={tmp_path}", "--train.steps=2", "--train.eval_every=0",
        "--cold_start.steps=20", "--env.num_eval_tasks=64", "--learner.dtype=bfloat16",
        "--learner.batch_invariant=true",
        "--advantages.shapers=[{name: format, penalty: 0.1}]",
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    gaps = [r["mismatch/numeric_max_abs"] for r in lines if "mismatch/numeric_max_abs" in r]
    assert gaps and all(g == 0.0 for g in gaps), gaps
