"""Adapter-only weight sync (``learner.lora``): the client's SGLang calls and the trainer's push.

The client's bodies are recorded by a loopback server that answers as SGLang does; the trainer
pushes to a real embedded engine (its method spied on, not replaced) and to a real
``agentrl serve`` process, and both then serve the learner's log-probs.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from aiohttp import web
from conftest import _teacher_logprobs, start_tiny_server

from agentrl.config import load_config
from agentrl.errors import ServerError
from agentrl.inference.base import SamplingParams
from agentrl.inference.client.sglang_client import SGLangClient
from agentrl.loop.assemble import assemble
from agentrl.loop.placement import push_adapter
from agentrl.loop.trainer import Trainer

PROMPT = [1, 19, 37, 37, 27, 38]


class FakeSGLang:
    """A loopback server that records bodies and answers like SGLang's adapter routes.

    ``/generate`` waits for ``release`` when ``hold`` is set (a request kept in flight).
    """

    def __init__(self) -> None:
        self.bodies: list[tuple[str, dict[str, Any]]] = []
        self.loaded: dict[str, str] = {}
        self.hold = False
        self.release = asyncio.Event()
        self.url = ""
        self._runner: web.AppRunner | None = None

    def result(self, error: str = "") -> web.Response:
        body = {"success": not error, "error_message": error, "loaded_adapters": self.loaded}
        return web.json_response(body, status=400 if error else 200)

    async def load(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append((request.path, body))
        if body["lora_name"] in self.loaded:
            return self.result(f"LoRA adapter {body['lora_name']} is already loaded")
        self.loaded[body["lora_name"]] = body["lora_path"]
        return self.result()

    async def unload(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append((request.path, body))
        if self.loaded.pop(body["lora_name"], None) is None:
            return self.result(f"LoRA adapter {body['lora_name']} is not loaded")
        return self.result()

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append((request.path, body))
        name = body.get("lora_path")
        if name is not None and name not in self.loaded:  # SGLang's refusal
            why = f"The following requested LoRA adapters are not loaded: {name}"
            return web.json_response({"error": {"message": why}}, status=400)
        if self.hold:
            await self.release.wait()
        meta = {
            "output_token_logprobs": [[-0.5, 7, None], [-0.25, 8, None]],
            "finish_reason": {"type": "length", "length": 2},
            "weight_version": "default",  # SGLang's label is the base model's
            "prompt_tokens": len(body["input_ids"]),
        }
        return web.json_response({"output_ids": [7, 8], "meta_info": meta})

    async def start(self) -> FakeSGLang:
        app = web.Application()
        app.router.add_post("/load_lora_adapter", self.load)
        app.router.add_post("/unload_lora_adapter", self.unload)
        app.router.add_post("/generate", self.generate)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def paths(self) -> list[str]:
        return [p for p, _ in self.bodies]


async def test_client_adapter_calls_follow_sglang_contract() -> None:
    servers = [await FakeSGLang().start() for _ in range(2)]
    params = SamplingParams(max_new_tokens=2)
    try:
        async with SGLangClient([s.url for s in servers], stall_s=None) as client:
            base = await client.generate([1, 2], params)
            await client.load_lora_adapter("run-v1", "/adapters/v1")
            await client.use_lora_adapter("run-v1", 1)
            out = await client.generate([1, 2], params)
            with pytest.raises(ServerError, match=r"/load_lora_adapter 'run-v1' failed: .*already"):
                await client.load_lora_adapter("run-v1", "/adapters/v1")
            with pytest.raises(ValueError, match="lora_name"):
                await client.unload_lora_adapter("x" * 257)
    finally:
        for s in servers:
            await s.close()
    assert "lora_path" not in next(b for p, b in servers[0].bodies if p == "/generate")
    assert base.versions == [0, 0]  # the base model's label
    assert out.versions == [1, 1] and out.weight_version == 1  # labelled with the adapter's
    for s in servers:  # every endpoint got the load, with SGLang's keys only
        loads = [b for p, b in s.bodies if p == "/load_lora_adapter"]
        assert loads[0] == {"lora_name": "run-v1", "lora_path": "/adapters/v1"}
        assert s.loaded == {"run-v1": "/adapters/v1"}
    generated = [b for s in servers for p, b in s.bodies if p == "/generate"]
    assert [b.get("lora_path") for b in generated] == [None, "run-v1"]  # (one each)


async def test_old_adapter_unloaded_once_its_request_finishes() -> None:
    server = await FakeSGLang().start()
    params = SamplingParams(max_new_tokens=2)
    try:
        async with SGLangClient(server.url, stall_s=None) as client:
            await client.load_lora_adapter("run-v1", "/a/v1")
            await client.use_lora_adapter("run-v1", 1)
            server.hold = True
            slow = asyncio.create_task(client.generate([1, 2], params))
            while "/generate" not in server.paths():
                await asyncio.sleep(0.005)
            server.hold = False
            await client.load_lora_adapter("run-v2", "/a/v2")
            await client.use_lora_adapter("run-v2", 2)
            new = await client.generate([1, 3], params)
            assert "/unload_lora_adapter" not in server.paths()  # v1 still serves `slow`
            assert client.lora_names == {"run-v1", "run-v2"}
            server.release.set()
            old = await slow
            for _ in range(200):
                if "/unload_lora_adapter" in server.paths():
                    break
                await asyncio.sleep(0.005)
            await client.load_lora_adapter("run-v3", "/a/v3")
            await client.use_lora_adapter("run-v3", 3)  # nothing in flight on v2: unloaded now
    finally:
        await server.close()
    assert (old.versions, new.versions) == ([1, 1], [2, 2])
    unloads = [b for p, b in server.bodies if p == "/unload_lora_adapter"]
    assert unloads == [{"lora_name": "run-v1"}, {"lora_name": "run-v2"}]
    assert server.loaded == {"run-v3": "/a/v3"}
    assert server.paths().index("/unload_lora_adapter") > server.paths().index("/generate", 2)


async def test_a_restarted_endpoint_gets_the_adapter_again() -> None:
    server = await FakeSGLang().start()
    try:
        async with SGLangClient(server.url, stall_s=None) as client:
            await client.load_lora_adapter("run-v1", "/a/v1")
            await client.use_lora_adapter("run-v1", 1)
            server.loaded.clear()  # a restart: the base model only
            out = await client.generate([1, 2], SamplingParams(max_new_tokens=2))
            await client.use_lora_adapter("run-v2", 2)  # (not loaded: the server refuses)
            with pytest.raises(ServerError, match="not loaded: run-v2"):
                await client.generate([1, 2], SamplingParams(max_new_tokens=2))
    finally:
        await server.close()
    assert out.versions == [1, 1] and server.loaded == {}  # v1 unloaded as v2 came
    assert [b for p, b in server.bodies if p == "/load_lora_adapter"] == [
        {"lora_name": "run-v1", "lora_path": "/a/v1"}
    ] * 2
    assert [b.get("lora_path") for p, b in server.bodies if p == "/generate"] == [
        "run-v1",
        "run-v1",
        "run-v2",
    ]


async def test_push_replaces_an_adapter_left_by_a_resumed_run(tmp_path: Path) -> None:
    from agentrl.learner import Learner, LearnerConfig
    from agentrl.learner.config import LoraConfig
    from agentrl.tiny import build_tiny

    learner = Learner(build_tiny()[0], LearnerConfig(lora=LoraConfig(rank=2, alpha=4.0)))
    run = tmp_path / "run"
    for v in (0, 1, 2):  # older versions on disk, as a run before its resume left them
        (run / "adapters" / f"v{v}").mkdir(parents=True)
    server = await FakeSGLang().start()
    server.loaded["run-v3"] = "stale"  # loaded by the run before it was resumed
    try:
        async with SGLangClient(server.url, stall_s=None) as client:
            times = await push_adapter(learner, client, 3, run, remote=True)
            assert client.lora_adapter == ("run-v3", 3)
    finally:
        await server.close()
    path = str((run / "adapters" / "v3").resolve())
    assert server.loaded == {"run-v3": path}
    assert sorted(d.name for d in (run / "adapters").iterdir()) == ["v2", "v3"]
    assert (run / "adapters/v3/adapter_model.safetensors").is_file()
    assert times["time/sync_s"] >= times["time/weight_write_s"] > 0


def lora_run(run_dir: Path, **inference: Any) -> dict[str, Any]:
    return {
        "run_dir": str(run_dir),
        "seed": 5,
        "env": {"id": "arith-v0", "task_kwargs": {"digits": 1}, "num_train_tasks": 16,
                "num_eval_tasks": 4},
        "rollout": {"group_size": 2, "max_turns": 1, "max_new_tokens": 3, "max_total_tokens": 40},
        "cold_start": {"steps": 0},
        "advantages": {"shapers": [{"name": "overlong", "max_tokens": 3, "cache": 2}]},
        "learner": {"lr": 1e-2, "lora": {"rank": 4, "alpha": 8.0}},
        "inference": inference,
        "train": {"steps": 2, "tasks_per_step": 2, "eval_every": 0, "checkpoint_every": 0,
                  "max_staleness": 0},
    }  # fmt: skip


def learner_logprobs(trainer: Trainer, output: list[int]) -> list[float]:
    return _teacher_logprobs(trainer.learner.model, PROMPT, output)


def test_train_pushes_only_adapters_to_the_embedded_engine(tmp_path: Path) -> None:
    config = load_config(lora_run(tmp_path / "run"))
    parts = assemble(config)
    engine = parts.client
    pushed: list[tuple[str, dict[str, torch.Tensor], float, dict[str, Any]]] = []
    served: list[tuple[list[float], list[float]]] = []  # (engine, learner) after each push
    real = engine.load_lora_adapter_tensors

    async def spy(name: str, adapter: dict[str, torch.Tensor], scaling: float, **kw: Any) -> None:
        pushed.append((name, {k: v.clone() for k, v in adapter.items()}, scaling, kw))
        await real(name, adapter, scaling, **kw)
        out = await engine.generate(PROMPT, SamplingParams(max_new_tokens=4, seed=3))
        served.append((out.logprobs, learner_logprobs(trainer, out.output_ids)))

    engine.load_lora_adapter_tensors = spy  # the real engine, its calls recorded
    trainer = Trainer(config, parts=parts)
    asyncio.run(trainer.run())

    assert [p[0] for p in pushed] == ["run-v0", "run-v1", "run-v2"]
    assert [p[3] for p in pushed] == [{"weight_version": v} for v in (0, 1, 2)]
    assert all(p[2] == 2.0 for p in pushed)  # alpha / rank
    for _, adapter, _, _ in pushed:  # only adapter tensors, nothing of the base
        assert adapter and all(".lora_A." in k or ".lora_B." in k for k in adapter)
    assert any(t.abs().sum() > 0 for k, t in pushed[-1][1].items() if "lora_B" in k)
    assert list(engine.loaded_lora_adapters) == ["run-v2"]  # the older ones were unloaded
    assert engine.weight_version == 2
    for engine_logprobs, learner_side in served:
        assert engine_logprobs == pytest.approx(learner_side, abs=1e-5)
    assert served[0][0] != pytest.approx(served[-1][0], abs=1e-3)  # the adapters moved it
    lines = (tmp_path / "run/metrics.jsonl").read_text().splitlines()
    syncs = [r["time/sync_s"] for r in map(json.loads, lines) if "time/sync_s" in r]
    assert len(syncs) == 2 and all(s > 0 for s in syncs)  # the push is timed as before


@pytest.fixture(scope="module")
def lora_server() -> Any:
    server = start_tiny_server()
    yield server
    server.stop()


def test_train_pushes_adapters_to_agentrl_serve(tmp_path: Path, lora_server: Any) -> None:
    tree = lora_run(tmp_path / "run", endpoints=[lora_server.url])
    tree["seed"] = 0  # the served tiny model's weights (the learner's base)
    config = load_config(tree)
    trainer = Trainer(config)
    asyncio.run(trainer.run())

    adapters = tmp_path / "run/adapters"
    assert sorted(d.name for d in adapters.iterdir()) == ["v1", "v2"]  # v0 removed
    assert (adapters / "v2/adapter_config.json").is_file()

    async def served() -> tuple[Any, dict[str, Any]]:
        async with SGLangClient(lora_server.url) as client:
            await client.use_lora_adapter("run-v2", 2)  # (already loaded by the trainer's push)
            out = await client.generate(PROMPT, SamplingParams(max_new_tokens=4, seed=3))
            return out, await client._get_json("/get_server_info")

    out, info = asyncio.run(served())
    assert list(info["loaded_lora_adapters"]) == ["run-v2"]  # v0 and v1 were unloaded
    assert out.versions == [2] * len(out.output_ids)
    assert out.logprobs == pytest.approx(learner_logprobs(trainer, out.output_ids), abs=1e-5)


@pytest.mark.gpu
def test_adapter_push_on_a_card_serves_the_learner(tmp_path: Path) -> None:
    """The paged engine on a card, after each in-process adapter push (bf16-level tolerance)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA card")
    tree = lora_run(tmp_path / "run")
    tree["model"] = {"device": "cuda"}
    parts = assemble(load_config(tree))
    engine = parts.client
    trainer = Trainer(parts.config, parts=parts)
    gaps: list[float] = []
    real = engine.load_lora_adapter_tensors

    async def check(name: str, adapter: dict[str, torch.Tensor], scaling: float, **kw: Any) -> None:
        assert all(t.device.type == "cuda" for t in adapter.values())  # card to card
        await real(name, adapter, scaling, **kw)
        out = await engine.generate(PROMPT, SamplingParams(max_new_tokens=4, seed=3))
        ids = torch.tensor([PROMPT + out.output_ids], device="cuda")
        with torch.no_grad():
            logits = trainer.learner.model(input_ids=ids).logits[0, len(PROMPT) - 1 : -1].float()
        want = torch.log_softmax(logits, -1).gather(1, ids[0, len(PROMPT) :, None])[:, 0]
        gaps.append(float((torch.tensor(out.logprobs, device="cuda") - want).abs().max()))

    engine.load_lora_adapter_tensors = check
    asyncio.run(trainer.run())
    assert len(gaps) == 3 and max(gaps) < 2e-2, gaps
