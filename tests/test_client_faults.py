"""Endpoint faults with real `agentrl serve` processes: a restart inside the retry window, a
frozen (SIGSTOPped) endpoint whose requests move to a healthy one (issue 20)."""

from __future__ import annotations

import asyncio
import signal
import socket

import pytest

from agentrl.errors import ServerError
from agentrl.inference.base import SamplingParams
from agentrl.inference.client.sglang_client import SGLangClient

pytestmark = pytest.mark.slow

PARAMS = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_restarting_endpoint_is_waited_for(tiny_server_factory) -> None:
    port = free_port()
    server = tiny_server_factory("--port", str(port))
    async with SGLangClient(server.url, retry_s=120.0, backoff_s=0.1) as client:
        first = await client.generate([1, 2, 3], PARAMS)
        server.kill()
        pending = asyncio.ensure_future(client.generate([1, 2, 3], PARAMS))
        await asyncio.sleep(3.0)  # before: the request failed within ~3 s
        assert not pending.done()
        tiny_server_factory("--port", str(port))  # listening again after 7-14 s
        out = await asyncio.wait_for(pending, 120)
    assert out.output_ids == first.output_ids and out.finish_reason == "length"


async def test_retry_window_is_bounded(tiny_server_factory) -> None:
    port = free_port()
    async with SGLangClient(f"http://127.0.0.1:{port}", retry_s=1.0, backoff_s=0.1) as client:
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(ServerError, match="retry_s=1.0"):
            await client.generate([1, 2, 3], PARAMS)
        assert asyncio.get_running_loop().time() - t0 < 30


async def test_a_frozen_endpoint_hands_its_requests_to_a_healthy_one(tiny_server_factory) -> None:
    healthy, frozen = tiny_server_factory(), tiny_server_factory()
    long = SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True)
    client = SGLangClient(
        [healthy.url, frozen.url], stall_s=2.0, health_timeout_s=2.0, timeout_s=600.0
    )
    async with client:
        frozen.proc.send_signal(signal.SIGSTOP)  # the client still has it in rotation
        calls = [
            asyncio.ensure_future(client.generate([1, 2, i + 3], long, session_id=f"s{i}"))
            for i in range(8)
        ]
        try:
            outs = await asyncio.wait_for(asyncio.gather(*calls), 240)
        finally:
            frozen.proc.send_signal(signal.SIGCONT)
    assert [len(o.output_ids) for o in outs] == [64] * 8
    assert {o.endpoint for o in outs} == {healthy.url}  # before: stalled for the 600 s timeout
    assert client.healthy_endpoints == [healthy.url]
