"""One episode's state, and the boundary between the rollout engine and an env.

Everything an env hands back is checked here before the engine uses it: ``reset`` must return
``(messages, info)`` and ``step`` a :class:`StepResult` whose observation is a list of well-formed
:class:`Message` objects, whose reward is a finite number, whose flags are booleans and whose
``info`` is a JSON-serialisable dict. Anything else is an :class:`EnvError` on that episode only,
as an exception raised by the env is, so one bad env never costs the batch.

Every env call (``reset``, ``step``, ``close``; synchronous envs run in a thread of
:mod:`~agentrl.rollout.env_pool`) runs under ``env_timeout_s`` besides the episode's own timeout;
a call that blocked the event loop past it fails too, once it returns (:mod:`~agentrl.rollout.
watchdog` reports one that does not). A failed episode carries its cause
(:data:`FAILURE_CAUSES`) in ``trajectory.info["failure"]``.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import traceback
from collections.abc import Awaitable
from dataclasses import dataclass, field
from numbers import Real
from typing import Any, Literal, TypeVar

import numpy as np
from pydantic import ValidationError

from agentrl.env import StepResult
from agentrl.errors import EnvError, ServerError
from agentrl.inference.base import GenerateOutput
from agentrl.rollout.env_pool import EnvThreadsStuck, take_abandoned
from agentrl.types import Message, RoutedExperts, Timing, Trajectory, TurnSpan

T = TypeVar("T")

FailureCause = Literal["timeout", "env", "server", "other"]
FAILURE_CAUSES: tuple[FailureCause, ...] = ("timeout", "env", "server", "other")
"""Why an episode failed: a timeout (the episode's or an env call's), the env (it raised or
returned something malformed), the inference server, or anything else."""


class EnvTimeout(TimeoutError):
    """An env call (``reset``/``step``/``close``) ran past ``env_timeout_s``.

    ``stack``: where a synchronous call was when its thread was abandoned (else empty).
    """

    def __init__(self, message: str, stack: str = "") -> None:
        super().__init__(message)
        self.stack = stack


class EnvRaised(EnvError):
    """An env call raised ``original``; the episode records the original exception."""

    def __init__(self, original: Exception) -> None:
        super().__init__(str(original))
        self.original = original


@dataclass(slots=True)
class EpisodeState:
    """Mutable state of one running episode (becomes a :class:`Trajectory` at the end)."""

    tokens: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: list[TurnSpan] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    prompt_len: int = 0
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    finish_reason: str = ""
    error: str | None = None
    failure: FailureCause | None = None
    traceback: str = ""
    """The failing exception's traceback (the trainer prints the first one of a run)."""
    interruptions: int = 0
    resumes: int = 0
    timing: Timing = field(default_factory=Timing)
    info: dict[str, Any] = field(default_factory=dict)
    """Extra entries of the trajectory's ``info`` (e.g. ``observation_too_long``)."""
    routing: np.ndarray | None = None
    """Routed experts of ``tokens`` so far (``rollout.return_routed_experts``), int16
    ``(rows, layers, top_k)``; see :meth:`add_routing`."""

    def add_routing(self, experts: np.ndarray) -> None:
        """Merge one generate call's routed experts (its rows start at token 0).

        Each call covers the whole conversation so far, so its rows extend the episode's. A row
        already recorded keeps its value unless it was never computed (``-1``): the row that
        predicted a sampled token stays the routing of the call that sampled it, even after a
        weight update (a resumed turn, or a later turn, recomputes earlier tokens).
        """
        if self.routing is None or len(self.routing) == 0:
            self.routing = experts.copy()
            return
        if experts.shape[1:] != self.routing.shape[1:]:
            raise ServerError(
                f"routed_experts: shape {experts.shape[1:]} changed from {self.routing.shape[1:]}"
            )
        n = min(len(self.routing), len(experts))
        merged = experts.copy() if len(experts) >= len(self.routing) else self.routing.copy()
        known = np.asarray((self.routing[:n] >= 0).all(axis=(1, 2)))
        merged[:n] = np.where(known[:, None, None], self.routing[:n], experts[:n])
        self.routing = merged

    @property
    def routed_rows(self) -> int:
        """Leading rows of :attr:`routing` that are known (computed by some call)."""
        if self.routing is None:
            return 0
        unknown = np.flatnonzero((self.routing < 0).any(axis=(1, 2)))
        return int(unknown[0]) if len(unknown) else len(self.routing)

    def append_observation(self, ids: list[int]) -> None:
        """Append env/tool tokens (loss mask 0, no log-prob, version -1)."""
        n = len(self.tokens)
        self.tokens += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)
        self.turns.append(TurnSpan(kind="observation", start=n, end=len(self.tokens)))

    def append_output(self, out: GenerateOutput) -> TurnSpan:
        """Append one assistant turn's sampled tokens; returns its span."""
        n = len(self.tokens)
        self.tokens += out.output_ids
        self.loss_mask += [1] * len(out.output_ids)
        self.logprobs += out.logprobs
        self.versions += out.versions
        span = TurnSpan(kind="assistant", start=n, end=len(self.tokens))
        self.turns.append(span)
        return span

    def fail(self, exc: BaseException, *, where: str = "") -> None:
        """Record ``exc`` as this episode's error (the first one wins)."""
        if self.error is not None:
            return
        cause = failure_cause(exc)
        shown = exc.original if isinstance(exc, EnvRaised) else exc
        self.error = f"{type(shown).__name__}{where}: {shown}"
        stack = getattr(shown, "stack", "")
        self.traceback = (  # where a stuck thread is, rather than where the wait ended
            f"The env call when it was abandoned (its thread is stuck):\n{stack}{self.error}\n"
            if stack
            else "".join(traceback.format_exception(shown))
        )
        self.failure = cause
        self.finish_reason = "timeout" if cause == "timeout" else "error"
        self.truncated = self.truncated or cause == "timeout"

    def trajectory(self, *, task_id: str, env_id: str, group_index: int) -> Trajectory:
        """The finished :class:`Trajectory` (a failed, empty one if the state cannot validate)."""
        info: dict[str, Any] = {
            **self.info,
            "interruptions": self.interruptions,
            "resumes": self.resumes,
        }
        if self.failure is not None:
            info["failure"] = self.failure
        if self.traceback:
            info["traceback"] = self.traceback
        fields: dict[str, Any] = dict(
            task_id=task_id,
            env_id=env_id,
            group_index=group_index,
            messages=self.messages,
            prompt_len=self.prompt_len,
            tokens=self.tokens,
            loss_mask=self.loss_mask,
            logprobs=self.logprobs,
            versions=self.versions,
            turns=self.turns,
            reward=self.reward,
            terminated=self.terminated,
            truncated=self.truncated,
            finish_reason=self.finish_reason,
            error=self.error,
            timing=self.timing,
            info=info,
            routed_experts=self._routed_experts(),
        )
        try:
            return Trajectory(**fields)
        except ValidationError as exc:  # defence in depth: the batch must survive any episode
            info["failure"] = self.failure or "other"
            return Trajectory(
                task_id=task_id,
                env_id=env_id,
                group_index=group_index,
                finish_reason="error",
                error=self.error or f"InvalidTrajectory: {exc.errors()[0]['msg']}",
                timing=self.timing,
                info=info,
            )

    def _routed_experts(self) -> RoutedExperts | None:
        """``routing`` aligned with ``tokens[:-1]``: tokens after the last call get ``-1`` rows."""
        if self.routing is None:
            return None
        rows = max(len(self.tokens) - 1, 0)
        out = np.full((rows, *self.routing.shape[1:]), -1, dtype=np.int16)
        n = min(rows, len(self.routing))
        out[:n] = self.routing[:n]
        return RoutedExperts.from_array(out)


def failure_cause(exc: BaseException) -> FailureCause:
    """The :data:`FAILURE_CAUSES` entry for an exception that ended an episode."""
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, ServerError):
        return "server"
    if isinstance(exc, EnvError):
        return "env"
    return "other"


async def env_call(what: str, call: Awaitable[T], timeout_s: float | None) -> T:
    """Await one env call under ``timeout_s``; an exception it raises becomes an env failure.

    A call that returns after ``timeout_s`` (it blocked the event loop, so the timeout could
    not fire) fails as well. The rollout watchdog finds a blocking call by this function's frame.

    Raises:
        EnvTimeout: past ``timeout_s``; for a synchronous call, naming where its thread is stuck.
        EnvThreadsStuck: too many synchronous calls are stuck (the run must stop).
    """
    t0 = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            out = await call
    except TimeoutError:
        message = f"env {what}() took longer than env_timeout_s={timeout_s}"
        stuck = take_abandoned()
        if stuck is None:
            raise EnvTimeout(message) from None
        name, where, stack = stuck
        raise EnvTimeout(f"{message}; its thread is stuck in {name}, at {where}", stack) from None
    except (EnvError, EnvThreadsStuck, asyncio.CancelledError):
        raise
    except Exception as exc:
        raise EnvRaised(exc) from exc
    took = time.monotonic() - t0
    if timeout_s is not None and took > timeout_s:
        raise EnvTimeout(
            f"env {what}() returned after {took:.1f} s, past env_timeout_s={timeout_s}: it "
            "blocked the event loop (an async env must await, never block)"
        )
    return out


def _message(value: Any, where: str) -> Message:
    raw = value.model_dump(warnings=False) if isinstance(value, Message) else value
    try:
        return Message.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        why = f"not a valid Message ({loc}: {first['msg']})"
        raise EnvError(f"{where}: {why}: {value!r:.200}") from None


def _messages(value: Any, where: str) -> list[Message]:
    if not isinstance(value, (list, tuple)):
        raise EnvError(f"{where}: expected a list of Message, got {type(value).__name__}")
    return [_message(m, f"{where}[{i}]") for i, m in enumerate(value)]


def _json_dict(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise EnvError(f"{where}: expected a dict, got {type(value).__name__}")
    try:
        json.dumps(value)
    except (TypeError, ValueError) as exc:
        raise EnvError(f"{where}: not JSON-serialisable ({exc})") from None
    return value


def checked_reset(out: Any) -> list[Message]:
    """The first messages of a ``reset`` return, validated (``(messages, info)``)."""
    if not isinstance(out, tuple) or len(out) != 2:
        raise EnvError(f"reset() returned {type(out).__name__}, expected (messages, info)")
    messages = _messages(out[0], "reset() messages")
    if not messages:
        raise EnvError("reset() returned no messages")
    return messages


def checked_step(result: Any) -> StepResult:
    """A well-formed copy of a ``step`` return, or :class:`EnvError` saying what is wrong."""
    if not isinstance(result, StepResult):
        raise EnvError(f"step() returned {type(result).__name__}, expected StepResult")
    reward = result.reward
    if not isinstance(reward, Real) or isinstance(reward, bool) or not math.isfinite(reward):
        raise EnvError(f"step() reward: expected a finite number, got {reward!r:.100}")
    flags = (result.terminated, result.truncated)
    if not all(f in (True, False) for f in flags):
        raise EnvError(f"step() terminated/truncated: expected booleans, got {flags!r:.100}")
    return StepResult(
        observation=_messages(result.observation, "step() observation"),
        reward=float(reward),
        terminated=bool(result.terminated),
        truncated=bool(result.truncated),
        info=_json_dict(result.info, "step() info"),
    )


def checked_turn_cap(value: Any, turn: int, limit: int) -> int:
    """A turn's token budget: ``Env.turn_max_new_tokens(turn)``'s ``value``, under ``limit``.

    Raises:
        EnvError: ``value`` is neither ``None`` nor an int >= 1.
    """
    if value is None:
        return limit
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise EnvError(
            f"turn_max_new_tokens({turn}) returned {value!r:.100}, expected an int >= 1 or None"
        )
    return min(value, limit)
