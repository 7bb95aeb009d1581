"""Multi-rank helpers of the learner: FSDP2 sharding, sequence placement, merged metrics.

The learner runs unchanged in one process or under ``torchrun``. With more than one rank:

* the model is sharded with FSDP2: ``fully_shard`` on every decoder block (the model's
  ``_no_split_modules``) and then on the root module that computes the log-probs, so that the
  embedding, final norm and head are gathered around the head computation too; the packed
  body then runs each block as an FSDP2 forward method of the block's module
  (:meth:`~agentrl.kernels.packed_body.PackedBody.shard_ready`), so the same hooks gather,
  free and reduce its parameters as around transformers' forward;
* with ``fsdp_unit="model"`` the root alone is sharded: one unit, so FSDP2's hooks run once
  per forward and backward instead of once per block (they cost host time in every
  micro-batch);
* every rank receives the same whole batch and keeps a token-balanced share of each
  mini-batch (:func:`rank_shares`, deterministic, so ranks agree without talking);
* every rank runs the same number of micro-batches (:func:`plan_micro_batches` pads with empty
  ones), since each forward and backward of a sharded module is a collective; with
  ``fsdp_reduce="mini_batch"`` gradients are reduced once per mini-batch, after its last
  micro-batch (:func:`accumulate_locally`);
* metrics and per-sample values are merged once per step, in one collective
  (:meth:`StepStats.merged`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from agentrl.learner.packing import pack_sequences


def world() -> tuple[int, int]:
    """``(rank, world_size)``; ``(0, 1)`` without an initialised process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def shard(
    model: nn.Module,
    root: nn.Module,
    device: torch.device,
    world_size: int,
    block_dtype: torch.dtype | None = None,
    per_block: bool = True,
) -> None:
    """Shard ``model``'s decoder blocks and then ``root`` (which contains ``model``) with FSDP2.

    ``per_block=False`` shards ``root`` alone: one unit, gathered whole around each forward
    and backward (``learner.fsdp_unit="model"``).

    A packed body on ``root`` (``root.body``) is told, so that it runs the sharded blocks
    through FSDP2's hooks. With ``block_dtype`` (bf16 when the body runs under bf16 autocast)
    the blocks' parameters are gathered in that dtype: half the all-gather traffic, and the
    matmuls round them to it anyway. Gradients are still reduced, and the master weights kept,
    in float32; the root's parameters (embedding, final norm, head) are gathered in float32,
    since the head runs in float32. Inputs are not cast: the residual stream stays float32.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (world_size,))
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    policy = MixedPrecisionPolicy(
        param_dtype=block_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False
    )
    for sub in model.modules() if per_block else ():
        if type(sub).__name__ in blocks:
            fully_shard(sub, mesh=mesh, mp_policy=policy)
    fully_shard(root, mesh=mesh)
    body = getattr(root, "body", None)  # a PackedBody: run its layers in FSDP2's hooks
    if body is not None:
        body.shard_ready()


def fsdp_layout(
    unit: str, reduce: str, gather_bf16: bool, num_params: int, device: torch.device
) -> tuple[str, str]:
    """``(fsdp_unit, fsdp_reduce)`` with ``"auto"`` resolved (:class:`LearnerConfig`).

    ``mini_batch`` (and, without a bf16 gather, the one-unit ``model``) when one unsharded
    float32 copy of the parameters plus its gradients takes at most a quarter of the device's
    memory: the fast layout then costs little of the card, and larger models stay sharded.
    """
    if "auto" not in (unit, reduce):
        return unit, reduce
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    fits = 8 * num_params <= total / 4
    if reduce == "auto":
        reduce = "mini_batch" if fits else "micro_batch"
    if unit == "auto":
        unit = "model" if reduce == "mini_batch" and fits and not gather_bf16 else "block"
    return unit, reduce


def accumulate_locally(module: nn.Module, on: bool) -> None:
    """Under FSDP2, keep gradients (and gathered parameters) local until turned off again.

    The micro-batches of a mini-batch but its last accumulate their gradients unsharded on each
    rank and keep the parameters gathered after forward and backward; the last one frees them
    after its forward, gathers them again for its backward (so that the optimizer step finds
    them sharded) and reduce-scatters the sum once. Per mini-batch that is two all-gathers and
    one gradient reduction instead of two and one per micro-batch, at the cost of unsharded
    gradients and parameters in memory during the mini-batch. A no-op on a module FSDP2 did
    not shard.
    """
    set_sync = getattr(module, "set_requires_gradient_sync", None)
    if set_sync is None:
        return
    set_sync(not on)
    module.set_reshard_after_backward(not on)  # type: ignore[operator]
    for sub in module.modules():  # the blocks; the root keeps FSDP2's own choice (no reshard)
        if sub is not module and hasattr(sub, "set_reshard_after_forward"):
            sub.set_reshard_after_forward(not on, recurse=False)  # type: ignore[operator]


def clip_grad_norm(params: Sequence[nn.Parameter], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` that also takes FSDP2's sharded gradients cheaply.

    With DTensor gradients it works on the local shards: one norm kernel over them, one
    all-reduce of the squared sum, one scaling, where the generic path dispatches DTensor ops
    (and their sharding rules) on the host. Gradients that are not DTensors are whole on every
    rank and counted once. Returns the total norm (a 0-d tensor on the gradients' device).
    """
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    shards = [g.to_local() for g in grads if isinstance(g, DTensor)]
    if not shards:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    whole = [g for g in grads if not isinstance(g, DTensor)]
    sq = torch.stack(torch._foreach_norm(shards)).square().sum()
    dist.all_reduce(sq)
    if whole:
        sq = sq + torch.stack(torch._foreach_norm(whole)).square().sum()
    norm = sq.sqrt()
    torch._foreach_mul_(shards + whole, (max_norm / (norm + 1e-6)).clamp(max=1.0))
    return norm


def rank_shares(indices: Sequence[int], lengths: Sequence[int], world_size: int) -> list[list[int]]:
    """Every rank's share of ``indices``: longest first, each to the least-loaded rank.

    Deterministic, so every rank computes every rank's share without talking.

    Args:
        indices: the mini-batch's sample indices.
        lengths: token count of every sample (indexed by sample index).
        world_size: number of ranks.

    Returns:
        For each rank, its indices, sorted.
    """
    loads = [0] * world_size
    shares: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(indices, key=lambda i: -lengths[i]):
        r = loads.index(min(loads))
        loads[r] += lengths[i]
        shares[r].append(i)
    return [sorted(s) for s in shares]


def plan_micro_batches(
    indices: Sequence[int], lengths: Sequence[int], rank: int, world_size: int, budget: int
) -> list[list[int]]:
    """This rank's micro-batches of one mini-batch, padded with empty ones to the most any rank has.

    Each forward and backward of a sharded module is a collective, so every rank must run as
    many. Micro-batches hold at most ``budget`` tokens (:func:`~agentrl.learner.packing.
    pack_sequences`). Every rank computes every rank's bins, so no collective (and no wait for
    the GPU) is needed to agree.
    """
    shares = rank_shares(indices, lengths, world_size) if world_size > 1 else [list(indices)]
    bins = [pack_sequences([lengths[i] for i in share], budget) for share in shares]
    mine = [[shares[rank][j] for j in b] for b in bins[rank]]
    return mine + [[] for _ in range(max(len(b) for b in bins) - len(mine))]


class StepStats:
    """Weighted means, sums, minima and maxima of one learner step, mergeable across ranks."""

    def __init__(self) -> None:
        self.means: dict[str, list[float]] = {}  # key -> [sum of value * weight, sum of weights]
        self.sums: dict[str, float] = {}
        self.mins: dict[str, float] = {}
        self.maxs: dict[str, float] = {}
        self._later: list[Callable[[StepStats], None]] = []

    def later(self, record: Callable[[StepStats], None]) -> None:
        """Call ``record(self)`` when the statistics are read (:meth:`merged`).

        For values still on the device: reading them mid-step would make the host wait for the
        GPU, which then idles while the host queues the next kernels.
        """
        self._later.append(record)

    def mean(self, key: str, value: float, weight: float) -> None:
        """Add ``value`` to the weighted mean ``key``."""
        acc = self.means.setdefault(key, [0.0, 0.0])
        acc[0] += value * weight
        acc[1] += weight

    def add(self, key: str, value: float) -> None:
        """Add ``value`` to the sum ``key``."""
        self.sums[key] = self.sums.get(key, 0.0) + value

    def extreme(self, key: str, value: float, *, high: bool) -> None:
        """Keep the maximum (``high``) or minimum of ``key``."""
        table, pick = (self.maxs, max) if high else (self.mins, min)
        table[key] = pick(table[key], value) if key in table else value

    def merged(self, by_key: dict[int, Any] | None = None) -> tuple[StepStats, dict[int, Any]]:
        """These statistics combined over all ranks, and the union of the ranks' ``by_key``.

        One collective under ``torch.distributed`` carries both (keys of ``by_key`` are
        disjoint across ranks: e.g. per-sample values of each rank's share).
        """
        self._record_later()
        if world()[1] == 1:
            return self, dict(by_key or {})
        parts: list[Any] = [None] * world()[1]
        dist.all_gather_object(parts, (self, by_key or {}))
        out, union = StepStats(), {}
        for p, keyed in parts:
            union.update(keyed)
            for k, (s, w) in p.means.items():
                out.mean(k, s / w if w else 0.0, w)
            for k, v in p.sums.items():
                out.add(k, v)
            for k, v in p.mins.items():
                out.extreme(k, v, high=False)
            for k, v in p.maxs.items():
                out.extreme(k, v, high=True)
        return out, union

    def _record_later(self) -> None:
        pending, self._later = self._later, []
        for record in pending:
            record(self)

    def result(self) -> dict[str, float]:
        """All statistics as one flat metrics dict."""
        self._record_later()
        out = {k: s / w for k, (s, w) in self.means.items() if w > 0}
        return {**out, **self.sums, **self.mins, **self.maxs}
