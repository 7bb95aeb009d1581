"""`agentrl serve` over real HTTP: SGLang's native request/response shapes, codes and semantics."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

TOL = 1e-4


async def call(url: str, path: str, body: Any = None, method: str = "POST") -> tuple[int, Any]:
    """One HTTP call; the JSON body when there is one, else the text."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        data = body if body is None or isinstance(body, (str, bytes)) else json.dumps(body)
        headers = {} if data is None else {"Content-Type": "application/json"}
        async with http.request(method, url + path, data=data, headers=headers) as resp:
            text = await resp.text()
            try:
                return resp.status, json.loads(text)
            except ValueError:
                return resp.status, text


async def wait_running(url: str, n: int = 1) -> None:
    async with asyncio.timeout(30):
        while (await call(url, "/v1/loads", method="GET"))[1]["loads"][0]["num_running_reqs"] < n:
            await asyncio.sleep(0.01)


def gen(ids: Any, n: int = 8, **extra: Any) -> dict[str, Any]:
    params = {"max_new_tokens": n, "temperature": 0.8, "ignore_eos": True}
    return {"input_ids": ids, "sampling_params": params, "return_logprob": True, **extra}


async def test_generate_returns_ids_and_exact_logprobs(tiny_server, tiny, teacher_logprobs):
    model, _ = tiny  # the server's model: build_tiny() is seeded
    prompt = [1, 5, 6, 7, 8]
    status, out = await call(tiny_server.url, "/generate", gen(prompt, 16, rid="one"))
    assert status == 200
    meta, ids = out["meta_info"], out["output_ids"]
    assert meta["id"] == "one" and meta["finish_reason"] == {"type": "length", "length": 16}
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (5, 16, 0)
    assert meta["weight_version"] == "default"
    assert meta["weight_versions"] == [{"version": "default", "start": 0, "end": 16}]
    assert [e[1] for e in meta["output_token_logprobs"]] == ids
    assert all(e[2] is None for e in meta["output_token_logprobs"])  # no text unless asked
    assert meta["input_token_logprobs"] == [] and meta["e2e_latency"] > 0
    reference = teacher_logprobs(model, prompt, ids, 0.8)
    got = [e[0] for e in meta["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(got, reference, strict=True)) < TOL


async def test_batch_form_text_prompts_and_scoring(tiny_server, tiny, teacher_logprobs):
    model, tokenizer = tiny
    body = gen([[1, 5], [1, 6, 7, 8]], rid="bt")
    # seeded, EOS ignored: an unseeded sample of the random tiny model could stop early
    first = {"max_new_tokens": 3, "ignore_eos": True, "sampling_seed": 2}
    body["sampling_params"] = [first, {"max_new_tokens": 5, "temperature": 0}]
    status, outs = await call(tiny_server.url, "/generate", body)
    assert status == 200 and [o["meta_info"]["id"] for o in outs] == ["bt_0", "bt_1"]
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [3, 5]
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [2, 4]
    text = {
        "text": "hi there",
        "return_prompt_token_ids": True,
        "sampling_params": {"max_new_tokens": 2},
    }
    status, out = await call(tiny_server.url, "/generate", text)
    assert out["prompt_token_ids"] == tokenizer("hi there", add_special_tokens=True)["input_ids"]
    assert "output_token_logprobs" not in out["meta_info"]  # only with return_logprob
    # Scoring a fixed sequence: max_new_tokens 0, prompt log-probs from position 0.
    ids = [1, 9, 10, 11, 12, 2]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True}
    body |= {"logprob_start_len": 0, "return_text_in_logprobs": True}
    status, out = await call(tiny_server.url, "/generate", body)
    entries = out["meta_info"]["input_token_logprobs"]
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"]["type"] == "length"
    assert [e[1] for e in entries] == ids and entries[0][0] is None
    assert entries[1][2] == tokenizer.decode([9])
    reference = teacher_logprobs(model, ids[:1], ids[1:])
    assert max(abs(e[0] - r) for e, r in zip(entries[1:], reference, strict=True)) < TOL
    status, out = await call(tiny_server.url, "/generate", body | {"logprob_start_len": 4})
    assert [e[1] for e in out["meta_info"]["input_token_logprobs"]] == ids[4:]


async def test_concurrent_requests_share_one_batch_and_abort(tiny_server):
    url = tiny_server.url
    tasks = [
        asyncio.create_task(call(url, "/generate", gen([1, 3 + i], 600, rid=f"conc{i}")))
        for i in range(4)
    ]
    await wait_running(url, 4)  # four HTTP requests decoding together
    status, body = await call(url, "/abort_request", {"rid": "conc0"})
    assert (status, body) == (200, "")
    first = (await tasks[0])[1]["meta_info"]
    assert first["finish_reason"]["type"] == "abort" and first["finish_reason"]["message"]
    assert 0 < first["completion_tokens"] == len(first["output_token_logprobs"]) < 600
    assert first["weight_versions"][-1]["end"] == first["completion_tokens"]
    assert not any(t.done() for t in tasks[1:])
    status, _ = await call(url, "/generate", gen([1, 2], 4, rid="conc1"))
    assert status == 400  # rid in flight
    await call(url, "/abort_request", {"abort_all": True})
    for task in tasks[1:]:
        assert (await task)[1]["meta_info"]["finish_reason"]["type"] == "abort"


BAD = [
    ({"input_ids": [1, 2], "sampling_params": {"temprature": 0.5}}, "unknown field `temprature`"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4.0}}, "floating point `4.0`"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": "4"}}, 'string "4", expected i64'),
    ({"input_ids": [1, 2], "sampling_params": {"ignore_eos": 1}}, "expected a boolean"),
    ({"input_ids": [1, 2], "sampling_params": {"top_p": 0}}, "top_p"),
    ({"input_ids": [1, 2], "sampling_params": {"top_k": 0}}, "top_k"),
    ({"input_ids": [1, 2], "sampling_params": {"stop": ["x"]}}, "not supported"),
    ({"input_ids": [1, 2], "stream": True}, "stream"),
    ({"input_ids": []}, "non-empty"),
    ({"sampling_params": {}}, "Either text or input_ids"),
    ({"input_ids": [1] * 1000, "sampling_params": {"max_new_tokens": 100}}, "context length"),
    ({"input_ids": [1, 500]}, "expected ids in"),
    ({"input_ids": [1, 2, 3], "logprob_start_len": 9, "return_logprob": True}, "logprob_start_len"),
    ({"input_ids": [[1, 2], [1, 3]], "rid": ["a"]}, "rid: expected 2 values"),
    ('{"input_ids": [1, 2', "invalid JSON"),
]


@pytest.mark.parametrize(("body", "message"), BAD, ids=[m for _, m in BAD])
async def test_bad_fields_get_400_with_a_message(tiny_server, body, message):
    status, out = await call(tiny_server.url, "/generate", body)
    assert status == 400
    error = out["error"] if isinstance(out["error"], str) else out["error"]["message"]
    assert message in error


async def test_info_routes(tiny_server):
    url = tiny_server.url
    for path in ("/model_info", "/get_model_info"):
        status, info = await call(url, path, method="GET")
        assert status == 200 and info["weight_version"] == "default"
        assert info["model_path"] == "tiny" and info["is_generation"] is True
    for path in ("/server_info", "/get_server_info"):
        status, info = await call(url, path, method="GET")
        assert status == 200 and info["context_length"] == 1024 and info["port"] > 0
    status, models = await call(url, "/v1/models", method="GET")
    assert models["object"] == "list" and models["data"][0]["max_model_len"] == 1024
    status, loads = await call(url, "/v1/loads", method="GET")
    assert {"num_running_reqs", "num_waiting_reqs"} <= set(loads["loads"][0])
    for path in ("/health", "/health_generate", "/ready", "/flush_cache"):
        assert (await call(url, path, method="GET"))[0] == 200


async def test_responses_and_errors_conform_to_sglang_contract(sglang_api_types, tiny_server):
    api = sglang_api_types
    url = tiny_server.url
    single = (await call(url, "/generate", gen([1, 5, 6], 4, logprob_start_len=0)))[1]
    decoded = api.GenerateResponse.from_json_value(single)
    assert isinstance(decoded.meta_info.finish_reason, api.FinishLength)
    assert all(isinstance(e, api.LogprobEntry) for e in decoded.meta_info.output_token_logprobs)
    assert isinstance(decoded.meta_info.weight_versions[0], api.WeightVersionSpan)
    batch = (await call(url, "/generate", gen([[1, 5], [1, 6]], 3, return_text_in_logprobs=True)))[
        1
    ]
    for item in batch:
        assert api.GenerateResponse.from_json_value(item).output_ids == item["output_ids"]
    task = asyncio.create_task(call(url, "/generate", gen([1, 7], 600, rid="conform-abort")))
    await wait_running(url)
    abort = {"rid": "conform-abort"}
    api.AbortRequest.from_json_value(abort)
    await call(url, "/abort_request", abort)
    aborted = api.GenerateResponse.from_json_value((await task)[1])
    assert isinstance(aborted.meta_info.finish_reason, api.FinishAbort)
    api.GetModelInfoResponse.from_json_value((await call(url, "/model_info", method="GET"))[1])
    api.GetServerInfoResponse.from_json_value((await call(url, "/server_info", method="GET"))[1])
    api.ModelCard.from_json_value((await call(url, "/v1/models", method="GET"))[1]["data"][0])
    # A contract violation gets SGLang's own error text, word for word.
    for body, _ in BAD[:4]:
        with pytest.raises(api.JsonContractError) as expected:
            api.GenerateRequest.from_json_value(body)
        assert (await call(url, "/generate", body))[1] == {"error": str(expected.value)}


def test_json_bodies_are_encoded_fast_and_fall_back_for_lone_surrogates() -> None:
    from agentrl.fast_json import loads
    from agentrl.inference.server.engine_server import _json

    assert _json({"t": "é✓", "lp": [-0.5, None]}).body == '{"t":"é✓","lp":[-0.5,null]}'.encode()
    odd = {"text": "a\ud800b", "ids": [1, 2]}  # a lone surrogate: pydantic-core refuses it
    assert json.loads(_json(odd).body) == odd
    assert loads(json.dumps(odd).encode()) == odd
    assert loads(b'{"lp": [-1e-7, -Infinity]}') == {"lp": [-1e-7, float("-inf")]}
    with pytest.raises(ValueError):
        loads(b'{"cut off')
