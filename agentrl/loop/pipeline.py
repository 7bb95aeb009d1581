"""The overlapped training loop: rollouts for step k+1 are generated while step k trains.

``Trainer.run`` takes its steps from here when ``train.max_staleness >= 1`` (0: from the
synchronous loop). Either way each step is :meth:`Trainer.update` and the schedule after it is
:meth:`Trainer.after_step`; this module only decides which groups a step trains and when.

Design:

- **Continuous production.** Up to ``max_inflight_groups`` groups (G episodes of one task each;
  by default all that admission, below, allows: ``(S + 1) * B``) run at once; the moment one
  completes it goes to a FIFO buffer and the next task's group starts, so generation never
  waits for the slowest episode of a batch; a weight push, which raises the admission bound,
  starts the groups it admits at once (else, with equal-length episodes, whose groups all end
  together, the next step's groups would wait for the current ones and the engine would
  decode half the rows it may: 1.31x the loop's tokens/s on an H100 with both), as soon as
  rollouts are interrupted for it: their first requests wait (at the gate, or queued in
  the paused embedded engine) until the push is done, so they start during it. Tasks come
  from the trainer's seeded cursor and a task's episode seeds derive from its position in that
  stream, exactly as in the synchronous loop.
- **Batch assembly.** A step starts once the buffer holds ``tokens_per_step`` response tokens of
  complete groups (or ``tasks_per_step`` groups when no token budget is set) and no due group
  (below) is still running; it takes the due groups, then the oldest others up to the budget;
  episodes still running carry over to a later step. The learner runs in a worker thread, so
  the event loop keeps serving rollouts while it trains.
- **Partial rollouts.** After the update: ``rollout.interrupt()`` (in-flight requests come back
  with what they sampled), push weights as version ``v + 1``, ``rollout.release()``; every
  interrupted turn resumes from prompt + partial output on the new weights, and each token
  keeps the version that sampled it. The learner uses each token's recorded log-prob as its
  old log-prob, i.e. the true behaviour policy's.
- **Staleness rule (wait for due groups; nothing is dropped or restarted).** A group started
  while the engine served version ``u`` samples tokens of versions ``>= u`` only, so it may
  train at learner versions ``u .. u + max_staleness``. It is *due* at ``v = u + S``: the step
  at learner version ``v`` waits until every in-flight group started at ``<= v - S`` has
  finished and trains all of them (and the buffered ones started then), then fills up to the
  budget with the oldest other groups. By induction every group left
  after step ``v`` started at ``>= v + 1 - S``, so no batch ever holds a token older than
  ``max_staleness`` versions, and every started group is trained exactly once (or is still
  running or buffered when the loop stops). The price is learner idle time while a due
  straggler finishes (``pipeline/due_wait_s``); the server keeps generating meanwhile.
  Why not drop or restart (measured in ``benchmarks/partial_rollouts.py`` at
  ``max_staleness=1``): an episode 10-20x the median needs several steps' worth of decoding,
  so under "drop groups with too-old tokens" it is never trained (14 of 67 groups dropped,
  the trained episodes 38% shorter than the workload's mean: a length bias, plus the wasted
  decoding), and "restart it from scratch on fresh weights" would restart it forever for the
  same reason. Waiting trains every episode, at the workload's mean length, with the true
  behaviour log-probs. In ``make demo``'s recipe (one short turn, group budget) the steps
  never wait: 80 steps took 118 s against 166 s synchronously, to 0.96 held-out success
  against 0.92 (2 CPU cores).
- **Admission** (AReaL's bounded-staleness rollout controller). While version ``u`` is served,
  a group starts only if fewer than ``(S + 1) * B`` groups (``B = tasks_per_step``) were started
  beyond those taken by the steps before ``u``. With a group budget every step takes exactly
  ``B`` groups, the steps before ``u`` took ``(u - v0) * B`` (``v0``: the first version), so
  fewer than ``(v - v0 + 1) * B`` groups start at versions ``<= v - S``, of which
  ``(v - v0) * B`` were taken before step ``v``: the groups due at a step never exceed its
  batch. Without this the due groups inflate the batches (twice ``B`` in ``make demo``'s
  recipe). A token budget can need more groups than ``B``, so groups also start while the
  buffer holds less than a step's tokens (else a step could wait forever); a batch can then
  exceed its budget by due groups (``staleness/due_groups``).
- **Checkpoints** record the task cursor, which is past the groups in flight and in the buffer;
  a resumed run skips those tasks (a crash loses at most the episodes in flight).
- **Several ranks** (:mod:`agentrl.loop.ranks`): rank ``r`` of ``N`` runs the groups of the
  task stream's positions ``i % N == r`` on its own engine, with its share of the budget, of the
  admission bound and of ``max_inflight_groups``; each rank applies the staleness rule to its
  own groups, then the ranks' batches are gathered (in a worker thread, so that generation goes
  on meanwhile) into one batch in task order that every rank trains. Every rank's cursor (in its
  checkpoint) is past its own groups.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from agentrl.env import Env
from agentrl.rollout import RolloutEngine, rollout_metrics
from agentrl.types import Group, Task

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Ready:
    """A complete group in the buffer."""

    index: int  # position in the task stream (the synchronous loop's task order)
    group: Group
    tokens: int  # response tokens of its non-failed episodes
    oldest: int | None  # oldest version that sampled one of those tokens (None: none sampled)
    start: int  # the version the engine served when the group started (<= every token's)


def _ready(index: int, group: Group, start: int) -> _Ready:
    versions = [
        v
        for t in group.trajectories
        if not t.failed
        for m, v in zip(t.loss_mask, t.versions, strict=True)
        if m
    ]
    oldest = min(versions) if versions else None
    assert oldest is None or oldest >= start, (oldest, start)
    return _Ready(index, group, len(versions), oldest, start)


@dataclass(slots=True)
class PipelineStats:
    """Where the groups the pipeline started went; ``started`` is the sum of the others."""

    started: int = 0
    trained: int = 0
    """Taken into a step's batch (including groups that carried no signal)."""
    due: int = 0
    """Of those, trained at the last version the staleness window allowed."""
    unfinished: int = 0
    """Still running or buffered when the pipeline stopped."""


def staleness_metrics(
    groups: Sequence[Group], version: int, max_staleness: int
) -> dict[str, float]:
    """Per-batch staleness figures for a learner at ``version`` (``staleness/...``).

    ``hist_s`` is the fraction of sampled tokens that are ``s`` versions older than the learner
    (``s = 0 .. max_staleness``); ``old_token_frac`` the fraction with ``s > 0``.
    """
    trajs = [t for g in groups for t in g.trajectories if not t.failed]
    ages = [version - v for t in trajs for m, v in zip(t.loss_mask, t.versions, strict=True) if m]
    n = max(len(ages), 1)
    out = {
        "staleness/version_spread": float(max(ages) - min(ages)) if ages else 0.0,
        "staleness/max": float(max(ages, default=0)),
        "staleness/old_token_frac": sum(a > 0 for a in ages) / n,
        "staleness/interrupted_episodes": float(
            sum(t.info.get("interruptions", 0) > 0 for t in trajs)
        ),
        "staleness/resumed_episodes": float(sum(t.info.get("resumes", 0) > 0 for t in trajs)),
    }
    for s in range(max_staleness + 1):
        out[f"staleness/hist_{s}"] = sum(a == s for a in ages) / n
    return out


class Host(Protocol):
    """What the pipeline needs of its trainer (:class:`~agentrl.loop.trainer.Trainer`)."""

    config: Any
    step: int
    cursor: int
    rollout: RolloutEngine
    ranks: Any  # agentrl.loop.ranks.Ranks

    def next_tasks(self) -> list[Task]: ...  # noqa: D102

    def make_env(self) -> Env: ...  # noqa: D102

    async def sync_weights(self) -> float: ...  # noqa: D102

    async def update(  # noqa: D102
        self,
        groups: list[Group],
        metrics: dict[str, float] | None = None,
        *,
        overlapped: bool = False,
        on_next_version: Callable[[], None] | None = None,
    ) -> dict[str, float]: ...


class Pipeline:
    """Overlapped rollouts and training for a trainer.

    Args:
        trainer: supplies the tasks, the rollout engine, the update and the weight sync; its
            ``config.train`` sets ``max_staleness`` (at least 1), ``tokens_per_step``,
            ``tasks_per_step`` and ``max_inflight_groups``.

    Raises:
        ValueError: ``max_staleness`` is 0 (that is the synchronous loop).
    """

    def __init__(self, trainer: Host) -> None:
        cfg = trainer.config.train
        if cfg.max_staleness < 1:
            raise ValueError(f"max_staleness: expected >= 1, got {cfg.max_staleness}")
        self.trainer = trainer
        self.ranks = trainer.ranks
        rank, n = self.ranks.rank, self.ranks.world_size

        def share(total: int) -> int:  # this rank's part of a total over positions 0..total-1
            return len(range(rank, total, n))

        self.max_staleness = cfg.max_staleness
        self.tokens_per_step = None if cfg.tokens_per_step is None else -(-cfg.tokens_per_step // n)
        budget = self.tokens_per_step or share(cfg.tasks_per_step)
        self._budget = budget  # in tokens, or in groups without a token budget
        self._admit = (cfg.max_staleness + 1) * share(cfg.tasks_per_step)  # see "Admission"
        # by default as many as admission allows
        cap = cfg.max_inflight_groups
        self.max_inflight = share(cap) if cap else self._admit
        self._taken_before_served = 0  # groups taken by the steps before the served version
        self.stats = PipelineStats()
        self._tasks: deque[tuple[int, Task]] = deque()
        self._buffer: deque[_Ready] = deque()
        self._inflight: dict[int, asyncio.Task[None]] = {}
        self._started_at: dict[int, int] = {}  # in-flight group -> version served at its start
        self._served = trainer.step  # the version the engine serves (after the first sync)
        self._arrived = asyncio.Event()
        self._done_tokens = 0  # response tokens of every group finished so far
        self._failure: BaseException | None = None
        self._closing = False

    async def steps(self) -> AsyncGenerator[dict[str, float], None]:
        """Run the loop, yielding each step's metrics once its new weights are live.

        Runs until closed (use ``contextlib.aclosing``); closing stops generation at once.
        """
        await self.trainer.sync_weights()  # the engine serves exactly the learner's version
        self._fill()
        try:
            while True:
                yield await self._step()
        finally:
            await self._shutdown()

    # ------------------------------------------------------------------ production

    def _next_task(self) -> tuple[int, Task]:
        while True:
            if not self._tasks:
                start = self.trainer.cursor
                tasks = self.trainer.next_tasks()
                self._tasks.extend(zip(range(start, start + len(tasks)), tasks, strict=True))
            index, task = self._tasks.popleft()
            if index % self.ranks.world_size == self.ranks.rank:  # the others' are theirs
                return index, task

    def _buffered(self) -> int:
        if self.tokens_per_step is None:
            return len(self._buffer)
        return sum(r.tokens for r in self._buffer)

    def _fill(self) -> None:
        """Start groups while there is room (in flight and in the buffer)."""
        while (
            not self._closing
            and len(self._inflight) < self.max_inflight
            and (
                self.stats.started - self._taken_before_served < self._admit
                # a token budget may need more groups than that: never let a step starve
                or (self.tokens_per_step is not None and self._buffered() < self._budget)
            )
        ):
            index, task = self._next_task()
            self.stats.started += 1
            self._started_at[index] = self._served
            self._inflight[index] = asyncio.create_task(self._run_group(index, task))

    async def _run_group(self, index: int, task: Task) -> None:
        t = self.trainer
        try:
            (group,) = await t.rollout.run_groups(
                t.make_env, [task], env_id=t.config.env.id, seed_offset=index
            )
        except Exception as e:  # episodes record their own errors: this is a bug, stop
            self._failure = e
        else:
            self._buffer.append(ready := _ready(index, group, self._started_at.pop(index)))
            if (teacher := getattr(t, "teacher", None)) is not None:
                teacher.prefetch(group)  # scored while the others generate
            self._done_tokens += ready.tokens
            del self._inflight[index]
            self._fill()
        self._arrived.set()

    # ------------------------------------------------------------------ consumption

    async def _next_batch(self) -> tuple[list[_Ready], float]:
        """Wait for the due groups and a step's budget; returns the batch and the due wait.

        The batch is every due group (started at ``<= step - max_staleness``) plus the oldest
        others up to the budget. The due wait is the time spent waiting while a due group was
        still running (the price of the staleness rule).
        """
        floor = self.trainer.step - self.max_staleness
        due_wait = 0.0
        while True:
            if self._failure is not None:
                raise self._failure
            running_due = any(v <= floor for v in self._started_at.values())
            if self._buffered() >= self._budget and not running_due:
                break
            self._arrived.clear()
            t = time.perf_counter()
            await self._arrived.wait()
            due_wait += (time.perf_counter() - t) if running_due else 0.0
        batch = [r for r in self._buffer if r.start <= floor]
        rest = deque(r for r in self._buffer if r.start > floor)
        taken = sum(1 if self.tokens_per_step is None else r.tokens for r in batch)
        while rest and taken < self._budget:
            r = rest.popleft()
            batch.append(r)
            taken += 1 if self.tokens_per_step is None else r.tokens
        self._buffer = rest
        for r in batch:  # the invariant the rule keeps (see the module docstring)
            assert r.oldest is None or r.oldest >= floor, (r.index, r.oldest, floor)
        self.stats.trained += len(batch)
        self.stats.due += sum(r.start <= floor for r in batch)
        self._fill()
        return batch, due_wait

    async def _step(self) -> dict[str, float]:
        t = self.trainer
        t0 = time.perf_counter()
        inflight = len(self._inflight)
        batch, due_wait = await self._next_batch()
        buffered = len(self._buffer)
        if self.ranks.world_size > 1:  # every rank trains every rank's groups
            parts = await asyncio.to_thread(
                self.ranks.all_gather, (batch, due_wait, inflight, buffered)
            )
            batch = [r for p in parts for r in p[0]]
            due_wait = max(p[1] for p in parts)
            inflight, buffered = sum(p[2] for p in parts), sum(p[3] for p in parts)
        batch.sort(key=lambda r: r.index)  # task order
        t_wait = time.perf_counter() - t0
        groups = [r.group for r in batch]
        metrics = rollout_metrics(groups, success_threshold=t.config.rollout.success_threshold)
        metrics.update(staleness_metrics(groups, t.step, self.max_staleness))
        metrics["staleness/due_groups"] = float(
            sum(r.start <= t.step - self.max_staleness for r in batch)
        )
        metrics["pipeline/due_wait_s"] = due_wait
        metrics["rollout/response_tokens"] = float(sum(r.tokens for r in batch))
        metrics["pipeline/inflight_groups"] = float(inflight)  # when the step began to wait
        metrics["pipeline/buffered_groups"] = float(buffered)  # left after taking
        done_before = self._done_tokens
        metrics = await t.update(
            groups, metrics, overlapped=True, on_next_version=self._next_version
        )
        # generation went on during the update: the response tokens of groups that finished
        metrics["pipeline/overlap_tokens"] = float(self._done_tokens - done_before)
        metrics["time/wait_s"] = t_wait
        metrics["time/step_s"] = time.perf_counter() - t0
        return metrics

    def _next_version(self) -> None:
        # groups started from now on generate on the weights being pushed (rollouts are
        # interrupted: their first requests wait at the gate or in the paused engine's queue, so
        # the episodes start during the push instead of after it while the engine idles)
        self._served, self._taken_before_served = self.trainer.step, self.stats.trained
        self._fill()  # the new version admits more: start them now, not when a group ends

    async def _shutdown(self) -> None:
        self._closing = True
        pending = list(self._inflight.values())
        try:
            await self.trainer.rollout.interrupt()  # stop generating at once
        finally:
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            await self.trainer.rollout.release()
        # cancelled groups stay in _inflight; one that finished meanwhile moved to the buffer
        self.stats.unfinished = len(self._inflight) + len(self._buffer)
        self._inflight.clear()
        self._started_at.clear()
        self._buffer.clear()
