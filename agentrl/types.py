"""Data types that cross module boundaries: tasks, messages, trajectories, groups.

Pydantic is used here because these objects are saved (JSONL) and loaded back; models forbid
unknown fields so typos surface. A :class:`Trajectory` is token-in/token-out: ``tokens`` are
exactly the ids the engine was conditioned on and sampled, and every per-token list has the same
length as ``tokens``.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

Role = Literal["system", "user", "assistant", "tool"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class Message(_Model):
    """One chat message."""

    role: Role
    """Who speaks: ``system``, ``user``, ``assistant`` or ``tool``."""
    content: str
    """The text of the message."""


class Task(_Model):
    """One problem an environment is reset with."""

    id: str
    """Stable identifier, unique within a data set."""
    prompt: str
    """The question or statement shown to the agent."""
    answer: str | None = None
    """Reference answer, if the task has one (math)."""
    data: dict[str, Any] = Field(default_factory=dict)
    """Anything else the env or verifier needs (tests, entry point, ...)."""


class TurnSpan(_Model):
    """Which tokens of a trajectory belong to one turn: ``tokens[start:end]``."""

    kind: Literal["assistant", "observation"]
    """``assistant`` turns are sampled (loss mask 1); ``observation`` turns are env/tool tokens."""
    start: int
    end: int
    reward: float | None = None
    """Per-turn reward given by the env for this step (assistant turns only)."""
    info: dict[str, Any] = Field(default_factory=dict)
    """Diagnostics from the env for this step (tool errors, tests passed, ...)."""


class Timing(_Model):
    """Where an episode's wall time went, in seconds."""

    started_at: float = 0.0
    wall_s: float = 0.0
    generate_s: float = 0.0
    env_s: float = 0.0


class RoutedExperts(_Model):
    """The experts an MoE policy routed each token to, compactly (int16, base64).

    Row ``i`` holds, for every MoE layer, the ``top_k`` experts that token ``tokens[i]`` was
    routed to when it went through the engine (the last token is never fed back, so a
    trajectory of ``n`` tokens has ``n - 1`` rows, aligned with ``tokens[:-1]``); ``-1`` marks
    a row the engine never computed (observation tokens after the last turn). Use
    :meth:`array` and :meth:`from_array` rather than ``data``.
    """

    layers: int = Field(ge=1)
    """MoE layers (routers), in model order."""
    top_k: int = Field(ge=1)
    """Experts routed per token and layer."""
    data: str = ""
    """Base64 of the int16 little-endian array ``(rows, layers, top_k)``, flattened."""

    @model_validator(mode="after")
    def _whole_rows(self) -> RoutedExperts:
        try:
            size = len(base64.b64decode(self.data, validate=True))
        except (binascii.Error, ValueError) as exc:
            raise ValueError(f"data: expected base64, got {self.data[:40]!r} ({exc})") from None
        if size % (2 * self.layers * self.top_k):
            raise ValueError(
                f"data: {size} bytes are not whole rows of {self.layers} x {self.top_k} int16"
            )
        return self

    @property
    def rows(self) -> int:
        """Rows held (tokens routed)."""
        size = len(self.data) * 3 // 4 - self.data[-2:].count("=")
        return size // (2 * self.layers * self.top_k)

    def array(self) -> np.ndarray:
        """The experts, int16 ``(rows, layers, top_k)`` (a new, writable array)."""
        flat = np.frombuffer(base64.b64decode(self.data), dtype="<i2").astype(np.int16)
        return flat.reshape(-1, self.layers, self.top_k)

    @classmethod
    def from_array(cls, experts: Any) -> RoutedExperts:
        """Pack an integer array ``(rows, layers, top_k)`` of expert ids (``-1``: unknown)."""
        arr = np.asarray(experts)
        if arr.ndim != 3 or arr.shape[1] < 1 or arr.shape[2] < 1:
            raise ValueError(f"experts: expected shape (rows, layers, top_k), got {arr.shape}")
        if not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"experts: expected integer expert ids, got dtype {arr.dtype}")
        if arr.size and (arr.min() < -1 or arr.max() > np.iinfo(np.int16).max):
            raise ValueError(
                f"experts: expected ids in [-1, 32767], got [{arr.min()}, {arr.max()}]"
            )
        packed = np.ascontiguousarray(arr, dtype="<i2").tobytes()
        data = base64.b64encode(packed).decode("ascii")
        return cls(layers=int(arr.shape[1]), top_k=int(arr.shape[2]), data=data)


class Trajectory(_Model):
    """One episode: the token sequence, its per-token data, turns, rewards and outcome."""

    task_id: str
    env_id: str
    group_index: int = 0
    """Index of this episode inside its group of G."""
    messages: list[Message] = Field(default_factory=list)
    """The conversation as text (for people; training uses ``tokens``)."""
    prompt_len: int = 0
    """Number of prompt tokens at the start of ``tokens``."""
    tokens: list[int] = Field(default_factory=list)
    loss_mask: list[int] = Field(default_factory=list)
    """1 for tokens sampled by the policy, 0 for prompt/observation/tool tokens."""
    logprobs: list[float] = Field(default_factory=list)
    """Behaviour log-prob of each sampled token (0.0 where ``loss_mask`` is 0)."""
    versions: list[int] = Field(default_factory=list)
    """Weight version that sampled each token (-1 where ``loss_mask`` is 0)."""
    turns: list[TurnSpan] = Field(default_factory=list)
    reward: float = 0.0
    """Final (episode) reward."""
    terminated: bool = False
    """The env ended the episode (a natural end)."""
    truncated: bool = False
    """A budget ended the episode (turns, tokens, time)."""
    finish_reason: str = ""
    """Why it ended: ``terminated``, ``env_truncated``, ``max_turns``, ``max_tokens`` (context
    budget), ``max_new_tokens`` (a turn cut by its budget, see ``Env.sees_cut_turns``),
    ``timeout`` or ``error``."""
    error: str | None = None
    """``"Type: message"`` of the exception that failed this episode, else ``None``."""
    timing: Timing = Field(default_factory=Timing)
    info: dict[str, Any] = Field(default_factory=dict)
    routed_experts: RoutedExperts | None = None
    """MoE policies: the experts the engine routed each token to, one row per token of
    ``tokens[:-1]`` (``rollout.return_routed_experts``); ``None`` otherwise."""

    @model_validator(mode="after")
    def _aligned(self) -> Trajectory:
        n = len(self.tokens)
        for name in ("loss_mask", "logprobs", "versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"{name}: expected {n} entries (one per token), got {len(getattr(self, name))}"
                )
        if self.routed_experts is not None and self.routed_experts.rows != max(n - 1, 0):
            raise ValueError(
                f"routed_experts: expected {max(n - 1, 0)} rows (one per token but the last), "
                f"got {self.routed_experts.rows}"
            )
        return self

    @property
    def failed(self) -> bool:
        """Whether the episode ended in an error."""
        return self.error is not None

    @property
    def num_response_tokens(self) -> int:
        """Number of loss-masked (sampled) tokens."""
        return sum(self.loss_mask)

    @property
    def turn_rewards(self) -> list[float | None]:
        """Per-turn rewards of the assistant turns, in order."""
        return [t.reward for t in self.turns if t.kind == "assistant"]

    @property
    def tool_calls(self) -> int:
        """Tool calls made in the episode (the ``tool_calls`` that tool envs put in turn info)."""
        return sum(int(t.info.get("tool_calls", 0)) for t in self.turns if t.kind == "assistant")


class Group(_Model):
    """The G episodes of one task; advantages are computed within a group."""

    task: Task
    trajectories: list[Trajectory]

    @property
    def rewards(self) -> list[float]:
        """Final reward of each episode."""
        return [t.reward for t in self.trajectories]
