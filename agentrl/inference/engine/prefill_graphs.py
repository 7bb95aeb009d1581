"""CUDA graphs of the paged engine's prefill: one per token bucket.

Why: an eager prefill launches a dozen kernels per layer from Python, so it is host-bound. In
the training loop's one process its thread shares the GIL with the learner's and the event
loop's: on an H100 a prefill of 64 new 26-token prompts (1,664 tokens of Qwen3-0.6B's shape)
took 28-168 ms, the card idle for most of it. A replayed graph is one launch.

- **Buckets.** The packed tokens are padded up to the next of 16, 24, 32, 48, 64, 96, ...
  (``2^k`` and ``3 * 2^(k-1)``: at most a third of a graph's tokens are padding), up to the
  batcher's ``max_prefill_tokens`` (a bigger prefill runs eagerly); every graph has room for
  ``max_batch_size`` sequences. Padded tokens write their keys and values to the scratch page
  and belong to no query block; padded query blocks hold no token (their programs store
  nothing); padded sequences read token 0's hidden state and are dropped. Sequences are not
  bucketed: a padded sequence costs one row of hidden state and some empty attention programs,
  while every bucket costs a capture, and in the loop on an H100 the (tokens, sequences)
  buckets met in the first 14 steps took ~11 captures of 120-230 ms each.
- **What a graph holds.** The final-norm hidden state of each sequence's last token: the head
  and sampling run eagerly after it. A graph's output lives as long as the graph, and logits
  (sequences x vocabulary, float32) would cost each graph 78 MB at Qwen's vocabulary and 128
  sequences; hidden states cost 0.5 MB.
- **Memory.** The prefill graphs share one memory pool, apart from the decode graphs'. Graphs
  of one pool may reuse each other's intermediates, which is safe only where a graph's output
  is read before another graph of its pool replays: a prefill's hidden states are, but a step
  that decodes and prefills reads the decode graph's sampled tokens after the prefill graph
  ran (with one pool for both, the loop on an H100 failed on token ids out of range).
- **Capture** of every bucket (the ``MAX_GRAPHS`` smallest at most) happens when the runner
  is built (:meth:`PrefillGraphs.capture_all`, as SGLang captures its graphs at startup), each
  after a warm-up run on scratch inputs on a side stream (no real sequence's cache is
  written); captured at their first use instead, the buckets a loop meets cost it one-off
  stalls of 100-230 ms each in its first steps on an H100.
- **Numerics.** Rows are computed as eagerly, but at the bucket's padded size: outside the
  exact mode a matmul may pick another algorithm for another row count, so a prefill's
  log-probs can differ from the eager ones by bf16 rounding; in the exact mode
  (``batch_invariant``) every kernel is batch-invariant and they are equal bit for bit.
"""

from __future__ import annotations

import logging
import math
import time
from array import array
from typing import Any

import torch

from agentrl.kernels.paged_attention import QueryBlocks
from agentrl.kernels.transfer import device_context

PREFILL_GRAPHS = True
"""Capture prefills as CUDA graphs where the runner captures decode steps (``False``: eager;
``benchmarks/loop_gpu.py --prefill-graphs`` compares the two)."""
MAX_GRAPHS = 64
"""Most prefill graphs one runner captures (its smallest token buckets); bigger prefills run
eagerly."""
log = logging.getLogger(__name__)


def token_buckets(most: int) -> list[int]:
    """Padded prefill sizes: 16, 24, 32, 48, ... up to the first one that holds ``most``."""
    out, k = [16], 16
    while out[-1] < most:
        out += [k + k // 2, 2 * k]
        k *= 2
    return [b for i, b in enumerate(out) if i == 0 or out[i - 1] < most]


def pack_prefill(
    rows: list[int],
    starts: list[int],
    tokens: list[list[int]],
    pages: list[list[int]],
    page_size: int,
    per_block: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A prefill's packed inputs (CPU int64): what :meth:`PrefillGraphs.inputs` pads.

    Each sequence feeds ``tokens[i][starts[i]:]`` into its block-table row ``rows[i]`` (pages
    ``pages[i]``), cut into query blocks of at most ``per_block`` tokens.

    Returns:
        The new tokens' ids, positions and KV slots ``(3, N)``; the query blocks' rows, first
        tokens and counts ``(3, K)``; each sequence's last token (its index among the new ones).
    """
    ids, flat_pages = array("q"), array("q")  # C arrays: a copy of each list, not an int each
    counts, page0 = [], []
    for start, toks, pgs in zip(starts, tokens, pages, strict=True):
        ids.extend(toks[start:] if start else toks)
        counts.append(len(toks) - start)
        page0.append(len(flat_pages))
        flat_pages.extend(pgs)
    n = torch.tensor(counts, dtype=torch.int64)
    seq = torch.repeat_interleave(torch.arange(len(counts)), n)
    ends = torch.cumsum(n, 0)
    pos = torch.arange(len(ids)) - (ends - n)[seq] + torch.tensor(starts, dtype=torch.int64)[seq]
    page = _int64(flat_pages)[torch.tensor(page0, dtype=torch.int64)[seq] + pos // page_size]
    columns = torch.stack([_int64(ids), pos, page * page_size + pos % page_size])
    blocks: list[list[int]] = [[], [], []]  # a sequence's tokens in blocks of per_block
    first = 0
    for row, k in zip(rows, counts, strict=True):
        for b in range(first, first + k, per_block):
            blocks[0].append(row)
            blocks[1].append(b)
            blocks[2].append(min(per_block, first + k - b))
        first += k
    return columns, torch.tensor(blocks, dtype=torch.int64), ends - 1


def _int64(values: array) -> torch.Tensor:
    """A C array of int64 as a tensor (sharing its memory)."""
    return (
        torch.frombuffer(values, dtype=torch.int64) if values else torch.zeros(0, dtype=torch.int64)
    )


class PrefillGraphs:
    """The prefill graphs of one :class:`PagedRunner` (see the module docstring).

    A graph is keyed by its token bucket; each has room for the runner's ``max_batch_size``
    sequences.

    Args:
        runner: the :class:`~agentrl.inference.engine.paged_runner.PagedRunner` whose ``_forward``
            the graphs capture (CUDA graphs on).
        max_tokens: the largest token bucket holds at least this many tokens.
    """

    def __init__(self, runner: Any, max_tokens: int) -> None:
        self.runner = runner
        self.token_buckets = token_buckets(max_tokens)[:MAX_GRAPHS]
        self.pool: Any = None  # a CUDA graph pool handle, made at the first capture
        # token bucket -> graph, its device inputs, their pinned host copy, its output
        self.graphs: dict[
            int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor]
        ] = {}

    def bucket(self, tokens: int, seqs: int) -> int | None:
        """The token bucket of a prefill of that size, or ``None``: run it eagerly."""
        if seqs > self.runner.max_batch_size:
            return None
        return next((b for b in self.token_buckets if b >= tokens), None)

    def capture_all(self) -> None:
        """Capture every bucket's graph now (the first uses then replay)."""
        t0 = time.perf_counter()
        with torch.inference_mode(), device_context(self.runner.device):
            for t in self.token_buckets:
                if t not in self.graphs:
                    self._capture(t)
        log.info(
            "prefill graphs: %d captured in %.1f s (up to %d tokens)",
            len(self.graphs), time.perf_counter() - t0, self.token_buckets[-1],
        )  # fmt: skip

    def _sizes(self, t: int) -> tuple[int, int]:
        """Query blocks and sequences of bucket ``t``'s inputs."""
        s = self.runner.max_batch_size
        # each sequence's blocks: ceil(its tokens / per) <= its tokens / per + 1
        return math.ceil(t / self.runner.prefill_tokens) + s, s

    def _padding(self, t: int) -> torch.Tensor:
        """The inputs of a prefill with no real token (every column a padded one)."""
        b, s = self._sizes(t)
        out = torch.zeros(3 * t + 3 * b + s, dtype=torch.int64)
        out[3 * t : 3 * t + b] = self.runner.scratch_row  # padded blocks: the scratch row
        return out

    def _body(self, t: int, static: torch.Tensor) -> torch.Tensor:
        b, _ = self._sizes(t)
        ids, pos, slots = static[: 3 * t].view(3, t)
        rows, first, n = static[3 * t : 3 * t + 3 * b].view(3, b)
        runner = self.runner
        blocks = QueryBlocks(rows, first, n, runner._tile(runner.prefill_tokens))
        hidden = runner._forward(ids, pos, slots, blocks)
        return hidden[static[3 * t + 3 * b :]]

    def _capture(self, t: int) -> None:
        device = self.runner.device
        static = self._padding(t).to(device)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):  # warm-up: compiles and autotunes outside the capture
            self._body(t, static)
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = self._body(t, static)
        host = torch.empty(static.shape, dtype=torch.int64, pin_memory=True)
        self.graphs[t] = (graph, static, host, out)

    def inputs(
        self, t: int, columns: torch.Tensor, blocks: torch.Tensor, last: torch.Tensor
    ) -> torch.Tensor:
        """The graph's inputs for a prefill (a CPU tensor), padded to token bucket ``t``.

        Args:
            t: :meth:`bucket`'s token bucket for the prefill.
            columns: :func:`pack_prefill`'s token ids, positions and KV slots.
            blocks: its query blocks.
            last: its sequences' last tokens.
        """
        b, _ = self._sizes(t)
        out = self._padding(t)
        out[: 3 * t].view(3, t)[:, : columns.shape[1]] = columns
        out[3 * t : 3 * t + 3 * b].view(3, b)[:, : blocks.shape[1]] = blocks
        out[3 * t + 3 * b : 3 * t + 3 * b + len(last)] = last
        return out

    def run(self, t: int, inputs: torch.Tensor) -> torch.Tensor:
        """Replay bucket ``t``'s graph on :meth:`inputs`; writes the tokens' keys and values.

        Returns the hidden states ``(max_batch_size, H)`` of each sequence's last token, the
        padded rows after the real ones. The graph is captured here if :meth:`capture_all` did
        not.
        """
        if t not in self.graphs:
            self._capture(t)
        graph, static, host, out = self.graphs[t]
        # the pinned copy is reused: the engine's step has read its last result back (a sync)
        # since this graph's last replay, so no earlier copy from it is still pending
        host.copy_(inputs)
        static.copy_(host, non_blocking=True)
        graph.replay()
        return out
