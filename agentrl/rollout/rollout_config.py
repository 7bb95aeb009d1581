"""How episodes are run: :class:`RolloutConfig`, the ``[rollout]`` section of a config."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from agentrl.inference.base import SamplingParams


class RolloutConfig(BaseModel):
    """How episodes are run."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    group_size: int = Field(8, ge=1)
    """Episodes per task (G); advantages are normalised within a group."""
    max_turns: int = Field(4, ge=1)
    """Assistant turns per episode; more ends the episode as truncated."""
    max_new_tokens: int = Field(128, ge=1)
    """Tokens sampled per assistant turn."""
    max_total_tokens: int = Field(1024, ge=2)
    """Context budget: prompt + every turn; reaching it truncates the episode."""
    concurrency: int = Field(256, ge=1)
    """Episodes in flight at once."""
    episode_timeout_s: float = Field(600.0, gt=0)
    """Wall time per episode; exceeding it fails the episode (finish reason ``timeout``, failure
    cause ``timeout``: it counts in ``rollout/failed``)."""
    env_timeout_s: float | None = Field(60.0, gt=0)
    """Wall time of one env call (``reset``, ``step`` or ``close``, sync or async); exceeding it
    fails the episode with cause ``timeout``. ``None``: only the episode timeout applies. A sync
    call past it is abandoned (see ``env_threads``); an async call that blocks the event loop
    past it (plus 1 s) stops the process with an error naming it (it cannot be preempted)."""
    env_threads: int = Field(64, ge=1)
    """Threads that run synchronous env code (``SyncEnv``, sync tools) at once. A call past the
    env timeout fails its episode and leaves its thread stuck (a thread cannot be killed): a
    fresh one takes its place; when this many are stuck, the run stops with an error naming
    the calls that hang."""
    max_observation_tokens: int = Field(8192, ge=1)
    """Longest env observation (one step's messages with their template markup, in tokens); a
    longer one truncates the episode (finish reason ``observation_too_long``, the env named in
    ``info``). Text over 8 characters per token of it is cut before it is tokenised."""
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature (0: greedy); the learner's follows it."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass (1: off)."""
    top_k: int = -1
    """Sample among the k likeliest tokens (-1: off)."""
    seed: int | None = 0
    """Base of per-request sampling seeds (reproducible runs); ``None`` for unseeded sampling."""
    success_threshold: float = 1.0
    """An episode whose final reward reaches this counts as a success."""
    ignore_eos: bool = False
    """Sample past EOS until ``max_new_tokens`` (fixed-length turns, for benchmarks and tests)."""
    return_routed_experts: bool | None = None
    """Record the experts an MoE policy routed every token to (``Trajectory.routed_experts``).
    ``None``: on when the embedded engine records routing (an MoE model); ``True`` needs a
    server that returns them (``--enable-return-routed-experts`` on SGLang or ``agentrl serve``)."""
    interrupt_mode: Literal["abort", "retract", "in_place"] = "abort"
    """How a weight push (overlapped loop) interrupts the turns in flight, as the server's pause
    mode: ``abort``, they return what they sampled and resume from prompt + partial output, their
    cache recomputed by the new weights; ``retract``, they stay open and the engine recomputes
    their cache on resume (the same numbers, no round trip through the episodes); ``in_place``,
    they stay open with the cache the old weights computed: nothing recomputed (cheapest), but
    the new tokens' log-probs see a prefix encoded by the old weights (counted in
    ``mismatch/numeric_*``: 1.3e-2 vs 1.8e-7 on average in ``benchmarks/interrupt_modes.py``'s
    CPU run). A client that cannot pause supports ``abort`` only."""

    def sampling(self) -> SamplingParams:
        """The per-turn sampling parameters (``max_new_tokens`` is lowered near the budget)."""
        return SamplingParams(
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            ignore_eos=self.ignore_eos,
        )
