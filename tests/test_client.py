"""SGLangClient against real `agentrl serve` processes: outputs, abort, weights, failover."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from agentrl.errors import ServerError
from agentrl.inference.base import InferenceClient, SamplingParams
from agentrl.inference.client.sglang_client import SGLangClient
from agentrl.inference.sglang_api import parse_weight_version

TOL = 1e-4


def sp(n: int = 8, **kw: Any) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.9, ignore_eos=True, **kw)


async def running(url: str) -> int:
    async with aiohttp.ClientSession() as http, http.get(url + "/v1/loads") as resp:
        return (await resp.json())["loads"][0]["num_running_reqs"]


async def wait_running(url: str, n: int = 1) -> None:
    async with asyncio.timeout(30):
        while await running(url) < n:
            await asyncio.sleep(0.01)


def test_weight_version_labels():
    assert parse_weight_version("17") == 17 and parse_weight_version(3) == 3
    assert parse_weight_version("default") == 0  # SGLang's label of the launch weights
    step = parse_weight_version("step-a")
    assert step < 0 and step == parse_weight_version("step-a") != parse_weight_version("step-b")


async def test_generate_ids_logprobs_and_stop(tiny_server, tiny, teacher_logprobs):
    model, _ = tiny
    async with SGLangClient(tiny_server.url) as client:
        assert isinstance(client, InferenceClient) and await client.health()
        prompt = [1, 5, 6, 7]
        out = await client.generate(prompt, sp(12, seed=4), rid="c-one")
        assert (out.rid, out.finish_reason, out.endpoint) == ("c-one", "length", tiny_server.url)
        assert len(out.output_ids) == len(out.logprobs) == 12 and out.versions == [0] * 12
        reference = teacher_logprobs(model, prompt, out.output_ids, 0.9)
        assert max(abs(a - b) for a, b in zip(out.logprobs, reference, strict=True)) < TOL
        stop_at = out.output_ids[3]
        k = out.output_ids.index(stop_at)
        stopped = await client.generate(prompt, sp(12, seed=4, stop_token_ids=(stop_at,)))
        assert stopped.output_ids == out.output_ids[: k + 1]
        assert (stopped.finish_reason, stopped.matched_stop) == ("stop", stop_at)
        assert await client.max_model_len() == 1024
        assert (await client.model_info())["weight_version"] == "default"
        assert await client.flush_cache() is True


async def test_abort_returns_partial_output(tiny_server):
    async with SGLangClient(tiny_server.url) as client:
        task = asyncio.create_task(client.generate([1, 8, 9], sp(600), rid="c-abort"))
        await wait_running(tiny_server.url)
        await asyncio.sleep(0.05)
        await client.abort("c-abort")
        out = await task
        assert out.finish_reason == "abort" and 0 < len(out.output_ids) < 600
        assert len(out.logprobs) == len(out.versions) == len(out.output_ids)
        others = [asyncio.create_task(client.generate([1, 2], sp(600))) for _ in range(2)]
        await wait_running(tiny_server.url, 2)
        await client.abort()  # everything
        assert {o.finish_reason for o in await asyncio.gather(*others)} == {"abort"}


async def test_killed_server_mid_batch_fails_over(tiny_server, tiny_server_factory):
    victim = tiny_server_factory()
    client = SGLangClient([victim.url, tiny_server.url], max_retries=1, backoff_s=0.05)
    async with client:
        tasks = [
            asyncio.create_task(
                client.generate([1, 3, i], sp(300), rid=f"fo{i}", session_id=f"s{i}")
            )
            for i in range(6)
        ]
        await wait_running(victim.url)  # least-loaded placement put some on the victim
        victim.kill()
        async with asyncio.timeout(60):  # no hang
            outs = await asyncio.gather(*tasks)
        assert all(len(o.output_ids) == 300 and o.finish_reason == "length" for o in outs)
        moved = [o for o in outs if "-retry" in o.meta["server_rid"]]
        assert moved and all(o.endpoint == tiny_server.url for o in outs)
        assert client.healthy_endpoints == [tiny_server.url]
    # With nowhere to go the request fails once its retry window closes, naming the endpoint
    # and the rid.
    async with SGLangClient(victim.url, max_retries=1, backoff_s=0.05, retry_s=1.0) as alone:
        async with asyncio.timeout(20):
            with pytest.raises(ServerError, match="no healthy endpoint") as info:
                await alone.generate([1, 2], sp(4), rid="lost")
        assert victim.url in str(info.value) and "lost" in str(info.value)


async def test_4xx_5xx_and_malformed_responses(tiny_server, proxy_factory):
    async with SGLangClient(tiny_server.url) as client:
        with pytest.raises(ServerError, match="HTTP 400.*context length") as info:
            await client.generate([1] * 1000, sp(100), rid="too-long")
        assert info.value.status == 400 and info.value.rid == "too-long"
        assert tiny_server.url in str(info.value)
    # 503 twice, then the real server: retried on the same endpoint with fresh rids.
    flaky = await proxy_factory(
        tiny_server.url, lambda path, n: web.Response(status=503) if n <= 2 else None
    )
    async with SGLangClient(flaky.url, max_retries=2, backoff_s=0.01) as client:
        out = await client.generate([1, 2], sp(4), rid="flaky")
        assert len(out.output_ids) == 4 and out.meta["server_rid"] == "flaky-retry2"
    assert [b["rid"] for b in flaky.bodies("/generate")] == [
        "flaky",
        "flaky-retry1",
        "flaky-retry2",
    ]
    garbage = await proxy_factory(tiny_server.url, lambda path, n: web.Response(text="{oops"))
    async with SGLangClient(garbage.url, max_retries=2) as client:
        with pytest.raises(ServerError, match="malformed /generate response") as info:
            await client.generate([1, 2], sp(4), rid="bad-json")
        assert info.value.rid == "bad-json" and garbage.url in str(info.value)
    assert len(garbage.bodies("/generate")) == 1  # no retry
    shape = json.dumps({"output_ids": [1, 2], "meta_info": {"output_token_logprobs": []}})
    wrong = await proxy_factory(tiny_server.url, lambda path, n: web.Response(text=shape))
    async with SGLangClient(wrong.url) as client:
        with pytest.raises(ServerError, match="output_token_logprobs"):
            await client.generate([1, 2], sp(2))


async def test_sessions_stick_and_new_sessions_spread(tiny_server, proxy_factory):
    # Two endpoint URLs (one through a proxy) in front of the same server.
    proxy = await proxy_factory(tiny_server.url)
    async with SGLangClient([tiny_server.url, proxy.url]) as client:
        turns = [await client.generate([1, 4 + t], sp(2), session_id="episode") for t in range(4)]
        assert len({o.endpoint for o in turns}) == 1
        outs = await asyncio.gather(
            *(client.generate([1, 2], sp(60), session_id=f"ep{i}") for i in range(8))
        )
        counts = [sum(o.endpoint == url for o in outs) for url in client.endpoints]
        assert counts == [4, 4]  # least-loaded placement alternates


async def test_client_requests_conform_to_sglang_contract(
    sglang_api_types, tiny_server, proxy_factory
):
    api = sglang_api_types
    proxy = await proxy_factory(tiny_server.url)
    async with SGLangClient(proxy.url) as client:
        await client.generate([1, 2, 3], sp(3, seed=1, stop_token_ids=(2,), top_k=5), rid="conf")
        task = asyncio.create_task(client.generate([1, 2], sp(600), rid="conf-abort"))
        await wait_running(tiny_server.url)
        await client.abort("conf-abort")
        assert (await task).finish_reason == "abort"
    for body in proxy.bodies("/generate"):
        request = api.GenerateRequest.from_json_value(body)
        assert request.return_logprob is True and isinstance(request.rid, str)
        assert request.sampling_params.max_new_tokens == body["sampling_params"]["max_new_tokens"]
    for body in proxy.bodies("/abort_request"):
        assert api.AbortRequest.from_json_value(body).rid == "conf-abort"
