"""The RL loop: rollouts -> advantages -> GSPO-token update -> weight sync, with checkpoints.

One step: take the next tasks (a seeded, per-epoch shuffled cursor), run G episodes each, turn
rewards into per-token advantages, update the policy on the engine's log-probs, push the new
weights to the engine (in process, or over HTTP via a safetensors checkpoint), then log. Every
step appends one JSON object to ``metrics.jsonl``; trained-on trajectories go to
``trajectories.jsonl`` with the advantages and trainer log-probs the update saw. Checkpoints hold
model, optimiser, RNG states, step and data cursor, so ``resume`` continues exactly. The parts
the trainer runs (policy, learner, engine or client, weight push...) are made before it, by
:func:`agentrl.loop.assemble.assemble`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from pathlib import Path
from typing import Any

import torch
import yaml

from agentrl.config import TrainConfig
from agentrl.env import Env, make
from agentrl.inference.base import InferenceClient
from agentrl.learner import samples_from_trajectories
from agentrl.loop import ranks as dist_ranks
from agentrl.loop import stop
from agentrl.loop.assemble import RunParts, assemble
from agentrl.loop.atomic import append_bytes, disk_errors, replace_file
from agentrl.loop.cold_start import of_trainer as run_cold_start
from agentrl.loop.export_run import export_final
from agentrl.loop.health import RunHealth, write_records
from agentrl.loop.pipeline import Pipeline
from agentrl.loop.placement import (
    gil_switch_interval,
    on_side_stream,
    push_adapter,
    push_weights,
)
from agentrl.loop.resume import (
    cut_logs,
    finished_summary,
    read_checkpoint,
    rng_state,
    start_over,
    write_checkpoint,
)
from agentrl.loop.summary import summarise
from agentrl.loop.teacher import token_batch
from agentrl.pass_at_k import eval_metrics
from agentrl.rollout.engine import rollout_metrics
from agentrl.types import Group, Task, Trajectory

log = logging.getLogger(__name__)

EVAL_SEED_OFFSET = 1_000_003  # eval episodes never share seeds with training episodes


class Trainer:
    """Runs a :class:`TrainConfig` end to end and writes its run directory.

    The run's parts (run directory, policy, learner, engine or client, weight push, rollout
    engines, trackers) come from one :func:`~agentrl.loop.assemble.assemble`; the trainer holds
    the run's state (step, data cursor, checkpoints) and its phases.

    Args:
        config: the resolved config.
        resume: continue from the newest good checkpoint in ``config.run_dir``.
        overwrite: replace what ``config.run_dir`` holds (else a run directory that holds a run
            is refused unless ``resume``: :mod:`agentrl.loop.run_dir`).
        on_step: called with each step's metrics (the CLI draws its progress bar with it).
        parts: the run's parts, assembled already from ``config`` (``resume`` and ``overwrite``
            then go to :func:`~agentrl.loop.assemble.assemble`, with any part handed in);
            default: assembled here.
    """

    def __init__(
        self,
        config: TrainConfig,
        *,
        resume: bool = False,
        overwrite: bool = False,
        on_step: Callable[[dict[str, float]], None] | None = None,
        parts: RunParts | None = None,
    ) -> None:
        if parts is None:
            parts = assemble(config, resume=resume, overwrite=overwrite)
        elif parts.config is not config or resume or overwrite:
            raise ValueError("parts: assemble them from this config, with resume and overwrite")
        self.config = config
        self.on_step = on_step
        self.resume = parts.resume
        self.ranks, self.run_dir = parts.ranks, parts.run_dir
        self.train_tasks, self.eval_tasks = parts.train_tasks, parts.eval_tasks
        self.model, self.tokenizer, self.chat = parts.model, parts.tokenizer, parts.chat
        self.learner = parts.learner
        self.client: InferenceClient = parts.client
        self.teacher = parts.teacher  # on-policy distillation, or None
        self.weight_push = parts.weight_push  # None: disk or local; rank 0 pushes for every rank
        self.rollout, self.evaluator = parts.rollout, parts.evaluator
        self._loggers = parts.loggers  # train.loggers beside metrics.jsonl; rank 0 writes them
        self.notice: str | None = None  # what a resume did, for the user (the CLI prints it)
        self.step_start: tuple[int, Any] | None = None  # (cursor, RNG) as the step in flight began
        self.updating = False  # from a step's update to its after_step: the learner moved on
        self.saved_step: int | None = None  # the newest checkpoint written or resumed (once each)
        self._checkpoint_time = time.perf_counter()  # train.checkpoint_every_minutes counts from it
        self.health = RunHealth(config.train)
        self.step = 0
        self.cursor = 0
        self._order: tuple[int, list[int]] = (-1, [])  # (epoch, its task order)
        self.last_push: dict[str, float] = {}

    def make_env(self) -> Env:
        """A fresh env instance for one episode."""
        return make(self.config.env.id, **self.config.env.kwargs)

    async def sync_weights(self) -> float:
        """Push the learner's weights to the engine as version ``step``; returns seconds.

        The push's timings are kept in ``last_push`` (see :func:`placement.push_weights`).
        """
        remote = self.run_dir / "weights" if self.config.inference.endpoints else None
        if self.learner.lora is not None:  # only the adapters move (placement.push_adapter)
            self.last_push = await push_adapter(
                self.learner, self.client, self.step, self.run_dir, remote=remote is not None,
                is_main=self.ranks.is_main, barrier=self.ranks.barrier,
            )  # fmt: skip
            return self.last_push["time/sync_s"]
        push = push_weights if self.ranks.world_size == 1 else dist_ranks.push_weights
        self.last_push = await push(
            self.learner, self.client, self.step, remote, self.tokenizer, self.weight_push
        )
        return self.last_push["time/sync_s"]

    def next_tasks(self) -> list[Task]:
        """The next ``tasks_per_step`` tasks of a per-epoch seeded shuffle."""
        n, out = len(self.train_tasks), []
        for _ in range(self.config.train.tasks_per_step):
            epoch, pos = divmod(self.cursor, n)
            if self._order[0] != epoch:  # once an epoch: O(n) with the GIL held, not per task
                order = list(range(n))
                random.Random(self.config.seed * 7919 + epoch).shuffle(order)
                self._order = (epoch, order)
            out.append(self.train_tasks[self._order[1][pos]])
            self.cursor += 1
        return out

    # ------------------------------------------------------------------ phases

    async def evaluate(self) -> dict[str, float]:
        """Held-out success (pass@1 over ``eval_samples`` samples per task), turns, tool calls.

        With ``eval_samples`` K > 1 also ``eval/pass@1`` .. ``eval/pass@K`` and ``eval/avg@K``,
        as ``agentrl eval`` reports them (:func:`~agentrl.pass_at_k.eval_metrics`).
        """
        groups = await self.ranks.run_groups(
            self.evaluator, self.make_env, self.eval_tasks, env_id=self.config.env.id,
            seed_offset=EVAL_SEED_OFFSET,
        )  # fmt: skip
        threshold, k = self.config.rollout.success_threshold, self.config.train.eval_samples
        m = eval_metrics(groups, success_threshold=threshold, pass_at=k > 1)
        return {f"eval/{key}": v for key, v in m.items()}

    async def cold_start(self) -> dict[str, float]:
        """Supervised warm-up on demonstrated episodes of training tasks (skipped at 0 steps)."""
        return await run_cold_start(self)

    def _shuffle_rewards(self, groups: list[Group]) -> None:
        trajs = [t for g in groups for t in g.trajectories]
        rewards = [t.reward for t in trajs]
        random.Random(self.config.seed * 31 + self.step).shuffle(rewards)
        for t, r in zip(trajs, rewards, strict=True):
            t.reward = r

    async def train_step(self) -> dict[str, float]:
        """One synchronous step: roll out the next tasks' groups, then :meth:`update` on them."""
        t0 = time.perf_counter()
        self.ranks.step = self.step + 1  # for failure messages
        self.step_start = (self.cursor, rng_state())  # a second signal may abandon this step
        tasks = self.next_tasks()
        groups = await self.ranks.run_groups(
            self.rollout,
            self.make_env,
            tasks,
            env_id=self.config.env.id,
            seed_offset=self.step * self.config.train.tasks_per_step,
        )
        metrics = rollout_metrics(groups, success_threshold=self.config.rollout.success_threshold)
        metrics["time/rollout_s"] = time.perf_counter() - t0
        metrics = await self.update(groups, metrics)
        metrics["time/step_s"] = time.perf_counter() - t0
        return metrics

    async def update(
        self,
        groups: list[Group],
        metrics: dict[str, float] | None = None,
        *,
        overlapped: bool = False,
        on_next_version: Callable[[], None] | None = None,
    ) -> dict[str, float]:
        """The one training step of both loops: advantages, update, weight push, records.

        Shuffles rewards when the control asks for it, turns the groups into per-token
        advantages (:meth:`training_batch`), runs one learner update, pushes the new weights as
        version ``step + 1`` and appends the trained trajectories to ``trajectories.jsonl``.

        Args:
            groups: the step's complete groups, in task order.
            metrics: the caller's metrics of this batch (rollout figures); updated and returned.
            overlapped: rollouts are in flight (the overlapped loop): the update runs in a worker
                thread so the event loop keeps serving them, and they are interrupted around the
                weight push (partial rollouts) and released after it.
            on_next_version: called once new episodes can only generate on the pushed weights:
                overlapped, as the interrupt begins (their requests wait, at the gate or in
                the paused engine's queue, until the push is done); else after the push.

        Returns:
            ``metrics`` with the learner's figures, ``rollout/zero_signal_groups``,
            ``time/train_s``, ``time/sync_s`` (the weight push) and, with endpoints,
            ``time/weight_write_s`` (writing its safetensors).
        """
        metrics = {} if metrics is None else metrics
        self.updating = True
        if self.config.advantages.shuffle_rewards:
            self._shuffle_rewards(groups)
        if self.teacher is not None:  # scores the sampled tokens (a failure fails episodes)
            await self.teacher.score(groups, metrics)
        trajs, advs, skipped = self.training_batch(groups)
        metrics["rollout/zero_signal_groups"] = float(skipped)
        t1 = time.perf_counter()
        if trajs:
            samples = samples_from_trajectories(trajs, advs)
            self.learner.weight_version = self.step  # the version the engine got at the last push
            if overlapped:
                # on a stream of its own, so the engine's decoding overlaps it on the card
                step = self.learner.step
                dev = self.learner.device
                metrics.update(await asyncio.to_thread(on_side_stream, dev, step, samples))
            else:
                metrics.update(self.learner.step(samples))
        metrics["time/train_s"] = time.perf_counter() - t1
        self.step += 1
        # records first: the admitted episodes start next, and the engine idles until they do
        shown = self.health.observe(self.step, groups, trajs)  # failed, timeout, zero-signal
        trainer_lp = getattr(self.learner, "last_trainer_logprobs", None) or []
        path = self.run_dir / "trajectories.jsonl"
        if self.ranks.is_main:
            with disk_errors(path):
                trained = list(zip(trajs, advs, strict=True))
                write_records(path, self.step, trained, trainer_lp, shown)
        if overlapped:
            try:
                await self.rollout.interrupt(then=on_next_version)
                await self.sync_weights()
            finally:
                await self.rollout.release()
        else:
            await self.sync_weights()
            if on_next_version is not None:
                on_next_version()
        metrics.update(self.last_push)
        return metrics

    def training_batch(
        self, groups: Sequence[Group]
    ) -> tuple[list[Trajectory], list[torch.Tensor], int]:
        """Trajectories that carry signal, their per-token advantages, zero-signal groups.

        See :func:`agentrl.loop.teacher.token_batch` (with the teacher's scores, if any).
        """
        return token_batch(groups, self.config, self.teacher)

    def save_checkpoint(self) -> Path:
        """Write a resumable checkpoint for the current step (once: a second call is a no-op).

        Written aside, sealed by a manifest and renamed into place; only the
        ``train.keep_checkpoints`` newest are kept (:mod:`agentrl.loop.checkpoints`).
        """
        root = self.run_dir / "checkpoints"
        if self.saved_step == self.step:
            return root / f"step-{self.step:06d}"
        state = {"step": self.step, "cursor": self.cursor, "rng": rng_state()}
        keep = self.config.train.keep_checkpoints
        path = write_checkpoint(root, self.step, self.learner, state, self.ranks, keep=keep)
        self.saved_step = self.step
        self._checkpoint_time = time.perf_counter()
        return path

    async def load_checkpoint(self) -> bool:
        """Restore the latest checkpoint of the run directory; False when there is none.

        The logs are cut back to the checkpoint's step, so that the resumed run appends to
        exactly what an uninterrupted run had written by then; with no checkpoint they are cut
        to nothing (the run starts over) and :attr:`notice` says so.
        """
        state, skipped = read_checkpoint(self.run_dir, self.learner, self.ranks)
        if state is None:
            if self.ranks.is_main:
                self.notice = "\n".join([*skipped, start_over(self.run_dir)])
                log.warning("%s", self.notice.splitlines()[-1])
            return False
        self.step, self.cursor = state["step"], state["cursor"]
        self.ranks.step = self.saved_step = self.step
        if self.ranks.is_main:
            cut_logs(self.run_dir, self.step)
        line = f"resume: continuing {self.run_dir} from the checkpoint of step {self.step}"
        log.info("%s", line)
        self.notice = "\n".join([*skipped, line])
        await self.sync_weights()
        return True

    # ------------------------------------------------------------------ the run

    def log(self, metrics: dict[str, float]) -> None:
        """Append ``metrics`` as this step's line of ``metrics.jsonl`` (and ``train.loggers``)."""
        if not self.ranks.is_main:  # rank 0 writes the run's files and progress
            return
        rec = {"step": self.step, "time": time.time(), **metrics}
        append_bytes(self.run_dir / "metrics.jsonl", (json.dumps(rec) + "\n").encode())
        if self._loggers is not None:
            self._loggers.log(self.step, metrics)
        if self.on_step is not None:
            self.on_step(rec)

    def out_of_time(self, t_rl: float) -> bool:
        """Whether ``train.max_wall_s`` has passed since ``t_rl``, the first RL step's start."""
        limit = self.config.train.max_wall_s
        return limit is not None and time.perf_counter() - t_rl > limit

    async def after_step(self, metrics: dict[str, float], t_rl: float) -> bool:
        """The one schedule of both loops, after each step; returns whether to stop.

        Evaluates every ``eval_every`` steps (not at the last: the run's end evaluates), logs
        the step, checkpoints every ``checkpoint_every`` steps or ``checkpoint_every_minutes``,
        and stops at ``train.steps`` or when ``train.max_wall_s`` has passed since ``t_rl``
        (the RL loop's start: the cold start is not counted).

        Raises:
            TrainingError: too many episodes failed for too long (:class:`RunHealth`).
            Stopped: a signal asked the run to stop (:mod:`agentrl.loop.stop`); this step was
                checkpointed first.
        """
        cfg = self.config.train
        if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < cfg.steps:
            metrics.update(await self.evaluate())
        self.log(metrics)
        self.health.check(self.step, metrics)
        minutes = cfg.checkpoint_every_minutes
        due = bool(cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0) or bool(
            minutes and time.perf_counter() - self._checkpoint_time >= 60 * minutes
        )
        # rank 0's clock and signals decide for all
        signum, due, late = self.ranks.broadcast((stop.requested(), due, self.out_of_time(t_rl)))
        if due or signum is not None:
            self.save_checkpoint()
        self.updating = False
        if signum is not None:
            raise stop.Stopped(self.step, signum, self.run_dir)
        if self.step >= cfg.steps:
            return True
        if late:
            log.info("stopping at step %d: max_wall_s reached", self.step)
            return True
        return False

    async def _synchronous_steps(self) -> AsyncGenerator[dict[str, float], None]:
        while True:
            yield await self.train_step()

    async def run(self) -> dict[str, Any]:
        """Train for ``config.train.steps`` steps; returns (and writes) ``summary.json``.

        Resuming a run that already finished changes nothing and returns its summary (with
        ``"already_finished": True``); :attr:`notice` says so.
        """
        t_start = time.perf_counter()
        finished = finished_summary(self.run_dir, self.config.train.steps) if self.resume else None
        if finished is not None:
            await self.client.aclose()
            self.notice = f"resume: {self.run_dir} already finished {finished['steps']} steps"
            log.warning("%s; nothing to do", self.notice)
            return {**finished, "already_finished": True}
        if self.ranks.is_main:
            config_yaml = yaml.safe_dump(self.config.model_dump(mode="json"), sort_keys=False)
            replace_file(self.run_dir / "config.yaml", config_yaml)
        try:
            with gil_switch_interval(self.config.train.gil_switch_interval_ms), stop.deferred():
                return await self._run(t_start)
        finally:
            if self.weight_push is not None:
                await self.weight_push.aclose()
            await self.client.aclose()
            if self.teacher is not None:
                await self.teacher.aclose()
            if self._loggers is not None:
                self._loggers.close()

    async def _run(self, t_start: float) -> dict[str, Any]:
        cfg = self.config.train
        resumed = self.resume and await self.load_checkpoint()
        state_path = self.run_dir / "summary_state.json"
        cold: dict[str, float] = {}
        if resumed and state_path.exists():
            start = json.loads(state_path.read_text())
        else:
            await self.sync_weights()  # the engine (maybe remote) serves the policy as version 0
            t = time.perf_counter()
            cold = await self.cold_start()
            start = await self.evaluate()
            start["cold_start_s"] = time.perf_counter() - t
            if self.ranks.is_main:
                replace_file(state_path, json.dumps(start))
            self.log({**cold, **start})
        if (signum := self.ranks.broadcast(stop.requested())) is not None:
            self.save_checkpoint()  # keeps a cold start (a no-op right after a resume)
            raise stop.Stopped(self.step, signum, self.run_dir)
        t_rl = time.perf_counter()
        if self.step < cfg.steps:  # train.max_wall_s counts from here
            # one schedule; the source of steps is the synchronous loop or the overlapped one
            pipeline = Pipeline(self) if cfg.max_staleness > 0 else None
            source = pipeline.steps() if pipeline else self._synchronous_steps()
            try:
                async with aclosing(source) as steps:
                    async for metrics in steps:
                        if await self.after_step(metrics, t_rl):
                            break
            except asyncio.CancelledError:  # a second signal: abandon the step in flight
                stop.checkpoint_abandoned(self)
                raise
            if pipeline is not None:
                log.info("overlapped loop: %s", pipeline.stats)
        end = await self.evaluate()
        self.log(end)
        self.save_checkpoint()
        if cfg.export and self.ranks.is_main:  # RUN_DIR/export, from the checkpoint just sealed
            export_final(self.run_dir, self.step)
        return summarise(self, start, end, t_start, t_rl)
