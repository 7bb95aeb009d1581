"""``agent_loop_gpu.py``'s synthetic agent workload: the env, its seeded long tails, the probes.

An episode (``bench-agent-v0``) has ``turns`` assistant turns. Each turn's response length, the
tool observation after it and the tool's latency are drawn from seeded lognormal distributions
clipped to set bounds (median and spread given), keyed by the task and the episode's place in
its group, so that every loop (synchronous, overlapped, the ceiling) runs the same episodes.
A turn's length is set through :meth:`~agentrl.env.Env.turn_max_new_tokens`; with
``rollout.ignore_eos`` the engine samples exactly that many tokens. Observations are random
lowercase words: one token a character with the tiny character tokenizer the benchmark uses
(other tokenizers pack several into a token). The latency is awaited (``asyncio.sleep``), as a
sandbox or web tool would be. The reward is ``_hash_env``'s hash of the final answer, so every
group has a signal. Importing this module registers the env.

Probes: :class:`Spans` records when generation, env waits, updates and pushes ran and splits a
window's wall time among them; :class:`HistoryClient` counts the history tokens each request
re-sends (what an earlier request of the same episode sent or received).
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import math
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

from _hash_env import hashed_reward

from agentrl.env import Env, StepResult, register, render_tool_response
from agentrl.types import Message, Task

Bounds = tuple[float, float, float]  # (low, high, median)

RESPONSE: Bounds = (64, 4096, 256)  # tokens a turn
OBSERVATION: Bounds = (64, 2048, 256)  # tokens a tool observation
LATENCY_S: Bounds = (0.01, 2.0, 0.1)  # seconds a tool call
SPREAD = 1.0  # lognormal sigma of the lengths: ~8% of turns over 4x the median
LATENCY_SPREAD = 1.2  # and of the latency: ~3% of calls over 10x the median

_ALPHABET = "abcdefghijklmnopqrstuvwxyz"


def long_tailed(rng: random.Random, bounds: Bounds, sigma: float) -> float:
    """One lognormal draw of median ``bounds[2]`` and spread ``sigma``, clipped to its bounds."""
    lo, hi, median = bounds
    return min(max(rng.lognormvariate(math.log(median), sigma), lo), hi)


@dataclass(frozen=True, slots=True)
class EpisodePlan:
    """One episode's draws: a response length per turn, an observation length and a latency
    after each turn (the last turn's latency is its scoring; it has no observation)."""

    responses: list[int]
    observations: list[int]
    latencies_s: list[float]
    prompt: str


@dataclass(frozen=True, slots=True)
class Workload:
    """The distributions of an episode (``env.kwargs`` of ``bench-agent-v0``)."""

    turns: int = 8
    response: Bounds = RESPONSE
    observation: Bounds = OBSERVATION
    latency_s: Bounds = LATENCY_S
    spread: float = SPREAD
    latency_spread: float = LATENCY_SPREAD
    prompt_tokens: int = 128
    group_size: int = 4
    seed: int = 0

    def plan(self, key: str) -> EpisodePlan:
        """The draws of the episode ``key`` (the same key, the same draws)."""
        digest = hashlib.blake2b(f"{self.seed}/{key}".encode(), digest_size=8).digest()
        rng = random.Random(int.from_bytes(digest, "little"))
        n = self.turns
        responses = [round(long_tailed(rng, self.response, self.spread)) for _ in range(n)]
        obs = [round(long_tailed(rng, self.observation, self.spread)) for _ in range(n - 1)]
        latencies = [long_tailed(rng, self.latency_s, self.latency_spread) for _ in range(n)]
        return EpisodePlan(responses, obs, latencies, words(rng, self.prompt_tokens))

    def kwargs(self) -> dict[str, Any]:
        """As ``env.kwargs`` (JSON)."""
        return asdict(self)


def words(rng: random.Random, n: int) -> str:
    """``n`` characters of random lowercase words (``n`` tokens with the character tokenizer)."""
    out = rng.choices(_ALPHABET, k=n)
    for i in range(5, n, 6):  # a space every sixth character: word-like text
        out[i] = " "
    return "".join(out)


# ----------------------------------------------------------------------------- probes


def _union(spans: Sequence[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


class Spans:
    """When each kind of work ran (``perf_counter`` intervals), from any thread.

    :meth:`split` partitions a window's wall time: each instant counts for the first kind of
    ``PRIORITY`` running then (the update overlaps generation in the overlapped loop: there it
    counts as update), ``idle`` when none ran (host work between them: batching, advantages,
    records, or nothing to do).
    """

    PRIORITY = ("push", "update", "generation", "env_wait")

    def __init__(self) -> None:
        self.spans: dict[str, list[tuple[float, float]]] = {k: [] for k in self.PRIORITY}
        self._open: dict[str, dict[int, float]] = {k: {} for k in self.PRIORITY}
        self._ids = iter(range(1 << 62))
        self._lock = threading.Lock()

    @contextmanager
    def span(self, kind: str) -> Iterator[None]:
        """Record the enclosed block as ``kind`` (still running blocks count at :meth:`split`)."""
        with self._lock:
            n = next(self._ids)
            self._open[kind][n] = time.perf_counter()
        try:
            yield
        finally:
            with self._lock:
                a = self._open[kind].pop(n)
                self.spans[kind].append((a, time.perf_counter()))

    def wrap(self, kind: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` (sync or async) recorded as ``kind`` on every call."""
        if inspect.iscoroutinefunction(fn):

            async def timed_async(*a: Any, **k: Any) -> Any:
                with self.span(kind):
                    return await fn(*a, **k)

            return timed_async

        def timed(*a: Any, **k: Any) -> Any:
            with self.span(kind):
                return fn(*a, **k)

        return timed

    def split(self, t0: float, t1: float) -> dict[str, float]:
        """Seconds of ``[t0, t1]`` by kind, exclusive (see the class docs), plus ``idle``."""
        now = time.perf_counter()
        with self._lock:
            by_kind = {
                k: [*v, *((a, now) for a in self._open[k].values())] for k, v in self.spans.items()
            }
        out: dict[str, float] = {}
        covered: list[tuple[float, float]] = []
        before = 0.0
        for kind in self.PRIORITY:
            covered += [(max(a, t0), min(b, t1)) for a, b in by_kind[kind] if b > t0 and a < t1]
            after = _union(covered)
            out[kind] = after - before
            before = after
        out["idle"] = max(t1 - t0 - before, 0.0)
        return out

    def busy(self, kind: str, t0: float, t1: float) -> float:
        """Seconds of ``[t0, t1]`` during which ``kind`` ran (overlaps with others counted)."""
        with self._lock:
            spans = [*self.spans[kind]]
        return _union([(max(a, t0), min(b, t1)) for a, b in spans if b > t0 and a < t1])

    def clear(self) -> None:
        """Forget the finished spans (between phases)."""
        with self._lock:
            for v in self.spans.values():
                v.clear()


class HistoryClient:
    """Wraps an inference client: counts the history tokens each request re-sends.

    A request's history is the part of its input that an earlier request of the same episode
    (``session_id``) sent or got back: the conversation so far, or a turn's prompt and partial
    output when it resumes after a weight push. Every ``generate`` is a ``generation`` span.
    Anything else is the wrapped client's (pause and continue as well).
    """

    def __init__(self, inner: Any, spans: Spans) -> None:
        self.inner, self.spans = inner, spans
        self._seen: dict[str, int] = {}  # session -> tokens it sent or got back so far
        self.counting = False
        self.resent = 0  # history tokens re-sent while counting
        self.resent_resumed = 0  # of those, by requests that resume a turn cut by a push
        self.sent = 0  # input tokens sent while counting

    async def generate(self, input_ids: list[int], params: Any, **kw: Any) -> Any:
        """The wrapped ``generate``, counted."""
        session = kw.get("session_id") or ""
        history = min(self._seen.get(session, 0), len(input_ids))
        if self.counting:
            self.sent += len(input_ids)
            self.resent += history
            self.resent_resumed += history if ".r" in str(kw.get("rid", "")) else 0
        with self.spans.span("generation"):
            out = await self.inner.generate(input_ids, params, **kw)
        self._seen[session] = len(input_ids) + len(out.output_ids)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


# ----------------------------------------------------------------------------- the env


class AgentEnv(Env):
    """``turns`` tool turns with set lengths and latencies (module docs); a hashed reward.

    Args:
        latency_scale: multiplies every latency (0: none, the ceiling's generation alone).
        spans: records each latency wait as ``env_wait``.
        **workload: the fields of :class:`Workload`.
    """

    def __init__(
        self, *, latency_scale: float = 1.0, spans: Spans | None = None, **workload: Any
    ) -> None:
        fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v  # (from JSON)
                                  for k, v in workload.items()}  # fmt: skip
        self.workload = Workload(**fields)
        self.latency_scale, self.spans = latency_scale, spans
        self.plan = EpisodePlan([], [], [], "")
        self.turn = 0
        self.rng = random.Random(0)

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[list[Message], dict]:
        """Draw the episode's plan; the task's prompt and random words (unique per episode)."""
        index = (seed or 0) % self.workload.group_size  # the episode's place in its group
        key = f"{task.id}/{index}"
        self.plan, self.turn = self.workload.plan(key), 0
        self.rng = random.Random(key)
        return [Message(role="user", content=f"{self.plan.prompt}\n{task.prompt}")], {}

    def turn_max_new_tokens(self, turn: int) -> int | None:
        """This turn's drawn response length."""
        return self.plan.responses[min(turn, len(self.plan.responses) - 1)]

    async def step(self, action: str) -> StepResult:
        """Wait the tool's latency; then its observation, or the reward after the last turn."""
        t, self.turn = self.turn, self.turn + 1
        wait = self.plan.latencies_s[t] * self.latency_scale
        if wait > 0:
            if self.spans is None:
                await asyncio.sleep(wait)
            else:
                with self.spans.span("env_wait"):
                    await asyncio.sleep(wait)
        if self.turn >= self.workload.turns:
            return StepResult(reward=hashed_reward(action), terminated=True)
        text = words(self.rng, self.plan.observations[t])
        return StepResult(observation=[render_tool_response(text)])

    @classmethod
    def sample_tasks(cls, n: int, *, seed: int = 0, split: str = "train") -> list[Task]:
        """Tasks named by their index (their draws follow from the name)."""
        return [Task(id=f"{split}-{seed}-{i}", prompt=f"Task {i}: use the tool, then answer.")
                for i in range(n)]  # fmt: skip


register("bench-agent-v0", AgentEnv)


@dataclass(slots=True)
class Drawn:
    """Summary of many episodes' draws (for the tests and the report)."""

    responses: list[int] = field(default_factory=list)
    observations: list[int] = field(default_factory=list)
    latencies_s: list[float] = field(default_factory=list)

    @classmethod
    def of(cls, workload: Workload, keys: Sequence[str]) -> Drawn:
        """Every draw of the episodes ``keys``."""
        out = cls()
        for key in keys:
            p = workload.plan(key)
            out.responses += p.responses
            out.observations += p.observations
            out.latencies_s += p.latencies_s
        return out
