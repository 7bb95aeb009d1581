"""Hostile input to `agentrl serve` (issues 20, 43): non-finite and out-of-range sampling values,
oversized bodies, long texts refused untokenised; the server stays healthy after each (more in
``test_server_auth.py``)."""

from __future__ import annotations

import json
import time
from typing import Any

import aiohttp
import pytest


async def call(url: str, path: str, body: Any = None, method: str = "POST") -> tuple[int, Any]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        data = body if body is None or isinstance(body, (str, bytes)) else json.dumps(body)
        headers = {} if data is None else {"Content-Type": "application/json"}
        async with http.request(method, url + path, data=data, headers=headers) as resp:
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


async def test_long_text_is_refused_before_tokenising(tiny_server) -> None:
    """Issue 43: a tokeniser's memory grows with its input (30 MB of text took 12 GB), so a text
    that cannot fit the context is refused by its length; one that might fit is tokenised."""
    text = "12 + 34 = 46. " * 30_000  # 420k characters: seconds to tokenise
    t = time.perf_counter()
    status, answer = await call(tiny_server.url, "/generate", {"text": text})
    message = answer["error"]["message"]
    assert status == 400 and "context length" in message and "send input_ids" in message
    assert time.perf_counter() - t < 1.5  # not tokenised
    status, answer = await call(tiny_server.url, "/generate", {"text": text[:7000]})
    message = answer["error"]["message"]  # tokenised: more tokens than the context holds
    assert status == 400 and "context length" in message and "input_ids" not in message
    assert (await call(tiny_server.url, "/health", method="GET"))[0] == 200
