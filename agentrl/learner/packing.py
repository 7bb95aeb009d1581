"""Training samples and sequence packing, for the learner.

A :class:`TrainSample` is one sequence with its per-token loss mask, engine log-probs, weight
versions and advantages.

Packing: the sequences of a micro-batch are concatenated into one row with ``position_ids``
restarting at 0 for every sequence, so no token is padding. Attention must not cross sequence
borders: for ``sdpa`` and ``eager`` attention we pass an explicit document-causal 4D mask (token
``q`` sees token ``k`` iff both belong to the same sequence and ``k <= q``); for every other
implementation (``flash_attention_*``, ``flex_attention``, ...) we pass no mask and transformers
derives the sequence borders from the restarting ``position_ids`` (the varlen path). The
learner's own packed body (:mod:`agentrl.kernels.packed_body`,
``attn_implementation="packed"``) takes
no mask either: it reads the sequence lengths.

Cost of the explicit mask: ``sdpa`` and ``eager`` attend over the whole packed row and mask
afterwards, so attention costs grow with ``budget²`` rather than with the sum of the squared
sequence lengths; on a CPU (and for small models, where attention dominates) a budget of 1-2k
tokens is faster than 8k. Varlen kernels (``flash_attention_2``) have no such waste.

Only the tokens that train (``loss_mask == 1``) are indexed as targets: :class:`PackedBatch`
lists, for each, the row position whose hidden state predicts it, so the head never runs on
prompt or observation tokens (:mod:`agentrl.learner.logprobs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import numpy as np
import torch

from agentrl.kernels.transfer import to_device
from agentrl.types import Trajectory

# Attention implementations that take our explicit 4D mask; the others read position_ids.
_MASKED_ATTENTION = ("sdpa", "eager")


@dataclass(frozen=True, slots=True)
class TrainSample:
    """One sequence to train on; every list has one entry per token."""

    tokens: list[int]
    loss_mask: list[int]
    """1 on tokens the policy sampled; the first token must be 0."""
    logprobs: list[float]
    """The engine's log-prob of each sampled token (0.0 where ``loss_mask`` is 0)."""
    versions: list[int]
    """Weight version that sampled each token (-1 where ``loss_mask`` is 0)."""
    advantages: list[float]
    """Per-token advantage (read only where ``loss_mask`` is 1)."""
    routed_experts: np.ndarray | None = field(default=None, compare=False)
    """MoE models: the experts each token went through, ``(len(tokens) - 1, layers, top_k)``
    int16 (row ``i`` for token ``i``; the last token is never fed back; -1 = unknown), as the
    engine recorded them; ``None`` for dense models or when not recorded."""

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if n == 0:
            raise ValueError("tokens: expected at least one token, got none")
        for name in ("loss_mask", "logprobs", "versions", "advantages"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name}: expected {n} entries, got {len(getattr(self, name))}")
        if self.loss_mask[0]:
            raise ValueError("loss_mask: expected 0 for the first token (nothing predicts it)")
        if self.routed_experts is not None:
            experts = np.asarray(self.routed_experts)
            if experts.ndim != 3 or experts.shape[0] != n - 1:
                raise ValueError(
                    f"routed_experts: expected shape ({n - 1}, layers, top_k), got {experts.shape}"
                )
            if not np.issubdtype(experts.dtype, np.integer):
                raise TypeError(f"routed_experts: expected integer ids, got {experts.dtype}")
            if experts.size and int(experts.min()) < -1:
                raise ValueError("routed_experts: expected expert ids >= 0 or -1 (unknown)")
            object.__setattr__(self, "routed_experts", experts.astype(np.int16, copy=False))

    @property
    def num_loss_tokens(self) -> int:
        """Number of tokens that train."""
        return sum(1 for m in self.loss_mask if m)


def samples_from_trajectories(
    trajectories: Sequence[Trajectory], token_advantages: Sequence[torch.Tensor | Sequence[float]]
) -> list[TrainSample]:
    """Turn trajectories and their per-token advantages into :class:`TrainSample` records.

    Args:
        trajectories: episodes (``tokens``, ``loss_mask``, ``logprobs``, ``versions`` and, for an
            MoE model, ``routed_experts`` when the engine recorded them).
        token_advantages: one advantage per token of each trajectory.

    Returns:
        One sample per trajectory, in order.
    """
    if len(trajectories) != len(token_advantages):
        raise ValueError(
            f"token_advantages: expected {len(trajectories)} entries, got {len(token_advantages)}"
        )
    out = []
    for traj, adv in zip(trajectories, token_advantages, strict=True):
        values = adv.tolist() if isinstance(adv, torch.Tensor) else list(adv)
        routed = getattr(traj, "routed_experts", None)  # MoE: the engine's routing record
        out.append(
            TrainSample(
                tokens=list(traj.tokens),
                loss_mask=list(traj.loss_mask),
                logprobs=list(traj.logprobs),
                versions=list(traj.versions),
                advantages=[float(v) for v in values],
                routed_experts=None if routed is None else routed.array(),
            )
        )
    return out


@dataclass(frozen=True, slots=True)
class PackedBatch:
    """One micro-batch: sequences packed into one row, plus where their trained tokens are.

    ``n`` below is the number of trained (loss-masked) tokens in the micro-batch; they are
    ordered by sequence, then by position.
    """

    input_ids: torch.Tensor  # (1, N) long
    position_ids: torch.Tensor  # (1, N) long, restarting at 0 per sequence
    attention_mask: torch.Tensor | None  # (1, 1, N, N) or None (see module docstring)
    pred_index: torch.Tensor  # (n,) row position whose hidden state predicts each target
    targets: torch.Tensor  # (n,) the sampled token ids
    seq_index: torch.Tensor  # (n,) which sequence of the micro-batch each target is in
    col_index: torch.Tensor  # (n,) rank of the target among its sequence's targets
    num_seqs: int
    width: int  # max number of targets in one sequence (at least 1)
    lengths: tuple[int, ...] = ()  # token count of each packed sequence

    @property
    def num_tokens(self) -> int:
        """Number of tokens in the packed row (prompt and observation tokens included)."""
        return int(self.input_ids.shape[1])

    def to_padded(self, values: torch.Tensor) -> torch.Tensor:
        """Spread per-target ``values`` (n,) into a ``(num_seqs, width)`` tensor, zeros elsewhere.

        Differentiable; only trained tokens are kept, so a row holds one sequence's trained
        tokens in order, which is all a sequence-aggregated loss needs.
        """
        out = values.new_zeros(self.num_seqs, self.width)
        return out.index_put((self.seq_index, self.col_index), values)

    def sequence_means(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sequence's mean of per-target ``values`` (n,), and its target count; ``(S,)``.

        A sequence with no target has mean 0.
        """
        sums = values.new_zeros(self.num_seqs).index_add(0, self.seq_index, values)
        counts = torch.zeros_like(sums).index_add(0, self.seq_index, torch.ones_like(values))
        return sums / counts.clamp(min=1), counts

    def padded_mask(self) -> torch.Tensor:
        """The ``(num_seqs, width)`` float mask of :meth:`to_padded`'s filled entries."""
        ones = torch.ones(self.targets.shape[0], device=self.targets.device)
        return self.to_padded(ones)


def pack_sequences(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Group sequences into micro-batches of at most ``budget`` tokens (first-fit decreasing).

    A sequence longer than the budget gets a micro-batch of its own. Deterministic: ties keep
    the input order.

    Args:
        lengths: token count of each sequence.
        budget: token budget of a micro-batch.

    Returns:
        Lists of indices into ``lengths``, one list per micro-batch.
    """
    if budget < 1:
        raise ValueError(f"budget: expected >= 1, got {budget}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    used: list[int] = []
    for i in order:
        for b, total in enumerate(used):
            if total + lengths[i] <= budget:
                bins[b].append(i)
                used[b] += lengths[i]
                break
        else:
            bins.append([i])
            used.append(lengths[i])
    return [sorted(b) for b in bins]


def _flat(seqs: Sequence[Sequence[Any]], dtype: type, count: int) -> torch.Tensor:
    """The concatenation of ``seqs`` as one host tensor (numpy reads lists 4x faster)."""
    return torch.from_numpy(np.fromiter(chain.from_iterable(seqs), dtype=dtype, count=count))


def document_causal_mask(
    lengths: Sequence[int], attn_implementation: str, device: torch.device
) -> torch.Tensor | None:
    """The attention mask for a row packing sequences of ``lengths``, or ``None``.

    ``None`` when one sequence fills the row (plain causal attention) or when the attention
    implementation reads sequence borders from ``position_ids``. Otherwise ``(1, 1, N, N)``:
    boolean (True = attend) for ``sdpa``, additive float32 for ``eager``.
    """
    if len(lengths) <= 1 or attn_implementation not in _MASKED_ATTENTION:
        return None
    doc = torch.repeat_interleave(
        torch.arange(len(lengths), device=device), to_device(torch.tensor(list(lengths)), device)
    )  # (N,)
    n = doc.shape[0]
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    allowed = (doc[:, None] == doc[None, :]) & causal  # (N, N)
    if attn_implementation == "eager":
        neg = torch.finfo(torch.float32).min
        zero = torch.zeros((), device=device)
        return torch.where(allowed, zero, neg)[None, None]
    return allowed[None, None]


def build_packed_batch(
    tokens: Sequence[Sequence[int]],
    loss_masks: Sequence[Sequence[int]],
    *,
    attn_implementation: str,
    device: torch.device,
) -> PackedBatch:
    """Pack sequences into one row and index their trained tokens.

    Args:
        tokens: token ids of each sequence.
        loss_masks: 1 where a token trains, per sequence (same lengths as ``tokens``). The first
            token of a sequence has no prediction and must be 0.
        attn_implementation: the model's ``config._attn_implementation``.
        device: where the tensors go.

    Returns:
        The packed micro-batch.
    """
    lengths = [len(t) for t in tokens]
    if len(loss_masks) != len(tokens):
        raise ValueError(f"loss_masks: expected {len(tokens)} entries, got {len(loss_masks)}")
    if any(len(m) != n for m, n in zip(loss_masks, lengths, strict=True)):
        raise ValueError("loss_masks: expected one entry per token of each sequence")
    # vectorised on the host: this runs for every micro-batch while the GPU may be idle
    flat = _flat(tokens, np.int64, sum(lengths))
    mask = _flat(loss_masks, np.bool_, sum(lengths))
    sizes = torch.tensor(lengths, dtype=torch.long)
    starts = torch.cumsum(sizes, 0) - sizes
    if bool(mask[starts[sizes > 0]].any()):
        raise ValueError("loss_mask: expected 0 for the first token (nothing predicts it)")
    doc = torch.repeat_interleave(torch.arange(len(lengths)), sizes)  # (N,) sequence of a token
    positions = torch.arange(flat.shape[0]) - starts[doc]
    where = mask.nonzero().squeeze(1)  # targets; never a sequence's first token
    seq = doc[where]
    counts = torch.bincount(seq, minlength=len(lengths))
    col = torch.arange(where.shape[0]) - (torch.cumsum(counts, 0) - counts)[seq]
    parts = [flat, positions, where - 1, flat[where], seq, col]
    ids, pos, pred, targets, seq_d, col_d = to_device(torch.cat(parts), device).split(
        [t.shape[0] for t in parts]
    )  # one copy
    return PackedBatch(
        input_ids=ids[None],
        position_ids=pos[None],
        attention_mask=document_causal_mask(lengths, attn_implementation, device),
        pred_index=pred,
        targets=targets,
        seq_index=seq_d,
        col_index=col_d,
        num_seqs=len(tokens),
        width=max(int(counts.max()) if len(lengths) else 0, 1),
        lengths=tuple(lengths),
    )


def masked_values(
    values: Sequence[Sequence[float]], loss_masks: Sequence[Sequence[int]], device: torch.device
) -> torch.Tensor:
    """Per-token ``values`` at the trained positions, in :class:`PackedBatch` target order."""
    total = sum(len(v) for v in values)
    mask = _flat(loss_masks, np.bool_, sum(len(m) for m in loss_masks))
    if total != mask.shape[0]:
        raise ValueError(f"values: expected {mask.shape[0]} entries in all, got {total}")
    flat = _flat(values, np.float32, total)
    return to_device(flat[mask], device)
