"""Group advantages and per-token advantage shaping.

Advantages are pure functions of a :class:`~agentrl.types.Group`. Two layers:

1. :func:`group_advantages` normalises final rewards within each group of G:
   ``A_i = (r_i - mean(r)) / (std(r) + eps)``. The std is the **population** std (divide by G,
   not G-1): every group's advantages then have RMS ``std / (std + eps) ≈ 1`` whatever G is, a
   binary group with one success in two gets exactly ±1, and G = 1 is defined (zero, not NaN).
   A group whose rewards are all equal gets exactly zero and is counted as carrying no signal.

2. :func:`compute_token_advantages` starts every sampled token of trajectory i from ``A_i``
   (plain GSPO) and adds the **per-token adjustments** of a list of shapers. A shaper is a small
   frozen pydantic model (so it is also its own config spec) whose ``__call__(group, A)`` returns
   one float64 tensor per trajectory, ``len(trajectory.tokens)`` long. Adjustments are summed and
   every token whose ``loss_mask`` is 0 is zeroed, so the shapers' order does not matter. The
   result feeds ``gspo_token_loss`` (or ``grpo_loss``), where token t of sequence i is pushed up
   with weight ``s_i A[i,t] / |y_i|``: an adjustment on a token changes that token's gradient only.

Shapers by config name (:data:`SHAPERS`): ``discount``, ``turn_rewards``, ``overlong``,
``format``; :func:`build_shapers` builds them from specs such as
``{"name": "overlong", "max_tokens": 512, "cache": 128, "penalty": 1.0}``.

Failed episodes are not special-cased here: the caller decides whether they belong in a group.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Annotated, Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from agentrl.errors import ConfigError
from agentrl.types import Group, Trajectory

if TYPE_CHECKING:  # torch is imported where it is used: configs load without it
    import torch

__all__ = [
    "SHAPERS",
    "FormatPenalty",
    "GroupStats",
    "OverlongPenalty",
    "OutcomeDiscount",
    "Shaper",
    "ShaperModel",
    "ShaperSpec",
    "TurnRewardAdvantage",
    "build_shapers",
    "compute_token_advantages",
    "group_advantages",
]

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# group normalisation


@dataclass(frozen=True, slots=True)
class GroupStats:
    """Diagnostics of :func:`group_advantages` (python numbers)."""

    num_groups: int
    zero_signal_groups: int
    """Groups whose rewards are all equal: zero advantages, no gradient."""
    reward_mean: float
    reward_std: float
    """Mean over groups of the within-group population std."""

    def to_metrics(self, prefix: str = "adv") -> dict[str, float]:
        """Namespaced metric keys, plus ``{prefix}/zero_signal_frac``."""
        out = {f"{prefix}/{f.name}": float(getattr(self, f.name)) for f in fields(self)}
        out[f"{prefix}/zero_signal_frac"] = self.zero_signal_groups / max(self.num_groups, 1)
        return out


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> tuple[torch.Tensor, GroupStats]:
    """Normalise rewards within each group: ``(r - mean) / (std + eps)``, population std.

    Args:
        rewards: ``(G,)`` for one group or ``(N, G)`` for N groups, finite.
        eps: added to the std; keeps near-equal groups from being blown up.

    Returns:
        Advantages of the same shape (float dtype of ``rewards``, float32 for integer input;
        computed in float64) and :class:`GroupStats`. All-equal groups get exactly 0.

    Raises:
        ValueError: bad shape, empty group, non-finite rewards or negative ``eps``.
    """
    import torch

    if rewards.dim() not in (1, 2) or rewards.shape[-1] == 0:
        raise ValueError(f"rewards: expected a (G,) or (N, G) tensor, got {tuple(rewards.shape)}")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards: expected finite values, got NaN or inf")
    if eps < 0:
        raise ValueError(f"eps: expected >= 0, got {eps}")
    r = rewards.detach().to(torch.float64)
    r2 = r if r.dim() == 2 else r[None, :]  # (N, G)
    mean = r2.mean(dim=-1, keepdim=True)
    std = r2.std(dim=-1, correction=0, keepdim=True)
    flat = r2.amax(dim=-1, keepdim=True) == r2.amin(dim=-1, keepdim=True)  # (N, 1)
    denom = (std + eps).clamp(min=torch.finfo(torch.float64).tiny)  # eps = 0 on a flat group
    adv = torch.where(flat, 0.0, (r2 - mean) / denom)
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    stats = GroupStats(
        num_groups=r2.shape[0],
        zero_signal_groups=int(flat.sum()),
        reward_mean=float(r2.mean()),
        reward_std=float(std.mean()),
    )
    return adv.reshape(rewards.shape).to(out_dtype), stats


# ---------------------------------------------------------------------------------------------
# shapers


class Shaper(Protocol):
    """Maps a group to additive per-token adjustments, one float tensor per trajectory."""

    def __call__(self, group: Group, advantages: torch.Tensor, /) -> list[torch.Tensor]:
        """Adjustments for each trajectory of ``group`` (any function of this shape will do).

        Args:
            group: the G trajectories of one task.
            advantages: ``(G,)`` float64, the group's outcome advantages ``A_i``.

        Returns:
            One tensor of ``len(trajectory.tokens)`` adjustments per trajectory.
        """
        ...


class ShaperModel(BaseModel, ABC):
    """Base of the built-in shapers: a frozen pydantic model that is its own config spec.

    Subclass it, give it a ``name`` field with a ``Literal`` default and a ``__call__``, and add
    it to :data:`SHAPERS` to make it selectable from config.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)
    name: str

    @abstractmethod
    def __call__(self, group: Group, advantages: torch.Tensor) -> list[torch.Tensor]:
        """See :class:`Shaper`."""


def _assistant_turns(traj: Trajectory) -> list[tuple[int, int]]:
    return [(t.start, t.end) for t in traj.turns if t.kind == "assistant"]


def _normalise(values: torch.Tensor, eps: float) -> torch.Tensor:
    """Population-std normalisation of a flat tensor; all-equal (or empty) gives zeros."""
    if values.numel() == 0:
        return values
    adv, _ = group_advantages(values, eps)
    return adv


class OutcomeDiscount(ShaperModel):
    """``discount``: the outcome advantage credited mostly to the last assistant turn.

    Scales ``A_i`` on assistant turn k of K (0-based) to ``gamma^(K-1-k) A_i`` (it adds
    ``(gamma^(K-1-k) - 1) A_i``); sampled tokens outside any assistant turn keep ``A_i``.
    Gradient: the outcome pushes the last turn fully and earlier turns less, so early
    exploration is praised or blamed less for an outcome decided later.
    """

    name: Literal["discount"] = "discount"
    gamma: float = Field(default=0.9, ge=0, le=1)
    """Discount per turn back from the last one."""

    def __call__(self, group: Group, advantages: torch.Tensor) -> list[torch.Tensor]:
        """Return ``(gamma^(K-1-k) - 1) A_i`` on the tokens of assistant turn k of trajectory i."""
        import torch

        out = []
        for traj, a in zip(group.trajectories, advantages.tolist(), strict=True):
            adj = torch.zeros(len(traj.tokens), dtype=torch.float64)
            spans = _assistant_turns(traj)
            for k, (start, end) in enumerate(spans):
                adj[start:end] = (self.gamma ** (len(spans) - 1 - k) - 1.0) * a
            out.append(adj)
        return out


class TurnRewardAdvantage(ShaperModel):
    """``turn_rewards``: per-turn rewards made into per-turn advantages.

    Each assistant turn k gets the return ``R_k = Σ_{j>=k} gamma^(j-k) r_j`` of the per-turn
    rewards (a ``None`` reward counts as 0; ``gamma = 0`` uses each turn's own reward). All the
    group's assistant turns are normalised together (population std; all equal gives 0) and
    ``coef`` times the result is added to that turn's tokens. Gradient: a turn that did better
    than the group's typical turn (a tool call that worked) is pushed up, locally, on top of
    the episode's outcome.
    """

    name: Literal["turn_rewards"] = "turn_rewards"
    coef: float = 1.0
    """Weight of the turn advantage relative to the outcome advantage."""
    gamma: float = Field(default=0.0, ge=0, le=1)
    """Discount of later turns' rewards into earlier turns' returns."""
    eps: float = Field(default=1e-6, ge=0)
    """Added to the std of the per-turn returns when they are normalised."""

    def __call__(self, group: Group, advantages: torch.Tensor) -> list[torch.Tensor]:
        """Return ``coef`` × normalised turn return on the tokens of each assistant turn."""
        import torch

        returns: list[list[float]] = []
        for traj in group.trajectories:
            rs = [r if r is not None else 0.0 for r in traj.turn_rewards]
            acc, rets = 0.0, []
            for r in reversed(rs):
                acc = r + self.gamma * acc
                rets.append(acc)
            returns.append(rets[::-1])
        flat = torch.tensor([r for rets in returns for r in rets], dtype=torch.float64)
        adv = iter(_normalise(flat, self.eps).tolist())
        out = []
        for traj, rets in zip(group.trajectories, returns, strict=True):
            adj = torch.zeros(len(traj.tokens), dtype=torch.float64)
            for (start, end), _ in zip(_assistant_turns(traj), rets, strict=True):
                adj[start:end] = self.coef * next(adv)
            out.append(adj)
        return out


class OverlongPenalty(ShaperModel):
    """``overlong``: DAPO's soft over-long punishment, added to every sampled token.

    With L the episode's length, the penalty is 0 up to ``max_tokens - cache``, grows linearly to
    ``-penalty`` at ``max_tokens`` and stays there beyond. Unlike DAPO it is added to the
    advantages (after group normalisation), not to the reward. Gradient: every token of an
    episode that ran into the end of its budget is pushed down, whatever its outcome, so the
    policy learns to finish within budget; episodes shorter than ``max_tokens - cache`` are
    untouched.
    """

    name: Literal["overlong"] = "overlong"
    max_tokens: int = Field(ge=1)
    """The length budget."""
    cache: int = Field(ge=0)
    """Width of the soft zone at the end of the budget (DAPO's L_cache)."""
    penalty: float = Field(default=1.0, ge=0)
    """Penalty at and beyond ``max_tokens``."""
    length: Literal["response", "total"] = "response"
    """``response``: count sampled tokens (loss mask 1); ``total``: every token of the episode."""

    @model_validator(mode="after")
    def _cache_fits(self) -> OverlongPenalty:
        if self.cache > self.max_tokens:
            raise ValueError(f"cache: expected <= max_tokens ({self.max_tokens}), got {self.cache}")
        return self

    def penalty_for(self, length: int) -> float:
        """The (non-positive) adjustment for an episode of ``length`` tokens."""
        start = self.max_tokens - self.cache
        if length <= start:
            return 0.0
        if length >= self.max_tokens:
            return -self.penalty
        return -self.penalty * (length - start) / self.cache

    def __call__(self, group: Group, advantages: torch.Tensor) -> list[torch.Tensor]:
        """Return the episode's penalty on every one of its tokens."""
        import torch

        out = []
        for traj in group.trajectories:
            n = traj.num_response_tokens if self.length == "response" else len(traj.tokens)
            out.append(torch.full((len(traj.tokens),), self.penalty_for(n), dtype=torch.float64))
        return out


class FormatPenalty(ShaperModel):
    """``format``: a penalty on the tokens of each malformed assistant turn.

    A turn is malformed when ``turn.info[key]`` is truthy (the env or verifier records it).
    Gradient: only the malformed turn's tokens are pushed down; the other turns of the same
    episode keep the outcome's push, so a good answer after a botched tool call is not blamed
    for it.
    """

    name: Literal["format"] = "format"
    penalty: float = Field(default=1.0, ge=0)
    """Subtracted from each token of a malformed turn."""
    key: str = "format_error"
    """The ``TurnSpan.info`` key that marks a malformed turn."""

    def __call__(self, group: Group, advantages: torch.Tensor) -> list[torch.Tensor]:
        """Return ``-penalty`` on the tokens of malformed assistant turns, 0 elsewhere."""
        import torch

        out = []
        for traj in group.trajectories:
            adj = torch.zeros(len(traj.tokens), dtype=torch.float64)
            for turn in traj.turns:
                if turn.kind == "assistant" and turn.info.get(self.key):
                    adj[turn.start : turn.end] -= self.penalty
            out.append(adj)
        return out


ShaperSpec = Annotated[
    OutcomeDiscount | TurnRewardAdvantage | OverlongPenalty | FormatPenalty,
    Field(discriminator="name"),
]
"""A built-in shaper spec for a pydantic config field: ``list[ShaperSpec]`` validates by name."""

SHAPERS: dict[str, type[ShaperModel]] = {
    "discount": OutcomeDiscount,
    "turn_rewards": TurnRewardAdvantage,
    "overlong": OverlongPenalty,
    "format": FormatPenalty,
}
"""Shaper classes by config name; add a :class:`ShaperModel` subclass here to register one."""


def build_shapers(specs: Sequence[Mapping[str, Any] | Shaper]) -> list[Shaper]:
    """Build shapers from config specs such as ``{"name": "format", "penalty": 0.5}``.

    Args:
        specs: mappings with a ``name`` from :data:`SHAPERS` and that shaper's fields, or
            shapers already built (passed through).

    Returns:
        The shapers, in order.

    Raises:
        ConfigError: unknown name, unknown field or invalid value.
    """
    shapers: list[Shaper] = []
    for i, spec in enumerate(specs):
        if not isinstance(spec, Mapping):
            shapers.append(spec)
            continue
        name = spec.get("name")
        if name not in SHAPERS:
            raise ConfigError(f"shapers[{i}].name: expected one of {sorted(SHAPERS)}, got {name!r}")
        try:
            shapers.append(SHAPERS[name].model_validate(dict(spec)))
        except ValidationError as e:
            raise ConfigError(f"shapers[{i}] ({name}): {e}") from e
    return shapers


def compute_token_advantages(
    group: Group,
    shapers: Sequence[Mapping[str, Any] | Shaper] = (),
    *,
    eps: float = 1e-6,
    extra: Sequence[torch.Tensor] = (),
) -> list[torch.Tensor]:
    """Per-token advantages of a group: outcome advantage plus the shapers' adjustments, masked.

    Every sampled token of trajectory i starts from its outcome advantage
    ``A_i = group_advantages(rewards, eps)[i]`` (plain GSPO when ``shapers`` is empty); each
    shaper then adds its adjustments. The sum does not depend on the shapers' order.

    Args:
        group: the G trajectories of one task.
        shapers: shapers or config specs (see :func:`build_shapers`).
        eps: added to the group's reward std.
        extra: per-token terms added too, one float tensor per trajectory (on-policy
            distillation's reverse KL: :mod:`agentrl.learner.distill`); empty: none.

    Returns:
        One float32 tensor per trajectory, ``len(trajectory.tokens)`` long, exactly 0 wherever
        ``loss_mask`` is 0.

    Raises:
        ConfigError: a spec does not validate.
        ValueError: a shaper returned the wrong number of tensors or a tensor of the wrong length.
    """
    import torch

    trajs = group.trajectories
    if not trajs:
        return []
    rewards = torch.tensor(group.rewards, dtype=torch.float64)
    outcome, _ = group_advantages(rewards, eps)  # (G,) float64
    total = [
        torch.full((len(t.tokens),), a, dtype=torch.float64)
        for t, a in zip(trajs, outcome.tolist(), strict=True)
    ]
    built = build_shapers(shapers)
    terms: list[Any] = [lambda g, a: list(extra)] if extra else []  # a shaper's checks apply
    for shaper in [*built, *terms]:
        adjs = shaper(group, outcome)
        if len(adjs) != len(trajs):
            raise ValueError(f"{shaper!r}: expected {len(trajs)} tensors, got {len(adjs)}")
        for i, (acc, adj) in enumerate(zip(total, adjs, strict=True)):
            if adj.shape != acc.shape:
                raise ValueError(
                    f"{shaper!r}: trajectory {i}: expected shape {tuple(acc.shape)}, "
                    f"got {tuple(adj.shape)}"
                )
            acc += adj.to(torch.float64)
    out = []
    for traj, acc in zip(trajs, total, strict=True):
        mask = torch.tensor(traj.loss_mask, dtype=torch.bool)
        out.append(torch.where(mask, acc, 0.0).to(torch.float32))
    logger.debug("token advantages for task %s with %d shapers", group.task.id, len(built))
    return out
