"""Partial rollouts: generations cut off by a weight update resume on the new weights.

Every test runs the real tiny model: in process (``LocalEngine``) or behind ``agentrl serve``
(``scratch_server``). Version 0 is ``build_tiny(seed=0)``; later versions load other seeds, so
log-probs tell the versions apart, and each token's recorded log-prob is checked against a
teacher-forced pass of the version that sampled it.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch

from agentrl.env import Env, StepResult
from agentrl.inference.client.sglang_client import SGLangClient
from agentrl.inference.engine import LocalEngine
from agentrl.inference.server.engine_server import serve
from agentrl.inference.sglang_api import parse_weight_version
from agentrl.rollout.engine import RolloutConfig, RolloutEngine
from agentrl.tiny import build_tiny
from agentrl.types import Message, Task, Trajectory

TOL = 1e-4


class Turns(Env):
    """Ends after ``task.data["turns"]`` assistant turns; says "go on" in between."""

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[list[Message], dict]:
        self.left = int(task.data.get("turns", 1))
        return [Message(role="user", content=task.prompt)], {}

    async def step(self, action: str) -> StepResult:
        self.left -= 1
        if self.left == 0:
            return StepResult(reward=float(len(action) % 2), terminated=True)
        return StepResult([Message(role="user", content="go on")])


class Recording:
    """The real client, with every generate call recorded (rid, input ids, output)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: list[tuple[str, list[int], Any]] = []
        self.open: set[str] = set()

    async def generate(self, input_ids, params, *, rid=None, session_id=None):
        self.open.add(rid)
        try:
            out = await self.inner.generate(list(input_ids), params, rid=rid, session_id=session_id)
        finally:
            self.open.discard(rid)
        self.calls.append((rid, list(input_ids), out))
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class AbortOnly(Recording):
    """A client without pause/continue: interrupts fall back to ``abort(None)``."""

    def __getattr__(self, name: str) -> Any:
        if name in ("pause", "continue_generation"):
            raise AttributeError(name)
        return getattr(self.inner, name)


async def open_rids(client: Recording, n: int) -> list[str]:
    """The ids of the first ``n`` requests in flight (unique per episode attempt)."""
    async with asyncio.timeout(20):
        while len(client.open) < n:
            await asyncio.sleep(0.001)
    return sorted(client.open)


@pytest.fixture(scope="module")
def models() -> dict[int, Any]:
    """Weights by seed: 0 is what the engine starts with."""
    torch.set_num_threads(1)
    return {seed: build_tiny(seed=seed)[0] for seed in (0, 1, 2, 3)}


def teacher(model: Any, tokens: list[int], temperature: float = 1.0) -> list[float]:
    """``logprob[p]`` of ``tokens[p]`` given ``tokens[:p]`` (0.0 at p = 0), one forward pass."""
    ids = torch.tensor([tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1].float() / temperature
    lp = torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None])[:, 0]
    return [0.0, *lp.tolist()]


def check_logprobs(t: Trajectory, model_of: dict[int, Any]) -> None:
    """Each sampled token's log-prob is the teacher-forced one of the version that sampled it."""
    for version in sorted({v for v, m in zip(t.versions, t.loss_mask, strict=True) if m}):
        ref = teacher(model_of[version], t.tokens)
        for p, (m, v) in enumerate(zip(t.loss_mask, t.versions, strict=True)):
            if m and v == version:
                assert abs(t.logprobs[p] - ref[p]) < TOL, (p, version, t.logprobs[p], ref[p])


def one_turn_config(**kw: Any) -> RolloutConfig:
    base = dict(group_size=1, max_turns=1, max_new_tokens=64, max_total_tokens=512, seed=5)
    return RolloutConfig(**{**base, "ignore_eos": True, **kw})


@pytest.mark.parametrize("wrapper", [Recording, AbortOnly])
async def test_interrupted_turn_resumes_on_new_weights(models, wrapper) -> None:
    engine = LocalEngine(build_tiny(seed=0)[0], build_tiny()[1], max_batch_size=8)
    client = wrapper(engine)
    rollout = RolloutEngine(client, engine.tokenizer, one_turn_config())
    task = Task(id="long", prompt="Tell me a long story.", data={"turns": 1})
    running = asyncio.create_task(rollout.run_groups(Turns, [task]))
    (rid,) = await open_rids(client, 1)
    assert rid.startswith("long#0@5~") and rid.endswith("/t0")  # task#index@seed~attempt/turn
    while (engine.num_output_tokens(rid) or 0) < 8:
        await asyncio.sleep(0.001)
    await rollout.interrupt()
    assert engine.paused == (wrapper is Recording)
    await engine.update_weights_from_state_dict(models[1].state_dict(), 1)
    await rollout.release()
    (group,) = await running
    await engine.aclose()

    (t,) = group.trajectories
    assert not t.failed and t.finish_reason == "terminated"
    n = t.prompt_len
    out, versions = t.tokens[n:], t.versions[n:]
    k = versions.count(0)
    assert len(out) == 64 and versions == [0] * k + [1] * (64 - k)
    assert 8 <= k < 64
    assert t.info == {"interruptions": 1, "resumes": 1}
    # the first request sampled the prefix; the second continued from prompt + prefix
    (rid0, in0, out0), (rid1, in1, out1) = client.calls
    assert (rid0, rid1) == (rid, rid + ".r1")
    assert out0.finish_reason == "abort" and out0.output_ids == out[:k]
    assert in1 == t.tokens[:n] + out[:k] and out1.output_ids == out[k:]
    assert out1.finish_reason == "length"
    check_logprobs(t, {0: models[0], 1: models[1]})
    v0, v1 = teacher(models[0], t.tokens), teacher(models[1], t.tokens)
    assert max(abs(a - b) for a, b in zip(v0[n:], v1[n:], strict=True)) > 0.1  # distinguishable


async def test_episodes_started_as_an_interrupt_begins_sample_only_the_new_weights(models):
    # ``then`` runs with the gate closed, before the step in flight ends: the episodes it
    # starts prepare meanwhile; the embedded engine, once paused, queues their requests
    engine = LocalEngine(build_tiny(seed=0)[0], build_tiny()[1], max_batch_size=8)
    client = Recording(engine)
    rollout = RolloutEngine(client, engine.tokenizer, one_turn_config())
    first = asyncio.create_task(
        rollout.run_groups(Turns, [Task(id="a", prompt="Tell me.", data={"turns": 1})])
    )
    (rid,) = await open_rids(client, 1)
    async with asyncio.timeout(20):
        while (engine.num_output_tokens(rid) or 0) < 4:
            await asyncio.sleep(0.001)
    later: list[asyncio.Task[Any]] = []

    def then() -> None:
        assert not engine.paused  # the pause has not begun
        task = Task(id="b", prompt="Go on.", data={"turns": 1})
        later.append(asyncio.create_task(rollout.run_groups(Turns, [task])))

    await rollout.interrupt(then=then)
    assert engine.paused and len(later) == 1
    async with asyncio.timeout(20):  # a's re-sent turn and b's first one, queued
        while engine.stats()["num_waiting_reqs"] < 2:
            await asyncio.sleep(0.001)
    await engine.update_weights_from_state_dict(models[1].state_dict(), 1)
    await rollout.release()
    (group_a,), (group_b,) = await first, await later[0]
    (a,), (b,) = group_a.trajectories, group_b.trajectories
    await engine.aclose()
    assert a.info == {"interruptions": 1, "resumes": 1} and 0 in a.versions
    assert set(b.versions[b.prompt_len :]) == {1} and len(b.tokens) - b.prompt_len == 64
    for t in (a, b):
        check_logprobs(t, {0: models[0], 1: models[1]})


@pytest.mark.parametrize("http", [False, True])
async def test_resumed_turns_are_prefilled_in_one_batch(models, http) -> None:
    # After a weight update every interrupted turn re-sends prompt + partial output; release()
    # lets them queue while the engine is still paused, so one forward prefills them all.
    # ``http``: the engine behind agentrl's SGLang server on its own event loop in a thread of
    # this process (so that its counts can be read), as in ``agentrl serve``.
    engine = LocalEngine(build_tiny(seed=0)[0], build_tiny()[1], max_batch_size=8)
    if http:
        loop, urls = asyncio.new_event_loop(), queue.Queue[str]()
        stop = asyncio.Event()
        thread = threading.Thread(
            target=loop.run_until_complete,
            args=(serve(engine, port=0, on_ready=urls.put, stop=stop),),
        )
        thread.start()
        inner: Any = SGLangClient([await asyncio.to_thread(urls.get, timeout=20)])
    else:
        inner = engine
    client = Recording(inner)
    rollout = RolloutEngine(client, engine.tokenizer, one_turn_config(group_size=6))
    task = Task(id="batch", prompt="Count.", data={"turns": 1})
    running = asyncio.create_task(rollout.run_groups(Turns, [task]))
    rids = await open_rids(client, 6)
    async with asyncio.timeout(20):
        while min(engine.num_output_tokens(r) or 0 for r in rids) < 4:
            await asyncio.sleep(0.001)
    await rollout.interrupt()
    update = engine.update_weights_from_state_dict(models[1].state_dict(), 1)
    if http:
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(update, loop))
        await asyncio.sleep(0.05)  # an SGLang-like server: the turns wait at the gate
        assert engine.stats()["num_waiting_reqs"] == 0
    else:
        await update
        async with asyncio.timeout(20):  # the embedded engine queues them while it is paused
            while engine.stats()["num_waiting_reqs"] < 6:
                await asyncio.sleep(0.001)
    before = engine.prefill_stats()
    await rollout.release()
    (group,) = await running
    after = engine.prefill_stats()
    if http:
        await inner.aclose()
        loop.call_soon_threadsafe(stop.set)
        await asyncio.to_thread(thread.join, 20)
        loop.close()
    else:
        await engine.aclose()
    resent = [call for call in client.calls if call[0].endswith(".r1")]
    assert len(resent) == 6
    assert after["steps"] - before["steps"] == 1
    assert after["requests"] - before["requests"] == 6
    assert after["tokens"] - before["tokens"] == sum(len(ids) for _, ids, _ in resent)
    for t in group.trajectories:
        assert t.info == {"interruptions": 1, "resumes": 1}
        check_logprobs(t, {0: models[0], 1: models[1]})


async def test_many_interruptions_lose_and_duplicate_nothing(models) -> None:
    engine = LocalEngine(build_tiny(seed=0)[0], build_tiny()[1], max_batch_size=32)
    client = Recording(engine)
    cfg = one_turn_config(group_size=3, max_turns=3, max_new_tokens=16, seed=11)
    rollout = RolloutEngine(client, engine.tokenizer, cfg)
    tasks = [Task(id=f"t{i}", prompt=f"Task {i}.", data={"turns": 1 + i % 3}) for i in range(8)]
    model_of = {0: models[0]}
    done = asyncio.Event()

    async def update_weights_repeatedly() -> None:
        version = 0
        while not done.is_set():
            await asyncio.sleep(0.005)
            # each resume re-prefills: cut only after some progress, or nothing would finish
            if sum(engine.num_output_tokens(rid) or 0 for rid in client.open) < 20:
                continue
            await rollout.interrupt()
            version += 1
            model_of[version] = models[version % 2]  # 0, 1, 0, 1, ...: adjacent versions differ
            await engine.update_weights_from_state_dict(model_of[version].state_dict(), version)
            await rollout.release()

    updater = asyncio.create_task(update_weights_repeatedly())
    groups = [group async for group in rollout.stream_groups(Turns, tasks)]
    done.set()
    await updater
    await engine.aclose()

    # every task's G episodes arrived, each exactly once
    assert sorted(g.task.id for g in groups) == sorted(t.id for t in tasks)
    assert all([t.group_index for t in g.trajectories] == [0, 1, 2] for g in groups)
    trajs = [t for g in groups for t in g.trajectories]
    for t in trajs:
        assert not t.failed, t.error
        sampled = [v for v, m in zip(t.versions, t.loss_mask, strict=True) if m]
        assert sampled == sorted(sampled)  # weights only move forward
        assert len(sampled) == 16 * (1 + int(t.task_id[1:]) % 3)  # no token lost or repeated
        check_logprobs(t, model_of)
    assert sum(t.info["interruptions"] for t in trajs) >= 5  # the updates did cut generations
    assert sum(t.info["resumes"] > 0 for t in trajs) >= 3
    assert sum(len(set(t.versions[t.prompt_len :]) - {-1}) > 1 for t in trajs) >= 3
    rids = [rid for rid, _, _ in client.calls]
    assert len(rids) == len(set(rids))  # every resumed request got a new rid


def load_version(url: str) -> int:
    with urllib.request.urlopen(url + "/model_info", timeout=10) as resp:
        return parse_weight_version(json.loads(resp.read())["weight_version"])


async def wait_running(url: str) -> None:
    for _ in range(2000):
        with urllib.request.urlopen(url + "/v1/loads", timeout=10) as resp:
            if json.loads(resp.read())["loads"][0]["num_running_reqs"] > 0:
                return
        await asyncio.sleep(0.005)
    raise TimeoutError("the request never started running")


async def test_partial_rollout_through_agentrl_serve(scratch_server, models, tmp_path: Path):
    url = scratch_server.url
    dirs = {}
    for seed in (2, 3):
        dirs[seed] = tmp_path / f"seed{seed}"
        models[seed].save_pretrained(dirs[seed])
    async with SGLangClient([url]) as client:
        v = load_version(url) + 1
        await client.update_weights_from_disk(str(dirs[2]), v)
        tokenizer = build_tiny()[1]
        rollout = RolloutEngine(client, tokenizer, one_turn_config(max_new_tokens=300))
        task = Task(id="http", prompt="Go.", data={"turns": 1})
        running = asyncio.create_task(rollout.run_groups(Turns, [task]))
        await wait_running(url)
        await asyncio.sleep(0.05)
        await rollout.interrupt()
        try:
            await client.update_weights_from_disk(str(dirs[3]), v + 1)
        finally:
            await rollout.release()
        (group,) = await running
    (t,) = group.trajectories
    assert not t.failed, t.error
    versions = t.versions[t.prompt_len :]
    k = versions.count(v)
    assert len(versions) == 300 and versions == [v] * k + [v + 1] * (300 - k)
    assert 0 < k < 300
    assert t.info["resumes"] == 1
    check_logprobs(t, {v: models[2], v + 1: models[3]})
