"""The rollout engine: many multi-turn episodes at once, token-in/token-out.

Each episode runs as its own asyncio task under a concurrency limit and a timeout: reset the env,
tokenise the prompt, then alternate ``client.generate`` (new ids + log-probs + weight versions)
and ``env.step`` until the env ends the episode or a budget does (turns, context tokens, time).
Observations are appended as the chat template's delta with loss mask 0, once bounded
(:mod:`~agentrl.rollout.observations`). A failing env or request is recorded on its trajectory
and counted; it never stops the other episodes. Synchronous env code runs in the engine's own
threads (:mod:`~agentrl.rollout.env_pool`) and a watchdog reports an async env that blocks the
event loop (:mod:`~agentrl.rollout.watchdog`): no env can hang the engine. Rewards
come from ``env.step`` (verifiers run there, off the event loop), so scoring one episode overlaps
with generating the others.

Partial rollouts: :meth:`RolloutEngine.interrupt` and :meth:`RolloutEngine.release` close and
open the gate of a weight update; each turn keeps what it sampled and resumes on the new weights
(:mod:`~agentrl.rollout.partial_rollouts`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from typing import Any

from agentrl.env import Env
from agentrl.errors import ConfigError, ServerError
from agentrl.inference.base import GenerateOutput, InferenceClient
from agentrl.rollout import observations
from agentrl.rollout.chat import ChatTokenizer
from agentrl.rollout.env_pool import EnvThreads, EnvThreadsStuck, reset_pool, use_pool
from agentrl.rollout.episode import (
    EpisodeState,
    checked_reset,
    checked_step,
    checked_turn_cap,
    env_call,
)
from agentrl.rollout.partial_rollouts import WeightGate, generate_turn, pausable
from agentrl.rollout.records import JsonlSink, rollout_metrics
from agentrl.rollout.rollout_config import RolloutConfig
from agentrl.rollout.watchdog import LoopWatchdog, OnStall
from agentrl.types import Group, Message, Task, Trajectory

__all__ = ["EnvFactory", "JsonlSink", "RolloutConfig", "RolloutEngine", "rollout_metrics"]

log = logging.getLogger(__name__)


EnvFactory = Callable[[], Env]


class RolloutEngine:
    """Runs groups of episodes concurrently against an :class:`InferenceClient`.

    Args:
        client: the inference backend (SGLang over HTTP, or the embedded engine).
        tokenizer: the policy's tokenizer (with a chat template).
        config: budgets, group size, sampling.
        chat: a :class:`ChatTokenizer` (built from ``tokenizer`` when omitted).
        on_stall: ``f(message, stack)``, called when an async env blocks the event loop past
            ``env_timeout_s`` (:mod:`~agentrl.rollout.watchdog`); by default the process stops
            with ``message`` as its one error line, status 1.
    """

    def __init__(
        self,
        client: InferenceClient,
        tokenizer: Any,
        config: RolloutConfig | None = None,
        *,
        chat: ChatTokenizer | None = None,
        on_stall: OnStall | None = None,
    ) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.config = config or RolloutConfig()
        if self.config.interrupt_mode != "abort" and pausable(client) is None:
            raise ConfigError(
                f"rollout.interrupt_mode: {self.config.interrupt_mode!r} needs a client that "
                f"can pause (the embedded engine, SGLang); {type(client).__name__} cannot"
            )
        self.chat = chat or ChatTokenizer(tokenizer)
        self.env_threads = EnvThreads(self.config.env_threads)
        """Threads of synchronous env code (``rollout.env_threads``)."""
        env_s, episode_s = self.config.env_timeout_s, self.config.episode_timeout_s
        self._watchdog = LoopWatchdog(
            env_s or episode_s,
            env_call.__code__,
            on_stall,
            limit_name="rollout.env_timeout_s" if env_s else "rollout.episode_timeout_s",
        )
        self._warned: set[str] = set()  # envs whose too-long observation was logged
        self._sem = asyncio.Semaphore(self.config.concurrency)
        self._token_text: dict[int, str] = {}
        self._gate = WeightGate()
        self._tag = uuid.uuid4().hex[:6]  # request ids stay unique across engines and processes
        self._attempts = itertools.count()
        # The embedded engine says whether it records routing; a server is asked per request.
        offered = getattr(client, "return_routed_experts", None)
        want = self.config.return_routed_experts
        self.routed = offered is True if want is None else want
        """Whether turns ask for routed experts (see ``RolloutConfig.return_routed_experts``)."""
        if want and offered is False:
            raise ConfigError(
                "rollout.return_routed_experts: the embedded engine records no routing "
                "(a dense model, or LocalEngine(return_routed_experts=False))"
            )

    def _text_of(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text

    def _decode_action(self, out: GenerateOutput) -> tuple[str, str | None, str | None]:
        """The answer for the env, the reasoning split off it, and the stop token's text."""
        ids = out.output_ids
        stop_text = None
        if out.finish_reason == "stop" and ids:
            stop_text = self._text_of(ids[-1])
            ids = ids[:-1]
        answer, reasoning = self.chat.decode_reply(ids)
        return answer, reasoning, stop_text

    async def run_episode(
        self,
        make_env: EnvFactory,
        task: Task,
        *,
        env_id: str = "",
        group_index: int = 0,
        seed: int | None = None,
    ) -> Trajectory:
        """Run one episode to its end; errors are recorded on the returned trajectory.

        Its request ids are unique per call (``<task>#<index>@<seed>~<engine><n>``), so the
        same task may be in flight any number of times, from any number of engines.
        """
        ep = EpisodeState()
        ep.timing.started_at = time.time()
        t0 = time.perf_counter()
        episode_id = f"{task.id}#{group_index}@{seed}~{self._tag}{next(self._attempts)}"
        rid: list[str | None] = [None]
        env: Env | None = None
        async with self._sem:
            pool = use_pool(self.env_threads)  # SyncEnv and sync tools run in its threads
            try:
                env = make_env()
                async with asyncio.timeout(self.config.episode_timeout_s):
                    with self._watchdog.watching():
                        await self._loop(env, task, ep, episode_id, seed, rid, env_id)
            except EnvThreadsStuck:
                raise  # the env hangs for good: the run must stop
            except TimeoutError as e:
                if not str(e):
                    e = TimeoutError(f"episode took longer than {self.config.episode_timeout_s} s")
                ep.fail(e)
                if rid[0] is not None:
                    await self._abort_quietly(rid[0])
            except Exception as e:  # a bad episode is data, not a crash
                ep.fail(e)
                log.debug("episode %s failed", episode_id, exc_info=True)
            finally:
                try:
                    if env is not None:
                        await self._close_quietly(env, ep)
                finally:
                    reset_pool(pool)
        ep.timing.wall_s = time.perf_counter() - t0
        return ep.trajectory(task_id=task.id, env_id=env_id, group_index=group_index)

    async def _loop(
        self,
        env: Env,
        task: Task,
        ep: EpisodeState,
        episode_id: str,
        seed: int | None,
        rid: list[str | None],
        env_id: str,
    ) -> None:
        cfg = self.config
        t = time.perf_counter()
        first = checked_reset(
            await env_call("reset", env.reset(task, seed=seed), cfg.env_timeout_s)
        )
        ep.timing.env_s += time.perf_counter() - t
        observations.check_prompt_size(first, cfg.max_total_tokens)
        ep.messages += first
        ep.tokens = self.chat.prompt_ids(first)
        ep.prompt_len = n = len(ep.tokens)
        ep.loss_mask, ep.logprobs, ep.versions = [0] * n, [0.0] * n, [-1] * n
        base = cfg.sampling()
        for turn in range(cfg.max_turns):
            budget = cfg.max_total_tokens - len(ep.tokens)
            if budget <= 0:
                ep.truncated, ep.finish_reason = True, "max_tokens"
                return
            cap = checked_turn_cap(env.turn_max_new_tokens(turn), turn, cfg.max_new_tokens)
            params = replace(
                base,
                max_new_tokens=min(cap, budget),
                seed=None if seed is None else (seed * 1009 + turn) % (2**31),
            )
            t = time.perf_counter()
            turn_id = f"{episode_id}/t{turn}"
            out = await generate_turn(
                self.client, self._gate, ep, params, turn_id, episode_id, rid, routed=self.routed
            )
            ep.timing.generate_s += time.perf_counter() - t
            span = ep.append_output(out)
            action, reasoning, stop_text = self._decode_action(out)
            # The env and its reward see the answer; the reasoning stays in the transcript and
            # the turn's info (its tokens are trained on like every sampled token).
            said = action if reasoning is None else f"<think>\n{reasoning}\n</think>\n\n{action}"
            ep.messages.append(Message(role="assistant", content=said))
            if out.finish_reason == "abort":
                raise ServerError(
                    "generation aborted by the server", endpoint=out.endpoint, rid=out.rid
                )
            if out.finish_reason == "length" and not (env.sees_cut_turns or cfg.ignore_eos):
                full = cap <= budget  # else the context budget
                ep.truncated, ep.finish_reason = True, "max_new_tokens" if full else "max_tokens"
                return
            t = time.perf_counter()
            raw = await env_call("step", env.step(action), cfg.env_timeout_s)
            cap = cfg.max_observation_tokens
            raw, chars = observations.bounded_step(raw, cap * observations.CHARS_PER_TOKEN)
            result = checked_step(raw)
            ep.timing.env_s += time.perf_counter() - t
            span.reward, span.info = result.reward, dict(result.info)
            if reasoning is not None:
                span.info["reasoning"] = reasoning
            ep.messages += result.observation
            if result.terminated or result.truncated:
                ep.reward = result.reward
                ep.terminated, ep.truncated = result.terminated, result.truncated
                ep.finish_reason = "terminated" if result.terminated else "env_truncated"
                return
            obs = None  # (text over the character bound is never tokenised)
            if chars <= cap * observations.CHARS_PER_TOKEN:
                obs = self.chat.observation_ids(result.observation, last_token_text=stop_text)
            if obs is None or len(obs) > cap:
                name = f"{env_id} ({type(env).__name__})" if env_id else type(env).__name__
                why = observations.too_long(name, chars, None if obs is None else len(obs), cap)
                if name not in self._warned:  # once per env: the info of each episode says it
                    self._warned.add(name)
                    log.warning("%s", why)
                ep.truncated, ep.finish_reason = True, observations.FINISH_REASON
                ep.info[observations.FINISH_REASON] = why
                return
            if len(ep.tokens) + len(obs) >= cfg.max_total_tokens:
                ep.truncated, ep.finish_reason = True, "max_tokens"
                return
            ep.append_observation(obs)
        ep.truncated, ep.finish_reason = True, "max_turns"

    async def interrupt(self, then: Callable[[], None] | None = None) -> None:
        """Cut off in-flight generation for a weight update (partial rollouts).

        New requests wait at a gate (``then`` runs once it is closed: episodes it starts prepare
        while the step in flight ends); running ones are aborted and return what they sampled so
        far, which the episodes keep (or, with ``interrupt_mode`` ``retract`` or ``in_place``,
        stay open in the paused server). A client that can pause is paused in that mode (SGLang
        repeats an abort until no request holds the model, and a request in transit waits for
        :meth:`release`; one that ``queues_while_paused``, the embedded engine, opens the gate
        once paused: the turns re-send during the push); any other gets ``abort(None)``. Push
        the new weights, then call :meth:`release`.
        """
        await self._gate.interrupt(self.client, self.config.interrupt_mode, then)

    async def release(self) -> None:
        """Let generation continue (on the new weights) after :meth:`interrupt`.

        The gate opens first (even if ``continue_generation`` then fails), while the server is
        still paused: the interrupted turns re-send and queue there, so that it finds them all
        and prefills them in one batch, not one by one as they arrive.
        """
        await self._gate.release(self.client)

    async def _abort_quietly(self, rid: str) -> None:
        try:
            await self.client.abort(rid)
        except Exception:
            log.debug("abort of %s failed", rid, exc_info=True)

    async def _close_quietly(self, env: Env, ep: EpisodeState) -> None:
        """``env.close()`` under ``env_timeout_s``; a failure fails the episode (if nothing had)."""
        try:
            await env_call("close", env.close(), self.config.env_timeout_s)
        except EnvThreadsStuck:
            raise
        except Exception as e:
            ep.fail(e, where=" in close()")

    async def stream_groups(
        self,
        make_env: EnvFactory,
        tasks: Sequence[Task],
        *,
        env_id: str = "",
        sink: JsonlSink | None = None,
        seed_offset: int = 0,
    ) -> AsyncIterator[Group]:
        """Run G episodes per task concurrently; yield each group as soon as it is complete.

        Every trajectory goes to ``sink`` the moment it finishes. Episode seeds are derived from
        ``config.seed``, the task's position plus ``seed_offset``, and the group index.
        """
        g = self.config.group_size
        base = self.config.seed

        async def one(ti: int, task: Task, gi: int) -> tuple[int, Trajectory]:
            seed = None if base is None else base + (seed_offset + ti) * g + gi
            traj = await self.run_episode(make_env, task, env_id=env_id, group_index=gi, seed=seed)
            if sink is not None:
                sink.write(traj)
            return ti, traj

        pending = {
            asyncio.ensure_future(one(ti, task, gi))
            for ti, task in enumerate(tasks)
            for gi in range(g)
        }
        done_by_task: dict[int, list[Trajectory]] = {}
        try:
            for fut in asyncio.as_completed(pending):
                ti, traj = await fut
                bucket = done_by_task.setdefault(ti, [])
                bucket.append(traj)
                if len(bucket) == g:
                    bucket.sort(key=lambda t: t.group_index)
                    yield Group(task=tasks[ti], trajectories=done_by_task.pop(ti))
        finally:
            for f in pending:
                f.cancel()

    async def run_groups(
        self,
        make_env: EnvFactory,
        tasks: Sequence[Task],
        *,
        env_id: str = "",
        sink: JsonlSink | None = None,
        seed_offset: int = 0,
    ) -> list[Group]:
        """Like :meth:`stream_groups`, collected into a list in task order."""
        order = {id(t): i for i, t in enumerate(tasks)}
        groups = [
            grp
            async for grp in self.stream_groups(
                make_env, tasks, env_id=env_id, sink=sink, seed_offset=seed_offset
            )
        ]
        return sorted(groups, key=lambda grp: order.get(id(grp.task), 0))
