"""The paged engine's prefill graphs (agentrl.inference.engine.prefill_graphs).

CPU: the bucketed, padded inputs a graph replays compute what the eager prefill computes (the
same logits, the same keys and values, nothing written outside the sequences' pages but the
scratch page). The capture itself needs a card: tests/test_engine_paged.py's GPU tests run
the engine with prefill graphs on (graph vs eager engine, log-probs vs the learner's).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from agentrl.inference.engine.paged_runner import PagedRunner
from agentrl.inference.engine.prefill_graphs import (
    MAX_GRAPHS,
    PrefillGraphs,
    pack_prefill,
    token_buckets,
)


def test_token_buckets_grow_by_half_steps_up_to_the_first_that_holds_the_most() -> None:
    assert token_buckets(16384) == [
        16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096,
        6144, 8192, 12288, 16384,
    ]  # fmt: skip
    assert token_buckets(40) == [16, 24, 32, 48]
    assert token_buckets(1) == [16]


def test_packed_prefill_inputs_are_each_tokens_id_position_and_slot() -> None:
    rng = torch.Generator().manual_seed(1)
    page, per = 16, 48
    lengths = torch.randint(1, 200, (40,), generator=rng).tolist()
    tokens = [torch.randint(0, 1000, (n,), generator=rng).tolist() for n in lengths]
    starts = [int(torch.randint(0, n, (1,), generator=rng)) for n in lengths]
    pages = [torch.randperm(500, generator=rng)[: -(-n // page)].tolist() for n in lengths]
    rows = torch.randperm(64, generator=rng)[:40].tolist()
    columns, blocks, last = pack_prefill(rows, starts, tokens, pages, page, per)
    want: list[list[int]] = [[], [], []]  # the definition, token by token
    want_blocks: list[tuple[int, int, int]] = []
    for row, start, toks, pgs in zip(rows, starts, tokens, pages, strict=True):
        first = len(want[0])
        for p in range(start, len(toks)):
            want[0].append(toks[p])
            want[1].append(p)
            want[2].append(pgs[p // page] * page + p % page)
        n = len(toks) - start
        want_blocks += [(row, first + b, min(per, n - b)) for b in range(0, n, per)]
    assert columns.dtype == blocks.dtype == last.dtype == torch.int64
    assert columns.tolist() == want
    assert list(zip(*blocks.tolist(), strict=True)) == want_blocks
    assert last.tolist() == [
        sum(n - s for n, s in zip(lengths[: i + 1], starts[: i + 1], strict=True)) - 1
        for i in range(40)
    ]


def _model() -> Any:
    cfg = Qwen3Config(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
        eos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen3ForCausalLM(cfg).eval()


def _runner(model: Any) -> PagedRunner:
    runner = PagedRunner(
        copy.deepcopy(model), num_pages=12, page_size=16, max_batch_size=4, max_model_len=128,
        cuda_graphs=False,
    )  # fmt: skip
    for row, pages in enumerate(PAGES):
        runner.block_table[row, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
    return runner


gen = torch.Generator().manual_seed(0)
SEQS = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (5, 40, 30)]
PAGES = [[1], [2, 3, 4], [5, 6]]  # page 0 is scratch; pages 7-11 belong to nobody
STARTS = [0, 0, 16]  # the third sequence's first page is a cached prefix


def test_padded_prefill_inputs_compute_what_the_eager_prefill_computes() -> None:
    model = _model()
    out = {}
    for pad in (False, True):
        runner = _runner(model)
        with torch.inference_mode():
            runner.prefill([2], [0], [SEQS[2][:16]], [PAGES[2]])  # the cached prefix, eagerly
            columns, blocks, last = pack_prefill(
                [0, 1, 2], STARTS, SEQS, PAGES, runner.page_size, runner.prefill_tokens
            )
            if pad:
                graphs = PrefillGraphs(runner, 1024)
                t = graphs.bucket(len(columns[0]), 3)
                assert t == 64  # 59 tokens, 3 sequences: 5 padded tokens, a padded row
                hidden = graphs._body(t, graphs.inputs(t, columns, blocks, last))[:3]
                logits = runner._logits(hidden)
            else:
                logits = runner.prefill([0, 1, 2], STARTS, SEQS, PAGES)
        out[pad] = (logits, runner.cache.k.clone(), runner.cache.v.clone())
    (logits, k, v), (logits_p, k_p, v_p) = out[False], out[True]
    assert logits.shape == (3, 512) and logits.abs().sum() > 0
    assert torch.allclose(logits_p, logits, atol=1e-5, rtol=1e-5)
    owned = [1, 2, 3, 4, 5, 6]  # the sequences' pages hold the same keys and values
    size = 16
    slots = torch.tensor([p * size + i for p in owned for i in range(size)])
    assert torch.allclose(k_p[:, slots], k[:, slots], atol=1e-6)
    assert torch.allclose(v_p[:, slots], v[:, slots], atol=1e-6)
    nobody = slice(7 * size, 12 * size)
    assert k_p[:, nobody].abs().sum() == 0 and v_p[:, nobody].abs().sum() == 0


def test_a_prefill_beyond_the_biggest_bucket_or_graph_count_runs_eagerly() -> None:
    runner = _runner(_model())
    graphs = PrefillGraphs(runner, 40)
    assert graphs.bucket(48, 4) == 48
    assert graphs.bucket(17, 1) == 24  # one bucket whatever the number of sequences
    assert graphs.bucket(49, 1) is None  # more tokens than the biggest bucket
    assert graphs.bucket(10, 5) is None  # more sequences than the runner decodes
    many = PrefillGraphs(runner, 2**40)  # no more buckets (graphs) than MAX_GRAPHS
    assert len(many.token_buckets) == MAX_GRAPHS and many.bucket(2**40, 1) is None
