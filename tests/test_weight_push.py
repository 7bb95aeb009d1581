"""The distributed weight push (SGLang's protocol) from this process to real servers, on gloo."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import pytest
import torch

from agentrl.errors import ServerError
from agentrl.inference.base import SamplingParams
from agentrl.inference.client.sglang_client import SGLangClient
from agentrl.inference.client.weight_push import DistributedWeightPush
from agentrl.inference.weight_group import buckets, dtype_name, parse_dtype
from agentrl.tiny import build_tiny_model

TOL = 1e-5  # float32 on CPU: the served log-probs equal a teacher-forced pass of the pushed model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_buckets_are_bounded_and_keep_order() -> None:
    named = [(f"w{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 30, 5, 5, 5])]  # float32
    parts = list(buckets(named, bucket_bytes=80))
    assert [[n for n, _ in p] for p in parts] == [["w0", "w1"], ["w2"], ["w3", "w4", "w5"]]
    assert parse_dtype(dtype_name(torch.bfloat16)) is torch.bfloat16
    assert parse_dtype("torch.float32") is torch.float32
    with pytest.raises(ValueError, match="dtype"):
        parse_dtype("complex64")


def test_importing_agentrl_turns_nccls_cumem_off_unless_the_user_chose() -> None:
    """NCCL's cuMem allocations hung cross-process pushes on two H100s and two H200s."""
    import os
    import subprocess
    import sys

    code = "import os, agentrl; print(os.environ['NCCL_CUMEM_ENABLE'])"
    env = {k: v for k, v in os.environ.items() if k != "NCCL_CUMEM_ENABLE"}
    for chosen, expected in ((None, "0"), ("1", "1")):
        run_env = env if chosen is None else {**env, "NCCL_CUMEM_ENABLE": chosen}
        out = subprocess.run([sys.executable, "-c", code], env=run_env, capture_output=True,
                             text=True, check=True)  # fmt: skip
        assert out.stdout.strip() == expected


@pytest.mark.slow
async def test_push_over_a_group_serves_the_new_weights(
    tiny_server_factory, tiny, teacher_logprobs
) -> None:
    servers = [tiny_server_factory(), tiny_server_factory()]  # ranks 1 and 2 of the group
    tokenizer = tiny[1]
    pushed = build_tiny_model(tokenizer, seed=1)  # the servers start from seed 0
    weights = {k: v.detach().clone() for k, v in pushed.state_dict().items()}
    push = DistributedWeightPush(
        [s.url for s in servers],
        master_address="127.0.0.1",
        master_port=free_port(),
        backend="gloo",  # CPU servers join over gloo (NCCL is the GPU path)
        device="cpu",
        bucket_mb=0.05,  # many buckets: the version must switch only after the last one
        timeout_s=60,
    )
    prompt = [1, 30, 31]
    params = SamplingParams(max_new_tokens=12, temperature=0.9, ignore_eos=True, seed=5)
    try:
        seconds = await push.push(weights, 7)
        assert seconds > 0 and push.last_push_s == seconds
        for server in servers:
            async with SGLangClient(server.url) as client:
                assert (await client.model_info())["weight_version"] == "7"
                out = await client.generate(prompt, params)
                assert out.versions == [7] * 12
                new = teacher_logprobs(pushed, prompt, out.output_ids, 0.9)
                assert max(abs(a - b) for a, b in zip(out.logprobs, new, strict=True)) < TOL

        # a bucket the model cannot take is refused; the servers keep version 7 and the group
        # stays in step, so the next push succeeds
        bad = dict(weights)
        name = "model.embed_tokens.weight"
        bad[name] = torch.zeros(bad[name].shape[0] + 1, bad[name].shape[1])
        with pytest.raises(ServerError, match="refused"):
            await push.push(bad, 8)
        async with SGLangClient(servers[0].url) as client:
            assert (await client.model_info())["weight_version"] == "7"
        weights2 = {k: v * 0.5 for k, v in weights.items()}
        await push.push(weights2, 9)
        halved = build_tiny_model(tokenizer, seed=1)
        halved.load_state_dict(weights2)
        async with SGLangClient(servers[1].url) as client:
            assert (await client.model_info())["weight_version"] == "9"
            out = await client.generate(prompt, params)
            new = teacher_logprobs(halved, prompt, out.output_ids, 0.9)
            assert max(abs(a - b) for a, b in zip(out.logprobs, new, strict=True)) < TOL
    finally:
        await push.aclose()
    # after the group is destroyed, a new group forms on the same servers
    again = DistributedWeightPush(
        [servers[0].url], master_address="127.0.0.1", master_port=free_port(),
        backend="gloo", device="cpu", timeout_s=60,
    )
    try:
        await again.push(weights, 10)
        async with SGLangClient(servers[0].url) as client:
            assert (await client.model_info())["weight_version"] == "10"
    finally:
        await again.aclose()


async def test_a_server_that_dies_fails_the_next_push_naming_it(tiny_server_factory, tiny) -> None:
    """No hang: the push of the next version fails at once, naming the version and the server."""
    server = tiny_server_factory()
    weights = {k: v.detach() for k, v in build_tiny_model(tiny[1], seed=1).state_dict().items()}
    push = DistributedWeightPush(
        [server.url], master_address="127.0.0.1", master_port=free_port(), backend="gloo",
        device="cpu", bucket_mb=0.5, timeout_s=60,
    )  # fmt: skip
    try:
        await push.push(weights, 1)
        server.proc.kill()
        server.proc.wait()
        t = time.perf_counter()
        with pytest.raises(ServerError, match="weight push of version 2 failed at bucket 1/") as e:
            await push.push(weights, 2)
        assert time.perf_counter() - t < 30  # not the group's 60 s timeout
        assert e.value.endpoint == server.url
    finally:
        await asyncio.wait_for(push.aclose(), 60)


async def test_update_without_a_group_is_refused(tiny_server) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as s:
        body = {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]]}
        async with s.post(tiny_server.url + "/update_weights_from_distributed", json=body) as r:
            assert r.status == 400
            payload = await r.json()
            assert payload["success"] is False and "init it first" in payload["message"]
        async with s.post(tiny_server.url + "/destroy_weights_update_group", json={}) as r:
            assert r.status == 400


@pytest.mark.slow
@pytest.mark.parametrize("weight_sync", ["distributed", "tensor"])
def test_trainer_pushes_without_the_disk(tmp_path, tiny_server_factory, weight_sync: str) -> None:
    """``inference.weight_sync=distributed``: the trainer broadcasts each version (gloo from the
    CPU learner) instead of writing a checkpoint; ``tensor``: it sends handles to its tensors
    (shared memory on the CPU); the overlapped loop interrupts around either."""
    import asyncio
    import json
    import urllib.request

    from agentrl.config import load_config
    from agentrl.loop.trainer import Trainer

    server = tiny_server_factory()
    cfg = {
        "run_dir": str(tmp_path), "seed": 3,
        "env": {"id": "arith-v0", "task_kwargs": {"digits": 1}, "num_train_tasks": 64,
                "num_eval_tasks": 4},
        "rollout": {"group_size": 4, "max_turns": 1, "max_new_tokens": 4, "max_total_tokens": 48},
        "cold_start": {"steps": 0},
        "learner": {"lr": 1e-4, "num_minibatches": 2},
        "advantages": {"shapers": [{"name": "format", "penalty": 0.1}]},  # a signal every step
        "inference": {"endpoints": [server.url], "weight_sync": weight_sync,
                      "weight_sync_bucket_mb": 0.5},
        "train": {"steps": 2, "tasks_per_step": 4, "eval_every": 0, "checkpoint_every": 0},
    }  # fmt: skip
    trainer = Trainer(load_config(cfg))
    summary = asyncio.run(trainer.run())
    assert summary["steps"] == 2
    info = json.loads(urllib.request.urlopen(f"{server.url}/model_info").read())
    assert info["weight_version"] == "2"
    assert not (tmp_path / "weights").exists()  # nothing went through the disk
    steps = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    pushed = [m for m in steps if "rollout/episodes" in m]
    assert len(pushed) == 2 and all(m["time/sync_s"] > 0 for m in pushed)
    assert any("perf/tokens" in m for m in pushed)  # the learner trained: new weights went out
    assert not any("time/weight_write_s" in m for m in steps)
    # the served weights are the learner's: a greedy reply scores as the learner scores it
    from agentrl.types import Message

    prompt = trainer.chat.prompt_ids([Message(role="user", content="1+2=")])
    weights = trainer.learner.state_dict_for_inference()
    model = build_tiny_model(trainer.tokenizer, seed=0)
    model.load_state_dict(weights)

    async def score() -> tuple[list[float], list[int]]:
        async with SGLangClient(server.url) as client:
            out = await client.generate(prompt, SamplingParams(max_new_tokens=6, temperature=1.0,
                                                               ignore_eos=True, seed=1))
        return out.logprobs, out.output_ids

    logprobs, ids = asyncio.run(score())
    ids_t = torch.tensor([prompt + ids])
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=ids_t).logits[0, len(prompt) - 1 : -1].float(), -1)
    ref = lp.gather(1, torch.tensor(ids)[:, None])[:, 0].tolist()
    assert max(abs(a - b) for a, b in zip(logprobs, ref, strict=True)) < TOL


@pytest.mark.gpu
def test_nccl_push_between_two_cards_serves_the_new_weights(
    tiny_server_factory, tiny, teacher_logprobs
) -> None:
    """The same push over NCCL: this process on ``cuda:0``, ``agentrl serve`` on ``cuda:1``.

    Twice on one group (the second push reuses it), then the group is torn down: a teardown
    that hangs (as NCCL's cuMem allocations made it, see ``agentrl/__init__``) fails the test.
    """
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    server = tiny_server_factory("--device", "cuda:1")
    tokenizer = tiny[1]
    pushed = build_tiny_model(tokenizer, seed=1)  # the server starts from seed 0
    before = build_tiny_model(tokenizer, seed=0)
    push = DistributedWeightPush(
        [server.url], master_address="127.0.0.1", master_port=free_port(), backend="nccl",
        device="cuda:0", bucket_mb=0.05, timeout_s=60,
    )  # fmt: skip
    prompt = [1, 30, 31]
    params = SamplingParams(max_new_tokens=12, temperature=0.9, ignore_eos=True, seed=5)

    async def push_twice_and_generate() -> Any:  # a GPU host may lack pytest-asyncio
        try:
            for version, scale in ((7, 0.5), (8, 1.0)):
                weights = {k: (v.detach() * scale).to("cuda:0")
                           for k, v in pushed.state_dict().items()}  # fmt: skip
                assert await push.push(weights, version) > 0
            async with SGLangClient(server.url) as client:
                assert (await client.model_info())["weight_version"] == "8"
                return await client.generate(prompt, params)
        finally:
            await asyncio.wait_for(push.aclose(), 90)

    out = asyncio.run(push_twice_and_generate())
    assert out.versions == [8] * 12
    new = teacher_logprobs(pushed, prompt, out.output_ids, 0.9)
    old = teacher_logprobs(before, prompt, out.output_ids, 0.9)
    gap = max(abs(a - b) for a, b in zip(out.logprobs, new, strict=True))
    assert gap < 2e-2  # the engine's dtype on a GPU may be bf16
    assert max(abs(a - b) for a, b in zip(out.logprobs, old, strict=True)) > 10 * gap
