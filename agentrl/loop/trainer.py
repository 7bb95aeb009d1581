"""The RL loop: rollouts -> advantages -> GSPO-token update -> weight sync, with checkpoints.

One step: take the next tasks (a seeded, per-epoch shuffled cursor), run G episodes each, turn
rewards into per-token advantages, update the policy on the engine's log-probs, push the new
weights to the engine (in process, or over HTTP via a safetensors checkpoint), then log. Every
step appends one JSON object to ``metrics.jsonl``; trained-on trajectories go to
``trajectories.jsonl`` with the advantages and trainer log-probs the update saw. Checkpoints hold
model, optimiser, RNG states, step and data cursor, so ``resume`` continues exactly.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import random
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from pathlib import Path
from typing import Any

import numpy as np
import torch

from agentrl.config import TrainConfig, dump_config
from agentrl.env import Env, env_class, make
from agentrl.errors import ConfigError
from agentrl.inference.base import InferenceClient
from agentrl.learner import Learner, LearnerConfig, samples_from_trajectories
from agentrl.learner.advantages import compute_token_advantages
from agentrl.loop.cold_start import cold_start as run_cold_start
from agentrl.loop.pipeline import Pipeline
from agentrl.rollout.chat import ChatTokenizer
from agentrl.rollout.engine import RolloutEngine, rollout_metrics
from agentrl.types import Group, Task, Trajectory

log = logging.getLogger(__name__)

EVAL_SEED_OFFSET = 1_000_003  # eval episodes never share seeds with training episodes


def load_policy(config: TrainConfig) -> tuple[Any, Any]:
    """The policy model and tokenizer named by ``config.model`` (``tiny`` builds locally)."""
    model: Any
    tok: Any
    if config.model.path == "tiny":
        from agentrl.tiny import build_tiny

        model, tok = build_tiny(seed=config.seed, **config.model.tiny)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(config.model.path)
        model = AutoModelForCausalLM.from_pretrained(config.model.path)
    dtype = torch.bfloat16 if config.model.dtype == "bfloat16" else torch.float32
    return model.to(dtype), tok


def load_tasks(config: TrainConfig, split: str) -> list[Task]:
    """Training or held-out tasks: from a file when configured, else the env's generator."""
    path = config.env.train_tasks if split == "train" else config.env.eval_tasks
    if path is not None:
        from agentrl.data import load_tasks as load_file

        return load_file(
            path, prompt_field=config.env.prompt_field, answer_field=config.env.answer_field
        )
    n = config.env.num_train_tasks if split == "train" else config.env.num_eval_tasks
    cls = env_class(config.env.id)
    return cls.sample_tasks(n, seed=config.seed, split=split, **config.env.task_kwargs)  # type: ignore[attr-defined]


def _rng_state() -> dict[str, Any]:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def _drop_lines_after(path: Path, step: int) -> None:
    """Remove records of steps after ``step`` (written after the checkpoint we resume from)."""
    if not path.exists():
        return
    keep = [
        ln
        for ln in path.read_text(encoding="utf-8").splitlines()
        if ln.strip() and json.loads(ln).get("step", 0) <= step
    ]
    path.write_text("".join(ln + "\n" for ln in keep), encoding="utf-8")


class Trainer:
    """Runs a :class:`TrainConfig` end to end and writes its run directory.

    Args:
        config: the resolved config.
        resume: continue from the latest checkpoint in ``config.run_dir``.
        on_step: called with each step's metrics (the CLI draws its progress bar with it).
    """

    def __init__(
        self,
        config: TrainConfig,
        *,
        resume: bool = False,
        on_step: Callable[[dict[str, float]], None] | None = None,
    ) -> None:
        self.config = config
        self.on_step = on_step
        if resume and config.run_dir is None:
            raise ConfigError("run_dir: resume needs the run directory to continue")
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.run_dir = Path(config.run_dir or Path(config.out_dir) / f"{config.name}-{stamp}")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.resume = resume
        self.step = 0
        self.cursor = 0
        random.seed(config.seed)
        np.random.seed(config.seed)
        torch.manual_seed(config.seed)
        self.model, self.tokenizer = load_policy(config)
        self.chat = ChatTokenizer(self.tokenizer)
        learner_fields: dict[str, Any] = {
            "temperature": config.rollout.temperature or 1.0,
            "seed": config.seed,
        }
        learner_fields.update(config.learner)
        self.learner = Learner(self.model, LearnerConfig(**learner_fields))
        self.train_tasks = load_tasks(config, "train")
        self.eval_tasks = load_tasks(config, "test")
        self.client: InferenceClient = self._make_client()
        self.rollout = RolloutEngine(self.client, self.tokenizer, config.rollout, chat=self.chat)
        eval_cfg = config.rollout.model_copy(
            update={
                "group_size": config.train.eval_samples,
                "temperature": config.train.eval_temperature,
            }
        )
        self.evaluator = RolloutEngine(self.client, self.tokenizer, eval_cfg, chat=self.chat)
        self._tb: Any = None
        if config.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ConfigError(
                    "tensorboard: true needs the tensorboard package (pip install tensorboard)"
                ) from e
            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))

    # ------------------------------------------------------------------ plumbing

    def make_env(self) -> Env:
        """A fresh env instance for one episode."""
        return make(self.config.env.id, **self.config.env.kwargs)

    def _make_client(self) -> InferenceClient:
        if self.config.inference.endpoints:
            from agentrl.inference.client import SGLangClient

            return SGLangClient(
                self.config.inference.endpoints, timeout_s=self.config.inference.timeout_s
            )
        from agentrl.inference.engine import LocalEngine

        return LocalEngine(
            copy.deepcopy(self.model),
            self.tokenizer,
            max_batch_size=self.config.inference.max_batch_size,
        )

    async def sync_weights(self) -> float:
        """Push the learner's weights to the engine as version ``step``; returns seconds."""
        t = time.perf_counter()
        if self.config.inference.endpoints:
            path = self.run_dir / "weights"
            self.learner.save_pretrained(path, tokenizer=self.tokenizer)
            await self.client.update_weights_from_disk(str(path.resolve()), self.step)
        else:
            engine: Any = self.client
            await engine.update_weights_from_state_dict(
                self.learner.state_dict_for_inference(), self.step
            )
        return time.perf_counter() - t

    def next_tasks(self) -> list[Task]:
        """The next ``tasks_per_step`` tasks of a per-epoch seeded shuffle."""
        n, out = len(self.train_tasks), []
        for _ in range(self.config.train.tasks_per_step):
            epoch, pos = divmod(self.cursor, n)
            order = list(range(n))
            random.Random(self.config.seed * 7919 + epoch).shuffle(order)
            out.append(self.train_tasks[order[pos]])
            self.cursor += 1
        return out

    # ------------------------------------------------------------------ phases

    async def evaluate(self) -> dict[str, float]:
        """Held-out success (pass@1 over ``eval_samples`` samples per task), turns, tool calls."""
        groups = await self.evaluator.run_groups(
            self.make_env, self.eval_tasks, env_id=self.config.env.id, seed_offset=EVAL_SEED_OFFSET
        )
        m = rollout_metrics(groups, success_threshold=self.config.rollout.success_threshold)
        calls = [t.tool_calls for g in groups for t in g.trajectories]
        return {
            "eval/success_rate": m["rollout/success_rate"],
            "eval/reward_mean": m["rollout/reward_mean"],
            "eval/turns_mean": m["rollout/turns_mean"],
            "eval/tool_calls_mean": sum(calls) / len(calls),
            "eval/tool_use_frac": sum(c > 0 for c in calls) / len(calls),
        }

    async def cold_start(self) -> dict[str, float]:
        """Supervised warm-up on demonstrated episodes of training tasks (skipped at 0 steps)."""
        cs = self.config.cold_start
        if cs.steps == 0:
            return {}

        async def check() -> float:
            await self.sync_weights()
            return (await self.evaluate())["eval/success_rate"]

        def progress(m: dict[str, float]) -> None:  # shown, not logged: the CLI draws it
            if self.on_step is not None:
                self.on_step({"step": self.step, **m})

        stats = await run_cold_start(
            self.model, self.make_env, self.chat, self.train_tasks, steps=cs.steps,
            batch_size=cs.batch_size, lr=cs.lr, seed=self.config.seed, check=check,
            check_every=cs.check_every, target=cs.target_success, on_progress=progress,
        )  # fmt: skip
        self.learner.reset_optimizer()
        await self.sync_weights()
        return stats

    def _shuffle_rewards(self, groups: list[Group]) -> None:
        trajs = [t for g in groups for t in g.trajectories]
        rewards = [t.reward for t in trajs]
        random.Random(self.config.seed * 31 + self.step).shuffle(rewards)
        for t, r in zip(trajs, rewards, strict=True):
            t.reward = r

    async def train_step(self) -> dict[str, float]:
        """One synchronous step: roll out the next tasks' groups, then :meth:`update` on them."""
        t0 = time.perf_counter()
        tasks = self.next_tasks()
        groups = await self.rollout.run_groups(
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
        on_synced: Callable[[], None] | None = None,
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
            on_synced: called right after the push, while rollouts are still interrupted.

        Returns:
            ``metrics`` with the learner's figures, ``rollout/zero_signal_groups``,
            ``time/train_s`` and ``time/sync_s``.
        """
        metrics = {} if metrics is None else metrics
        if self.config.advantages.shuffle_rewards:
            self._shuffle_rewards(groups)
        trajs, advs, skipped = self.training_batch(groups)
        metrics["rollout/zero_signal_groups"] = float(skipped)
        t1 = time.perf_counter()
        if trajs:
            samples = samples_from_trajectories(trajs, advs)
            if overlapped:
                metrics.update(await asyncio.to_thread(self.learner.step, samples))
            else:
                metrics.update(self.learner.step(samples))
        metrics["time/train_s"] = time.perf_counter() - t1
        self.step += 1
        if overlapped:
            try:
                await self.rollout.interrupt()
                metrics["time/sync_s"] = await self.sync_weights()
                if on_synced is not None:
                    on_synced()
            finally:
                await self.rollout.release()
        else:
            metrics["time/sync_s"] = await self.sync_weights()
            if on_synced is not None:
                on_synced()
        self._write_trajectories(trajs, advs)
        return metrics

    def training_batch(
        self, groups: Sequence[Group]
    ) -> tuple[list[Trajectory], list[torch.Tensor], int]:
        """Trajectories that carry signal, with their per-token advantages.

        Failed episodes are left out (they are counted in metrics). A trajectory whose
        advantages are zero everywhere (a group with equal rewards and no shaping penalty)
        would add nothing to the gradient, so it is not sent to the learner; such groups are
        counted as ``zero_signal``.
        """
        trajs: list[Trajectory] = []
        advs: list[torch.Tensor] = []
        zero_signal = 0
        for g in groups:
            ok = [t for t in g.trajectories if not t.failed]
            if not ok:
                continue
            clean = Group(task=g.task, trajectories=ok)
            per_token = compute_token_advantages(
                clean, self.config.advantages.shapers, eps=self.config.advantages.eps
            )
            keep = [(t, a) for t, a in zip(ok, per_token, strict=True) if bool(a.any())]
            zero_signal += not keep
            trajs += [t for t, _ in keep]
            advs += [a for _, a in keep]
        return trajs, advs, zero_signal

    def _write_trajectories(self, trajs: list[Trajectory], advs: list[torch.Tensor]) -> None:
        trainer_lp = getattr(self.learner, "last_trainer_logprobs", None) or []
        with (self.run_dir / "trajectories.jsonl").open("a", encoding="utf-8") as f:
            for i, (t, a) in enumerate(zip(trajs, advs, strict=True)):
                rec = {
                    "step": self.step,
                    "advantages": [round(x, 6) for x in a.tolist()],
                    "trainer_logprobs": trainer_lp[i] if i < len(trainer_lp) else None,
                    "trajectory": t.model_dump(mode="json"),
                }
                f.write(json.dumps(rec) + "\n")

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self) -> Path:
        """Write a resumable checkpoint for the current step."""
        path = self.run_dir / "checkpoints" / f"step-{self.step:06d}"
        path.mkdir(parents=True, exist_ok=True)
        self.learner.save_checkpoint(path)
        torch.save(
            {"step": self.step, "cursor": self.cursor, "rng": _rng_state()},
            path / "trainer_state.pt",
        )
        (self.run_dir / "checkpoints" / "latest").write_text(path.name)
        return path

    async def load_checkpoint(self) -> bool:
        """Restore the latest checkpoint of the run directory; False when there is none."""
        latest = self.run_dir / "checkpoints" / "latest"
        if not latest.exists():
            return False
        path = self.run_dir / "checkpoints" / latest.read_text().strip()
        self.learner.load_checkpoint(path)
        state = torch.load(path / "trainer_state.pt", weights_only=False)
        self.step, self.cursor = state["step"], state["cursor"]
        _set_rng_state(state["rng"])
        for name in ("metrics.jsonl", "trajectories.jsonl"):
            _drop_lines_after(self.run_dir / name, self.step)
        await self.sync_weights()
        return True

    # ------------------------------------------------------------------ the run

    def log(self, metrics: dict[str, float]) -> None:
        """Append ``metrics`` as this step's line of ``metrics.jsonl`` (and TensorBoard)."""
        rec = {"step": self.step, "time": time.time(), **metrics}
        with (self.run_dir / "metrics.jsonl").open("a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")
        if self._tb is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, self.step)
            self._tb.flush()
        if self.on_step is not None:
            self.on_step(rec)

    def out_of_time(self, t_start: float) -> bool:
        """Whether ``train.max_wall_s`` has passed since ``t_start`` (``time.perf_counter()``)."""
        limit = self.config.train.max_wall_s
        return limit is not None and time.perf_counter() - t_start > limit

    async def after_step(self, metrics: dict[str, float], t_start: float) -> bool:
        """The one schedule of both loops, after each step; returns whether to stop.

        Evaluates every ``eval_every`` steps (not at the last: the run's end evaluates), logs
        the step, checkpoints every ``checkpoint_every`` steps, and stops at ``train.steps``
        or when ``train.max_wall_s`` has passed.
        """
        cfg = self.config.train
        if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < cfg.steps:
            metrics.update(await self.evaluate())
        self.log(metrics)
        if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
            self.save_checkpoint()
        if self.step >= cfg.steps:
            return True
        if self.out_of_time(t_start):
            log.info("stopping at step %d: max_wall_s reached", self.step)
            return True
        return False

    async def _synchronous_steps(self) -> AsyncGenerator[dict[str, float], None]:
        while True:
            yield await self.train_step()

    async def run(self) -> dict[str, Any]:
        """Train for ``config.train.steps`` steps; returns (and writes) ``summary.json``."""
        t_start = time.perf_counter()
        dump_config(self.config, self.run_dir / "config.yaml")
        try:
            return await self._run(t_start)
        finally:
            await self.client.aclose()
            if self._tb is not None:
                self._tb.close()

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
            state_path.write_text(json.dumps(start))
            self.log({**cold, **start})
        t_rl = time.perf_counter()
        if self.step < cfg.steps and not self.out_of_time(t_start):
            # one schedule; the source of steps is the synchronous loop or the overlapped one
            pipeline = Pipeline(self) if cfg.max_staleness > 0 else None
            source = pipeline.steps() if pipeline else self._synchronous_steps()
            async with aclosing(source) as steps:
                async for metrics in steps:
                    if await self.after_step(metrics, t_start):
                        break
            if pipeline is not None:
                log.info("overlapped loop: %s", pipeline.stats)
        end = await self.evaluate()
        self.log(end)
        self.save_checkpoint()
        return self._summarise(start, end, t_start, t_rl)

    def _summarise(
        self, start: dict[str, float], end: dict[str, float], t_start: float, t_rl: float
    ) -> dict[str, Any]:
        summary = {
            "success_start": start["eval/success_rate"],
            "success_end": end["eval/success_rate"],
            "steps": self.step,
            "wall_s": time.perf_counter() - t_start,
            "rl_wall_s": time.perf_counter() - t_rl,
            "cold_start_s": start.get("cold_start_s", 0.0),
            **{k: end[f"eval/{k}"] for k in ("turns_mean", "tool_calls_mean", "tool_use_frac")},
            "env": self.config.env.id,
            "loss": self.learner.config.loss,
            "run_dir": str(self.run_dir),
        }
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        try:
            from agentrl.report.plots import plot_run

            plot_run(self.run_dir)
        except Exception:  # a plot must never lose a finished run
            log.warning("plotting failed", exc_info=True)
        return summary
