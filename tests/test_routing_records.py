"""Routing records (``return_routed_experts``): engine, server, client and trajectories.

Every record is checked against :class:`~agentrl.routing.RoutingCapture` over one
teacher-forced transformers forward of the same tokens on the same weights (float32, CPU):
the engine's rows must be equal, expert for expert, whatever the batching, padding, joins,
aborts and retracts. Version 0 is ``build_tiny_moe(seed=0)``; other seeds route differently.
"""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import sys
from typing import Any

import aiohttp
import numpy as np
import pytest
import torch

from agentrl.env import Env, StepResult
from agentrl.errors import ConfigError, ServerError
from agentrl.inference.base import SamplingParams
from agentrl.inference.client.sglang_client import SGLangClient
from agentrl.inference.engine import LocalEngine
from agentrl.inference.server.engine_server import serve
from agentrl.rollout.engine import JsonlSink, RolloutConfig, RolloutEngine
from agentrl.routing import RoutingCapture
from agentrl.tiny import build_tiny, build_tiny_moe
from agentrl.types import Message, RoutedExperts, Task, Trajectory

LAYERS, TOP_K = 3, 2  # the tiny-moe preset


@pytest.fixture(scope="module")
def models() -> dict[int, Any]:
    """Weights by seed: 0 is what every engine here starts with (and ``--model tiny-moe``)."""
    torch.set_num_threads(1)
    return {seed: build_tiny_moe(seed=seed)[0] for seed in (0, 1)}


def teacher(model: Any, tokens: list[int]) -> np.ndarray:
    """The experts of ``tokens[:-1]`` under one teacher-forced forward, int16 (n - 1, L, K)."""
    with RoutingCapture(model) as cap, torch.no_grad():
        model(input_ids=torch.tensor([tokens[:-1]]))
    return cap.pop().numpy().astype(np.int16)


def engine_moe(**kw: Any) -> LocalEngine:
    model, tokenizer = build_tiny_moe(seed=0)
    return LocalEngine(model, tokenizer, seed=0, **kw)


def params(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


async def until_tokens(engine: LocalEngine, rid: str, n: int) -> None:
    async with asyncio.timeout(30):
        while (engine.num_output_tokens(rid) or 0) < n:
            await asyncio.sleep(0.001)


async def test_engine_records_equal_teacher_forced_routing(models) -> None:
    engine = engine_moe(max_batch_size=8)
    assert engine.return_routed_experts  # on by default for an MoE model in process
    prompts = {"a": [1, 5, 6, 7, 8, 9, 10], "b": [1, 11], "c": list(range(12, 40))}
    first = {
        rid: asyncio.create_task(
            engine.generate(p, params(24), rid=rid, return_routed_experts=True)
        )
        for rid, p in prompts.items()
    }
    await until_tokens(engine, "a", 5)  # newcomers join a running, left-padded batch
    late = {"d": [1, 20, 21, 22], "e": list(range(40, 52))}
    second = {
        rid: asyncio.create_task(
            engine.generate(p, params(6 + len(p)), rid=rid, return_routed_experts=True)
        )
        for rid, p in late.items()
    }
    plain = await engine.generate([1, 30, 31], params(5), rid="plain")
    outs = {rid: await task for rid, task in (first | second).items()}
    await engine.aclose()

    assert plain.routed_experts is None  # only requests that ask carry rows
    for rid, out in outs.items():
        tokens = (prompts | late)[rid] + out.output_ids
        got = out.routed_experts
        assert got is not None and got.dtype == np.int16
        assert got.shape == (len(tokens) - 1, LAYERS, TOP_K), rid
        np.testing.assert_array_equal(got, teacher(models[0], tokens), err_msg=rid)
        assert len(np.unique(got)) > TOP_K  # the routing depends on the token


async def test_abort_keeps_its_rows_and_queued_requests_have_none(models) -> None:
    engine = engine_moe(max_batch_size=1)
    running = asyncio.create_task(
        engine.generate([1, 5, 6, 7], params(200), rid="long", return_routed_experts=True)
    )
    queued = asyncio.create_task(
        engine.generate([1, 8, 9], params(4), rid="queued", return_routed_experts=True)
    )
    await until_tokens(engine, "long", 6)
    await engine.abort("queued")  # still waiting: never went through the model
    await engine.abort("long")  # in flight: keeps the token of the step being computed
    out, waited = await running, await queued
    await engine.aclose()
    assert out.finish_reason == "abort" and 6 <= len(out.output_ids) < 200
    tokens = [1, 5, 6, 7] + out.output_ids
    np.testing.assert_array_equal(out.routed_experts, teacher(models[0], tokens))
    assert waited.finish_reason == "abort" and waited.output_ids == []
    assert waited.routed_experts is not None and waited.routed_experts.shape == (2, LAYERS, TOP_K)
    assert (waited.routed_experts == -1).all()  # rows never computed route freely in replay


async def test_start_len_leaves_the_rows_known_already_out(models) -> None:
    engine = engine_moe()
    prompt = [1, 5, 6, 7, 8, 9]
    out = await engine.generate(
        prompt, params(4), return_routed_experts=True, routed_experts_start_len=4
    )
    got = out.routed_experts
    assert got is not None and got.shape == (len(prompt) + 4 - 1, LAYERS, TOP_K)
    assert (got[:4] == -1).all()
    np.testing.assert_array_equal(got[4:], teacher(models[0], prompt + out.output_ids)[4:])
    with pytest.raises(ServerError, match="routed_experts_start_len=7 is higher") as info:
        await engine.generate(
            prompt, params(2), return_routed_experts=True, routed_experts_start_len=7
        )
    assert info.value.status == 400
    await engine.aclose()


async def test_retract_keeps_the_rows_of_the_weights_that_sampled(models) -> None:
    engine = engine_moe()
    prompt = [1, 5, 6, 7, 8]
    task = asyncio.create_task(
        engine.generate(prompt, params(20), rid="r", return_routed_experts=True)
    )
    await until_tokens(engine, "r", 5)
    await engine.pause("retract")
    k = engine.num_output_tokens("r")
    assert k is not None and 5 <= k < 20
    await engine.update_weights_from_state_dict(models[1].state_dict(), 1)
    await engine.resume()  # the cache is recomputed on version 1
    out = await task
    await engine.aclose()
    assert out.versions == [0] * k + [1] * (20 - k)
    tokens = prompt + out.output_ids
    cut = len(prompt) + k - 1  # rows before it predicted the tokens version 0 sampled
    got = out.routed_experts
    assert got is not None and got.shape == (len(tokens) - 1, LAYERS, TOP_K)
    np.testing.assert_array_equal(got[:cut], teacher(models[0], tokens)[:cut])
    np.testing.assert_array_equal(got[cut:], teacher(models[1], tokens)[cut:])
    assert (teacher(models[0], tokens) != teacher(models[1], tokens)).any()  # a real change


async def test_dense_engine_refuses_clearly() -> None:
    model, tokenizer = build_tiny()
    with pytest.raises(ConfigError, match="dense model"):
        LocalEngine(model, tokenizer, return_routed_experts=True)
    engine = LocalEngine(model, tokenizer)
    assert not engine.return_routed_experts
    with pytest.raises(ServerError, match="Qwen3ForCausalLM is a dense model") as info:
        await engine.generate([1, 5], params(2), return_routed_experts=True)
    assert info.value.status == 400
    await engine.aclose()
    moe = engine_moe(return_routed_experts=False)
    with pytest.raises(ServerError, match="--enable-return-routed-experts") as info:
        await moe.generate([1, 5], params(2), return_routed_experts=True)
    assert info.value.status == 400
    await moe.aclose()


async def post(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        async with http.post(url + "/generate", json=body) as resp:
            return resp.status, json.loads(await resp.text())


async def test_server_to_client_round_trip(tiny_server_factory, models) -> None:
    server = tiny_server_factory("--model", "tiny-moe", "--enable-return-routed-experts")
    prompt = [1, 5, 6, 7, 8, 9]
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 7, "ignore_eos": True}}
    status, raw = await post(server.url, body | {"return_routed_experts": True})
    assert status == 200, raw
    ids, meta = raw["output_ids"], raw["meta_info"]
    flat = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype="<i4")
    rows = meta["prompt_tokens"] + meta["completion_tokens"] - 1  # SGLang's count
    assert rows == len(prompt) + 7 - 1 and flat.size == rows * LAYERS * TOP_K
    want = teacher(models[0], prompt + ids)
    np.testing.assert_array_equal(flat.reshape(rows, LAYERS, TOP_K), want)
    status, raw = await post(server.url, body)
    assert status == 200 and "routed_experts" not in raw["meta_info"]  # only when asked
    tail = body | {"return_routed_experts": True, "routed_experts_start_len": 4}
    status, raw = await post(server.url, tail)
    flat = np.frombuffer(base64.b64decode(raw["meta_info"]["routed_experts"]), dtype="<i4")
    want = teacher(models[0], prompt + raw["output_ids"])
    np.testing.assert_array_equal(flat.reshape(-1, LAYERS, TOP_K), want[4:])  # rows [4, n - 1)
    status, raw = await post(server.url, tail | {"routed_experts_start_len": -1})
    assert status == 400 and "is lower than 0" in raw["error"]["message"]

    for shape in (None, (LAYERS, TOP_K)):  # read from /model_info, or given
        async with SGLangClient(server.url, routed_experts_shape=shape) as client:
            out = await client.generate(prompt, params(9), return_routed_experts=True)
            plain = await client.generate(prompt, params(3))
            part = await client.generate(
                prompt, params(5), return_routed_experts=True, routed_experts_start_len=6
            )
        assert part.routed_experts is not None and (part.routed_experts[:6] == -1).all()
        np.testing.assert_array_equal(
            part.routed_experts[6:], teacher(models[0], prompt + part.output_ids)[6:]
        )
        assert out.routed_experts is not None and out.routed_experts.dtype == np.int16
        np.testing.assert_array_equal(
            out.routed_experts, teacher(models[0], prompt + out.output_ids)
        )
        assert plain.routed_experts is None
    async with SGLangClient(server.url, routed_experts_shape=(LAYERS + 1, TOP_K)) as client:
        with pytest.raises(ServerError, match="routed_experts: .* do not hold"):
            await client.generate(prompt, params(2), return_routed_experts=True)


async def test_server_without_the_flag_or_dense_says_why(tiny_server) -> None:
    engine = engine_moe(return_routed_experts=False)  # like `agentrl serve` without the flag
    urls: asyncio.Queue[str] = asyncio.Queue()
    stop = asyncio.Event()
    serving = asyncio.create_task(
        serve(engine, port=0, model_path="tiny-moe", on_ready=urls.put_nowait, stop=stop)
    )
    url = await asyncio.wait_for(urls.get(), 60)
    body = {"input_ids": [1, 5, 6], "sampling_params": {"max_new_tokens": 2}}
    try:
        status, raw = await post(url, body | {"return_routed_experts": True})
        assert status == 400
        assert "started without --enable-return-routed-experts" in raw["error"]["message"]
        async with SGLangClient(url) as client:
            with pytest.raises(ServerError, match="--enable-return-routed-experts") as info:
                await client.generate([1, 5, 6], params(2), return_routed_experts=True)
            assert info.value.status == 400
            assert (await client.model_info())["routed_experts_shape"] == [LAYERS, TOP_K]
        status, raw = await post(url, body | {"return_routed_experts": "yes"})
        assert status == 400 and "expected a boolean" in raw["error"]
    finally:
        stop.set()
        await serving
    status, raw = await post(tiny_server.url, body | {"return_routed_experts": True})
    assert status == 400 and "is a dense model" in raw["error"]["message"]


def test_serve_refuses_the_flag_for_a_dense_model() -> None:
    cmd = [sys.executable, "-m", "agentrl.cli", "serve", "--model", "tiny", "--port", "0"]
    done = subprocess.run(
        [*cmd, "--enable-return-routed-experts"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    line = "agentrl: error: return_routed_experts: Qwen3ForCausalLM is a dense model"
    assert done.stderr.startswith(line)
    assert "Traceback" not in done.stderr


class Turns(Env):
    """``task.data["turns"]`` assistant turns with a user reply in between (and after the last)."""

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[list[Message], dict]:
        self.left = int(task.data["turns"])
        return [Message(role="user", content=task.prompt)], {}

    async def step(self, action: str) -> StepResult:
        self.left -= 1
        return StepResult([Message(role="user", content=f"go on ({self.left})")])


def rollout_config(**kw: Any) -> RolloutConfig:
    base = dict(group_size=2, max_turns=3, max_new_tokens=6, max_total_tokens=512, seed=3)
    return RolloutConfig(**{**base, "ignore_eos": True, **kw})


class Asks:
    """The engine, with the routing arguments of every generate call."""

    def __init__(self, inner: LocalEngine) -> None:
        self.inner, self.asked = inner, list[tuple[int, dict[str, Any]]]()

    async def generate(self, input_ids: list[int], params: SamplingParams, **kw: Any) -> Any:
        self.asked.append((len(input_ids), {k: v for k, v in kw.items() if "routed" in k}))
        return await self.inner.generate(input_ids, params, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def test_multi_turn_episode_rows_and_jsonl_round_trip(models, tmp_path) -> None:
    engine = engine_moe()
    client = Asks(engine)
    rollout = RolloutEngine(client, engine.tokenizer, rollout_config())
    assert rollout.routed  # default: on, because the embedded engine records routing
    task = Task(id="t", prompt="Count with me.", data={"turns": 3})
    sink = JsonlSink(tmp_path / "rollouts.jsonl")
    (group,) = await rollout.run_groups(Turns, [task], sink=sink)
    sink.close()
    await engine.aclose()
    # Later turns ask only for the rows after those known: prompt + earlier turns' rows.
    starts = sorted(kw["routed_experts_start_len"] for _, kw in client.asked)
    assert starts[:2] == [0, 0] and all(s > 0 for s in starts[2:]) and len(starts) == 6
    for n_input, kw in client.asked:
        assert kw["return_routed_experts"] and kw["routed_experts_start_len"] <= n_input
    for t in group.trajectories:
        assert not t.failed and t.finish_reason == "max_turns"
        assert [s.kind for s in t.turns] == ["assistant", "observation"] * 3
        got = t.routed_experts.array()
        assert got.shape == (len(t.tokens) - 1, LAYERS, TOP_K)
        last = t.turns[-2].end - 1  # the last call fed tokens[:last]; then an observation
        np.testing.assert_array_equal(got[:last], teacher(models[0], t.tokens)[:last])
        assert (got[last:] == -1).all() and len(got) - last == t.turns[-1].end - t.turns[-1].start

    lines = (tmp_path / "rollouts.jsonl").read_text().splitlines()
    loaded = [Trajectory.model_validate(json.loads(line)["trajectory"]) for line in lines]
    by_index = {t.group_index: t for t in loaded}
    for t in group.trajectories:
        back = by_index[t.group_index]
        assert back == t
        np.testing.assert_array_equal(back.routed_experts.array(), t.routed_experts.array())
        stored = json.loads(lines[0])["trajectory"]["routed_experts"]
        assert set(stored) == {"layers", "top_k", "data"}  # base64 int16: ~2.7 bytes an id


class Once(Env):
    """One assistant turn, then the episode ends."""

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[list[Message], dict]:
        return [Message(role="user", content=task.prompt)], {}

    async def step(self, action: str) -> StepResult:
        return StepResult(reward=1.0, terminated=True)


class Opened:
    """The engine, with the ids of the requests in flight."""

    def __init__(self, inner: LocalEngine) -> None:
        self.inner, self.open = inner, set[str]()

    async def generate(self, input_ids: list[int], params: SamplingParams, **kw: Any) -> Any:
        self.open.add(kw["rid"])
        try:
            return await self.inner.generate(input_ids, params, **kw)
        finally:
            self.open.discard(kw["rid"])

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def test_partial_rollout_rows_come_from_the_version_that_sampled(models) -> None:
    engine = engine_moe()
    client = Opened(engine)
    config = rollout_config(max_new_tokens=40, group_size=1)
    rollout = RolloutEngine(client, engine.tokenizer, config)
    task = Task(id="p", prompt="Tell me a long story.")
    running = asyncio.create_task(rollout.run_groups(Once, [task]))
    async with asyncio.timeout(30):
        while not client.open:
            await asyncio.sleep(0.001)
    (rid,) = client.open
    await until_tokens(engine, rid, 6)
    await rollout.interrupt()  # aborts: the turn resumes on version 1 from prompt + partial
    await engine.update_weights_from_state_dict(models[1].state_dict(), 1)
    await rollout.release()
    (group,) = await running
    await engine.aclose()
    for t in group.trajectories:
        assert not t.failed and set(t.versions[t.prompt_len :]) == {0, 1}
        got = t.routed_experts.array()
        by_version = {v: teacher(models[v], t.tokens) for v in (0, 1)}
        for p in range(t.prompt_len, len(t.tokens)):  # row p - 1 predicted sampled token p
            np.testing.assert_array_equal(got[p - 1], by_version[t.versions[p]][p - 1])


def test_rollout_config_true_needs_an_engine_that_records() -> None:
    model, tokenizer = build_tiny()
    engine = LocalEngine(model, tokenizer)
    with pytest.raises(ConfigError, match="rollout.return_routed_experts"):
        RolloutEngine(engine, tokenizer, rollout_config(return_routed_experts=True))
    assert not RolloutEngine(engine, tokenizer, rollout_config()).routed


def test_routed_experts_model_round_trip_and_validation() -> None:
    arr = np.arange(-1, 29, dtype=np.int64).reshape(5, 3, 2)
    packed = RoutedExperts.from_array(arr)
    assert (packed.layers, packed.top_k, packed.rows) == (3, 2, 5)
    back = RoutedExperts.model_validate_json(packed.model_dump_json()).array()
    assert back.dtype == np.int16 and back.shape == (5, 3, 2)
    np.testing.assert_array_equal(back, arr)
    assert base64.b64decode(packed.data) == arr.astype("<i2").tobytes()  # int16 little-endian
    with pytest.raises(ValueError, match="not whole rows"):
        RoutedExperts(layers=3, top_k=2, data=base64.b64encode(b"\0" * 10).decode())
    with pytest.raises(ValueError, match="ids in"):
        RoutedExperts.from_array(np.full((1, 1, 1), 40000))
    with pytest.raises(ValueError, match="integer"):
        RoutedExperts.from_array(np.zeros((1, 1, 1)))
    tokens = [1, 2, 3]
    fields: dict[str, Any] = dict(
        task_id="x", env_id="e", tokens=tokens, loss_mask=[0] * 3, logprobs=[0.0] * 3
    )
    fields["versions"] = [-1] * 3
    ok = Trajectory(**fields, routed_experts=RoutedExperts.from_array(arr[:2]))
    assert Trajectory.model_validate_json(ok.model_dump_json()) == ok
    with pytest.raises(ValueError, match="expected 2 rows"):
        Trajectory(**fields, routed_experts=RoutedExperts.from_array(arr[:3]))
