"""SGLang's ``/update_weights_from_tensor`` between this process and a real ``agentrl serve``.

On a CPU host the tensors travel as shared-memory file names (CUDA IPC handles on a card):
the server opens them, so no weights cross the socket.
"""

from __future__ import annotations

import base64
import os
import pickle

import aiohttp
import pytest
import torch

from agentrl.errors import ServerError
from agentrl.inference.base import SamplingParams
from agentrl.inference.client.sglang_client import SGLangClient
from agentrl.inference.weight_ipc import dump_named_tensors, load_named_tensors
from agentrl.tiny import build_tiny_model

TOL = 1e-5  # float32 on CPU: the served log-probs equal a teacher-forced pass of the pushed model
PROMPT = [1, 30, 31]
PARAMS = SamplingParams(max_new_tokens=10, temperature=0.9, ignore_eos=True, seed=5)


def test_payload_round_trip_keeps_values_and_refuses_other_globals() -> None:
    t = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    b = torch.arange(6, dtype=torch.bfloat16)
    entry = dump_named_tensors([("a", t), ("b", b[2:])])
    assert not t.is_shared()  # the caller's tensor stays where it was
    (na, ta), (nb, tb) = load_named_tensors(entry)
    assert (na, nb) == ("a", "b") and torch.equal(ta, t) and torch.equal(tb, b[2:])
    assert tb.dtype is torch.bfloat16
    evil = base64.b64encode(pickle.dumps([("x", os.system)])).decode()
    with pytest.raises(ValueError, match="refused global"):
        load_named_tensors(evil)
    with pytest.raises(ValueError, match="unreadable"):
        load_named_tensors("not base64!")
    with pytest.raises(ValueError, match="pairs"):
        load_named_tensors(base64.b64encode(pickle.dumps({"a": 1})).decode())


async def test_tensor_push_serves_the_new_weights(
    tiny_server_factory, tiny, teacher_logprobs
) -> None:
    server = tiny_server_factory()  # starts from seed 0
    pushed = build_tiny_model(tiny[1], seed=1)
    weights = {k: v.detach().clone() for k, v in pushed.state_dict().items()}
    async with SGLangClient(server.url) as client:
        await client.update_weights_from_tensor(weights, 7)
        assert (await client.model_info())["weight_version"] == "7"
        out = await client.generate(PROMPT, PARAMS)
        assert out.versions == [7] * 10
        new = teacher_logprobs(pushed, PROMPT, out.output_ids, 0.9)
        assert max(abs(a - b) for a, b in zip(out.logprobs, new, strict=True)) < TOL

        # a tensor of the wrong shape is refused and nothing changes
        bad = dict(weights)
        name = "model.embed_tokens.weight"
        bad[name] = torch.zeros(bad[name].shape[0] + 1, bad[name].shape[1])
        with pytest.raises(ServerError, match="refused"):
            await client.update_weights_from_tensor(bad, 8)
        assert (await client.model_info())["weight_version"] == "7"


async def test_a_version_in_two_buckets_by_handle(
    tiny_server_factory, tiny, teacher_logprobs
) -> None:
    """The first bucket is staged, the second (with the label) completes the version; a payload
    that names another global, or one entry per tensor-parallel rank, is refused, and the server
    keeps serving."""
    server = tiny_server_factory()
    pushed = build_tiny_model(tiny[1], seed=2)
    items = [(k, v.detach().clone() * 0.5) for k, v in pushed.state_dict().items()]
    half = len(items) // 2
    url = server.url + "/update_weights_from_tensor"
    async with aiohttp.ClientSession() as s:
        first = {"serialized_named_tensors": [dump_named_tensors(items[:half])],
                 "flush_cache": False}  # fmt: skip
        async with s.post(url, json=first) as r:
            assert r.status == 200, await r.text()
            assert "staged" in (await r.json())["message"]
        last = {"serialized_named_tensors": [dump_named_tensors(items[half:])],
                "weight_version": "3"}  # fmt: skip
        async with s.post(url, json=last) as r:
            assert r.status == 200, await r.text()
        evil = base64.b64encode(pickle.dumps([("x", os.system)])).decode()
        async with s.post(url, json={"serialized_named_tensors": [evil]}) as r:
            assert r.status == 400 and "refused global" in (await r.json())["message"]
        async with s.post(url, json={"serialized_named_tensors": ["a", "b"]}) as r:
            assert r.status == 400 and "tensor parallelism" in (await r.json())["message"]
    halved = build_tiny_model(tiny[1], seed=2)
    halved.load_state_dict({k: v * 0.5 for k, v in halved.state_dict().items()})
    async with SGLangClient(server.url) as client:
        assert (await client.model_info())["weight_version"] == "3"
        out = await client.generate(PROMPT, PARAMS)
        new = teacher_logprobs(halved, PROMPT, out.output_ids, 0.9)
        assert max(abs(a - b) for a, b in zip(out.logprobs, new, strict=True)) < TOL


@pytest.mark.slow
def test_serve_config_and_a_tensor_push_train_together(tmp_path, teacher_logprobs) -> None:
    """``agentrl serve --config`` builds the policy as ``agentrl train`` does (same weights, so
    the served version 0 is the learner's), and ``inference.weight_sync=tensor`` keeps it in
    step: after two steps it serves the learner's weights."""
    import asyncio
    import json

    import yaml
    from conftest import start_tiny_server

    from agentrl.config import load_config
    from agentrl.loop.trainer import Trainer
    from agentrl.types import Message

    cfg = {
        "run_dir": str(tmp_path / "run"), "seed": 4,
        "env": {"id": "arith-v0", "task_kwargs": {"digits": 1}, "num_train_tasks": 64,
                "num_eval_tasks": 4},
        "rollout": {"group_size": 4, "max_turns": 1, "max_new_tokens": 4, "max_total_tokens": 48},
        "cold_start": {"steps": 0},
        "learner": {"lr": 1e-4, "num_minibatches": 2},
        "advantages": {"shapers": [{"name": "format", "penalty": 0.1}]},
        "train": {"steps": 2, "tasks_per_step": 4, "eval_every": 0, "checkpoint_every": 0},
    }  # fmt: skip
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    server = start_tiny_server("--torch-threads", "1", source=("--config", str(path)))
    try:
        cfg["inference"] = {"endpoints": [server.url], "weight_sync": "tensor"}
        trainer = Trainer(load_config(cfg))
        prompt = trainer.chat.prompt_ids([Message(role="user", content="1+2=")])
        params = SamplingParams(max_new_tokens=6, temperature=1.0, ignore_eos=True, seed=1)

        async def served() -> tuple[str, list[float], list[int]]:
            async with SGLangClient(server.url) as client:
                out = await client.generate(prompt, params)
                version = (await client.model_info())["weight_version"]
            return version, out.logprobs, out.output_ids

        def learners(ids: list[int]) -> list[float]:
            model = build_tiny_model(trainer.tokenizer, seed=0)
            model.load_state_dict(trainer.learner.state_dict_for_inference())
            return teacher_logprobs(model, prompt, ids, 1.0)

        _, before, ids = asyncio.run(served())  # the same seeded policy on both sides
        assert max(abs(a - b) for a, b in zip(before, learners(ids), strict=True)) < TOL
        assert asyncio.run(trainer.run())["steps"] == 2
        version, after, ids = asyncio.run(served())
        assert version == "2" and not (tmp_path / "run" / "weights").exists()
        assert max(abs(a - b) for a, b in zip(after, learners(ids), strict=True)) < TOL
        lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
        steps = [json.loads(x) for x in lines]
        assert any("perf/tokens" in m for m in steps)  # it trained: new weights went out
    finally:
        server.stop()


class _View:
    """A 1 GiB float32 view of a 4-element shared storage (stride 0): once copied, 1 GiB."""

    def __init__(self, storage: object) -> None:
        self.storage = storage

    def __reduce__(self) -> object:
        from torch.multiprocessing import reductions

        meta = (0, torch.Size([2**28]), (0,), False)
        return (reductions.rebuild_tensor, (torch.Tensor, self.storage, meta))


class _Mapping:
    """A shared-memory storage of 1 GiB under a made-up name."""

    def __reduce__(self) -> object:
        from torch.multiprocessing import reductions

        args = (torch.UntypedStorage, b"/tmp/none.sock", b"/torch_none", 2**30)
        return (reductions.rebuild_storage_filename, args)


def test_payload_limits_refuse_before_anything_is_allocated() -> None:
    """Issue 43: a 2.3 KB payload once made the server allocate ~1 GB and keep it."""
    import io
    from multiprocessing.reduction import ForkingPickler

    from agentrl.inference.weight_ipc import PayloadLimits

    limits = PayloadLimits(max_numel=100, max_bytes=10_000)
    t = torch.zeros(4)
    ((name, back),) = load_named_tensors(dump_named_tensors([("w", t)]), limits)
    assert name == "w" and torch.equal(back, t)

    def entry(obj: object) -> str:
        buf = io.BytesIO()
        torch.multiprocessing.set_sharing_strategy("file_system")
        ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump([("w", obj)])
        return base64.b64encode(buf.getvalue()).decode()

    shared = torch.zeros(4).share_memory_().untyped_storage()
    typed = torch.TypedStorage(wrap_storage=shared, dtype=torch.float32, _internal=True)
    cases = [
        (entry(_View(typed)), "size"),
        (entry(_Mapping()), "storage size"),
        (base64.b64encode(pickle.dumps([("w", torch.Size)])).decode(), "pairs"),
    ]  # fmt: skip
    for payload, why in cases:
        with pytest.raises(ValueError, match=why):
            load_named_tensors(payload, limits)
