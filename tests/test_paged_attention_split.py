"""Tests for flash-decoding in :mod:`agentrl.kernels.paged_attention` (``QueryBlocks.splits``).

- Without Triton (CI) the whole file skips.
- CPU: the kernels run under the Triton interpreter in one subprocess (``TRITON_INTERPRET=1`` is
  read when kernels are decorated, so it must not leak into this process) that runs this file as
  a script and prints, per (GQA group, splits), the largest error of decode blocks against the
  module's torch reference; splits past the rows' key blocks leave programs with empty ranges.
- This process: :func:`decode_splits`' rule, ``lse`` with splits refused.
- GPU (skipped without CUDA): Qwen3-0.6B's heads in bf16, splits against one program per head,
  eagerly and replayed from a CUDA graph at other context lengths.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from agentrl.kernels.paged_attention import (  # noqa: E402
    MAX_SPLITS,
    QueryBlocks,
    decode_splits,
    paged_attention,
    tile_rows,
)

REPO = Path(__file__).resolve().parents[1]
CONTEXTS = [1, 15, 16, 17, 100, 300]  # one decode row each: key blocks of 64 cut 1..5 ways
GROUPS = {"group2": (4, 2), "group4": (8, 2)}  # name -> query heads, KV heads
SPLITS = (1, 2, 3, 8)
PAGE = 16


def _decode_inputs(
    contexts: list[int], hq: int, hkv: int, d: int, dtype: torch.dtype, device: str, seed: int
) -> tuple[torch.Tensor, ...]:
    """``q, k_cache, v_cache, block_table, rows, q_pos``: one decode token per context, its
    sequence's pages scattered over a shuffled cache (the last page a spare)."""
    g = torch.Generator().manual_seed(seed)
    pages_per = max(-(-n // PAGE) for n in contexts)
    n_pages = len(contexts) * pages_per + 1
    order = torch.randperm(n_pages - 1, generator=g)
    table = order.view(len(contexts), pages_per).to(torch.int32)
    cache = torch.randn(2, n_pages * PAGE, hkv, d, generator=g)
    q = torch.randn(len(contexts), hq, d, generator=g)
    pos = torch.tensor([n - 1 for n in contexts])
    rows = torch.randperm(len(contexts), generator=g)  # token i decodes row rows[i]
    pos = pos[rows]
    out = (q.to(dtype), cache[0].to(dtype), cache[1].to(dtype), table)
    return tuple(t.to(device) for t in out) + (rows.to(device), pos.to(device))


def _interpreter_errors() -> dict[str, float]:
    from agentrl.kernels import paged_attention as pa

    errors = {}
    for i, (name, (hq, hkv)) in enumerate(GROUPS.items()):
        d = 16 if hq == 4 else 32
        q, k, v, table, rows, pos = _decode_inputs(CONTEXTS, hq, hkv, d, torch.float32, "cpu", i)
        block_m = tile_rows(hq // hkv, 1)
        want = pa._reference(q, k, v, table, QueryBlocks.decode(rows, block_m), pos, PAGE, 0.25)
        for splits in SPLITS:
            blocks = QueryBlocks.decode(rows, block_m, splits)
            got = pa._launch(q, k, v, table, blocks, pos, PAGE, 0.25)
            errors[f"{name}/{splits}"] = (got - want).abs().max().item()
        # splits=1 with lse (the exact mode's path): its natural-log normalisers, (Hq, N)
        lse = torch.empty(hq, len(CONTEXTS))
        pa._launch(q, k, v, table, QueryBlocks.decode(rows, block_m), pos, PAGE, 0.25, lse)
        errors[f"{name}/lse"] = (lse - _reference_lse(q, k, table, rows, pos)).abs().max().item()
    return errors


def _reference_lse(
    q: torch.Tensor, k: torch.Tensor, table: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor
) -> torch.Tensor:
    """``(Hq, N)`` log-sum-exp of each decode token's scaled scores over its keys ``0..pos``."""
    out = torch.empty(q.shape[1], q.shape[0])
    for i, (row, p) in enumerate(zip(rows.tolist(), pos.tolist(), strict=True)):
        kpos = torch.arange(p + 1)
        keys = k[table[row, kpos // PAGE].long() * PAGE + kpos % PAGE]  # (p + 1, Hkv, D)
        keys = keys.repeat_interleave(q.shape[1] // k.shape[1], 1)
        out[:, i] = torch.logsumexp(torch.einsum("hd,khd->hk", q[i], keys) * 0.25, -1)
    return out


def _interpreter_main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_triton_attention import _fix_interpreter_index

    _fix_interpreter_index()
    print("RESULT " + json.dumps(_interpreter_errors()))


@pytest.fixture(scope="module")
def interpreter_errors() -> dict[str, float]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_triton_attention import run_under_interpreter

    return run_under_interpreter(str(Path(__file__).resolve()))


@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("group", list(GROUPS))
def test_interpreter_splits_match_reference(
    interpreter_errors: dict[str, float], group: str, splits: int
) -> None:
    assert interpreter_errors[f"{group}/{splits}"] <= 1e-5, interpreter_errors


@pytest.mark.parametrize("group", list(GROUPS))
def test_interpreter_lse_without_splits(interpreter_errors: dict[str, float], group: str) -> None:
    assert interpreter_errors[f"{group}/lse"] <= 1e-5, interpreter_errors


def test_decode_splits_rule() -> None:
    assert decode_splits(1, 8, "cpu") == 1  # off CUDA: one program per (row, KV head)
    assert decode_splits(1, 8, torch.device("cpu"), sms=132) == 1
    # H200 (132 SMs), Qwen3-0.6B (8 KV heads): rows * 8 * splits about 264
    got = {rows: decode_splits(rows, 8, "cuda:0", sms=132) for rows in (1, 2, 4, 8, 16, 17, 64)}
    assert got == {1: MAX_SPLITS, 2: 16, 4: 8, 8: 4, 16: 2, 17: 1, 64: 1}
    assert decode_splits(1, 1, "cuda", sms=4) == 8
    assert decode_splits(3, 2, "cuda", sms=16) == 5  # 6 programs: 2 * 16 // 6
    assert decode_splits(0, 8, "cuda", sms=132) == MAX_SPLITS  # no rows: harmless


def test_decode_blocks_and_lse_with_splits_refused() -> None:
    rows = torch.tensor([3, 0, 2])
    blocks = QueryBlocks.decode(rows, 16, 4)
    assert blocks.tok.tolist() == [0, 1, 2] and blocks.n.tolist() == [1, 1, 1]
    assert (blocks.block_m, blocks.splits, QueryBlocks(rows, rows, rows, 16).splits) == (16, 4, 1)
    q, k, v, table, rows, pos = _decode_inputs([5, 9], 4, 2, 16, torch.float32, "cpu", 0)
    with pytest.raises(ValueError, match="lse needs splits=1"):
        paged_attention(
            q, k, v, table, QueryBlocks.decode(rows, 16, 2), pos,
            page_size=PAGE, scale=0.25, lse=torch.empty(4, 2),
        )  # fmt: skip


@pytest.mark.gpu
def test_gpu_qwen3_shape_bf16_splits_match_one_program_and_replay() -> None:
    from agentrl.kernels import paged_attention as pa

    contexts = [1, 700, 4099, 10000]
    hq, hkv, d = 16, 8, 128
    q, k, v, table, rows, pos = _decode_inputs(contexts, hq, hkv, d, torch.bfloat16, "cuda", 5)
    scale, block_m = d**-0.5, tile_rows(hq // hkv, 1)
    splits = decode_splits(len(contexts), hkv, "cuda")
    assert splits > 1

    def attend(s: int) -> torch.Tensor:
        blocks = QueryBlocks.decode(rows, block_m, s)
        return paged_attention(q, k, v, table, blocks, pos, page_size=PAGE, scale=scale)

    one, split = attend(1), attend(splits)
    want = pa._reference(q.float(), k.float(), v.float(), table, QueryBlocks.decode(rows, 16),
                         pos, PAGE, scale)  # fmt: skip
    assert (split.float() - one.float()).abs().max().item() < 2e-2
    assert (split.float() - want).abs().max().item() < 2e-2
    # a CUDA graph captured once replays at other lengths (the ranges are cut on the card)
    attend(splits)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = attend(splits)
    for shift in (-600, 37):
        pos.copy_((pos + shift).clamp(0, max(contexts) - 1))  # every row has all the pages
        graph.replay()
        torch.testing.assert_close(static, attend(splits), atol=0, rtol=0)


if __name__ == "__main__" and "--interpreter" in sys.argv:
    _interpreter_main()
