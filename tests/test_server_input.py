"""Hostile input to `agentrl serve` (issue 20): non-finite and out-of-range sampling values,
oversized bodies, large bodies parsed off the event loop; the server stays healthy after each."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import pytest


async def call(url: str, path: str, body: Any = None, method: str = "POST") -> tuple[int, Any]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        data = body if isinstance(body, (str, bytes)) else json.dumps(body)
        async with http.request(method, url + path, data=None if body is None else data) as resp:
            text = await resp.text()
            try:
                return resp.status, json.loads(text)
            except ValueError:
                return resp.status, text


def generate(sampling: str) -> str:
    """A /generate body with a raw ``sampling_params`` JSON text (NaN is not valid JSON)."""
    return '{"input_ids": [1, 2, 3], "sampling_params": ' + sampling + "}"


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        ('{"temperature": NaN}', "temperature"),  # before: accepted, sampled greedily
        ('{"temperature": Infinity}', "temperature"),
        ('{"top_p": NaN}', "top_p"),
        ('{"min_p": -Infinity}', "min_p"),
        (f'{{"sampling_seed": {2**70}}}', "i64"),  # before: a 500
        ('{"sampling_seed": -1}', "sampling_seed"),
        ('{"stop_token_ids": [1, 100000000]}', "stop_token_ids"),  # before: accepted
        ('{"stop_token_ids": [-3]}', "stop_token_ids"),
    ],
)
async def test_bad_sampling_values_are_400(tiny_server, sampling: str, field: str) -> None:
    status, body = await call(tiny_server.url, "/generate", generate(sampling))
    assert status == 400, body
    message = body["error"] if isinstance(body["error"], str) else body["error"]["message"]
    assert field in message
    assert (await call(tiny_server.url, "/health", method="GET"))[0] == 200


async def test_largest_seed_is_served(tiny_server) -> None:
    sampling = f'{{"sampling_seed": {2**63 - 1}, "max_new_tokens": 2}}'
    status, body = await call(tiny_server.url, "/generate", generate(sampling))
    assert status == 200 and len(body["output_ids"]) == 2


async def test_body_over_the_limit_is_413_in_sglang_shape(tiny_server) -> None:
    big = json.dumps({"input_ids": [1] * 20_000_000})  # 60 MB, over the 32 MiB limit
    status, body = await call(tiny_server.url, "/generate", big)
    assert status == 413 and "exceeded" in body["error"]["message"]  # before: accepted
    assert (await call(tiny_server.url, "/health", method="GET"))[0] == 200


async def test_large_text_is_tokenised_off_the_event_loop(tiny_server) -> None:
    text = "12 + 34 = 46. " * 30_000  # 420k characters: seconds to tokenise
    body = {"text": text, "sampling_params": {"max_new_tokens": 1}}
    done: dict[str, float] = {}

    async def timed(name: str, *args: Any) -> tuple[int, Any]:
        out = await call(tiny_server.url, *args)
        done[name] = time.perf_counter()
        return out

    big = asyncio.ensure_future(timed("generate", "/generate", body))
    await asyncio.sleep(0.3)  # the server has the body and is tokenising it
    status, _ = await timed("health", "/health", None, "GET")
    status_big, answer = await big
    assert status == 200 and status_big == 400 and "context length" in answer["error"]["message"]
    assert done["health"] < done["generate"]  # before: /health waited for the tokeniser
