"""`agentrl serve` with keys (issue 43): who may call what, hostile requests refused before any
work, weights only from allowed directories; and the client sending its keys.

One keyed server for the module (``--api-key env:...``, ``--admin-api-key file:...``,
``--weights-dir W``). After every refused request the tests check that nothing changed: the
weight label is the same and generation is not paused.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import pickle
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from conftest import ServerProcess, start_tiny_server

from agentrl.errors import ConfigError, ServerError
from agentrl.inference.base import SamplingParams
from agentrl.inference.client.sglang_client import SGLangClient
from agentrl.inference.weight_group import open_group
from agentrl.inference.weight_ipc import dump_named_tensors
from agentrl.tiny import build_tiny_model, build_tiny_tokenizer

API, ADMIN = "api-key-0123", "admin-key-4567"
TOL = 1e-4
ADMIN_POSTS = [
    "/pause_generation", "/continue_generation", "/abort_request", "/flush_cache",
    "/update_weights_from_disk", "/update_weights_from_tensor", "/init_weights_update_group",
    "/update_weights_from_distributed", "/destroy_weights_update_group",
]  # fmt: skip


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("weights")
    tokenizer = build_tiny_tokenizer()
    for seed, name in ((0, "v0"), (1, "v3"), (2, "v4")):
        build_tiny_model(tokenizer, seed=seed).save_pretrained(root / name)
    return root


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory, weights: Path) -> Iterator[ServerProcess]:
    keyfile = tmp_path_factory.mktemp("keys") / "admin.key"
    keyfile.write_text(ADMIN + "\n")
    os.environ["AGENTRL_TEST_API_KEY"] = API
    try:
        server = start_tiny_server(
            "--api-key", "env:AGENTRL_TEST_API_KEY", "--admin-api-key", f"file:{keyfile}",
            "--weights-dir", str(weights), allow_tmp=False,
        )  # fmt: skip
    finally:
        del os.environ["AGENTRL_TEST_API_KEY"]
    assert API not in " ".join(server.proc.args) and ADMIN not in "".join(server.log)
    yield server
    server.stop()


async def call(
    url: str, path: str, body: Any = None, *, key: str | None = None, method: str = "POST",
    headers: dict[str, str] | None = None, timeout: float = 60,
) -> tuple[int, Any]:  # fmt: skip
    """One HTTP call with ``key`` as Bearer; JSON bodies say so unless ``headers`` do otherwise."""
    sent = {"Authorization": f"Bearer {key}"} if key else {}
    data = body if body is None or isinstance(body, (str, bytes)) else json.dumps(body)
    if data is not None:
        sent["Content-Type"] = "application/json"
    sent |= headers or {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as http:
        async with http.request(method, url + path, data=data, headers=sent) as resp:
            text = await resp.text()
    try:
        return resp.status, json.loads(text)
    except ValueError:
        return resp.status, text


async def state(url: str) -> tuple[str, int]:
    """The live weight label and /ready's status (503 while paused)."""
    info = (await call(url, "/model_info", key=API, method="GET"))[1]
    return info["weight_version"], (await call(url, "/ready", method="GET"))[0]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


GEN = {"input_ids": [1, 5, 6], "sampling_params": {"max_new_tokens": 2}}


async def test_keys_guard_every_route_as_sglang(keyed) -> None:
    url = keyed.url
    before = await state(url)
    assert before[1] == 200
    for path in ("/health", "/health_generate", "/ready"):  # probes carry no key
        assert (await call(url, path, method="GET"))[0] == 200
    for key in (None, "wrong", ADMIN):  # the admin key does not stand in for the API key
        status, body = await call(url, "/generate", GEN, key=key)
        assert status == 401 and "API key" in body["error"]["message"], body
        assert (await call(url, "/model_info", key=key, method="GET"))[0] == 401
    assert (await call(url, "/generate", GEN, key=API))[0] == 200
    for path in ADMIN_POSTS:
        for key in (None, API):  # with an admin key set, the API key is refused here
            status, body = await call(url, path, {"abort_all": True}, key=key)
            assert status == 401 and "admin API key" in body["error"]["message"], (path, body)
    assert (await call(url, "/flush_cache", key=API, method="GET"))[0] == 401
    assert await state(url) == before  # nothing paused, nothing loaded


async def test_health_is_503_while_paused(keyed) -> None:
    url = keyed.url
    assert (await call(url, "/pause_generation", {}, key=ADMIN))[0] == 200
    try:
        status, body = await call(url, "/health", method="GET")
        assert status == 503 and "paused" in body["error"]["message"]
        assert (await call(url, "/ready", method="GET"))[0] == 503
    finally:
        assert (await call(url, "/continue_generation", key=ADMIN))[0] == 200  # no body: fine
    assert (await call(url, "/health", method="GET"))[0] == 200


async def test_foreign_host_origin_and_non_json_posts_are_refused(keyed) -> None:
    url = keyed.url
    before = await state(url)
    for host in ("evil.example", "evil.example:80", "localhost.evil.example"):
        status, body = await call(url, "/pause_generation", {}, key=ADMIN, headers={"Host": host})
        assert status == 421 and "Host" in body["error"]["message"]
    for host in ("localhost:1", "127.0.0.1", "[::1]:8000", "10.1.2.3"):  # names of this server
        assert (await call(url, "/model_info", key=API, method="GET",
                           headers={"Host": host}))[0] == 200  # fmt: skip
    for origin in ("http://evil.example", "null"):
        headers = {"Origin": origin}
        status, _ = await call(url, "/pause_generation", {}, key=ADMIN, headers=headers)
        assert status == 403
    ok = {"Origin": "http://localhost:3000"}
    assert (await call(url, "/model_info", key=API, method="GET", headers=ok))[0] == 200
    for path, key in (("/pause_generation", ADMIN), ("/generate", API)):
        for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data"):
            status, body = await call(url, path, "{}", key=key, headers={"Content-Type": kind})
            assert status == 415 and "application/json" in body["error"]["message"]
    assert await state(url) == before


async def test_hostile_bodies_are_400_before_any_work(keyed) -> None:
    url = keyed.url
    before = await state(url)
    deep = "[" * 1000 + "]" * 1000
    deep_object = '{"a":' * 1000 + "1" + "}" * 1000
    for path in ["/generate", *ADMIN_POSTS]:
        key = API if path == "/generate" else ADMIN
        for body in (deep, deep_object):
            status, answer = await call(url, path, body, key=key)
            assert status == 400 and "nested too deeply" in json.dumps(answer), (path, answer)
    surrogate = '{"text": "2 + 2 = \\ud800", "sampling_params": {"max_new_tokens": 1}}'
    status, answer = await call(url, "/generate", surrogate, key=API)
    assert status == 400 and "surrogate" in answer["error"]["message"]
    # 30 MB of text: refused by length before the tokeniser sees it (it once took 12 GB)
    rss = rss_mb(keyed.proc.pid)
    t = time.perf_counter()
    big = {"text": "x" * 30_000_000, "sampling_params": {"max_new_tokens": 1}}
    status, answer = await call(url, "/generate", big, key=API)
    assert status == 400 and "send input_ids" in answer["error"]["message"]
    assert time.perf_counter() - t < 10 and rss_mb(keyed.proc.pid) - rss < 512
    ids = {"input_ids": [1] * 2_000_000}  # over the context: refused before per-id checks
    status, answer = await call(url, "/generate", ids, key=API)
    assert status == 400 and "context length" in answer["error"]["message"]
    assert await state(url) == before


async def test_weights_load_only_from_allowed_directories(keyed, weights, tmp_path) -> None:
    url = keyed.url
    before = await state(url)
    outside = tmp_path / "outside"
    build_tiny_model(build_tiny_tokenizer(), seed=5).save_pretrained(outside)
    (weights / "link").symlink_to(outside)  # a link out of the allowed tree
    (weights / "filelink").mkdir()
    (weights / "filelink" / "model.safetensors").symlink_to(outside / "model.safetensors")
    (weights / "fifo").mkdir()
    os.mkfifo(weights / "fifo" / "model.safetensors")  # once froze the whole server
    (weights / "empty").mkdir()
    cases = [
        (outside, "not under an allowed directory"),
        (weights / "link", "not under an allowed directory"),
        (weights / "filelink", "not a regular file"),
        (weights / "fifo", "not a regular file"),
        (weights / "empty", "no *.safetensors"),
        (weights / ".." / outside.name, "not under an allowed directory"),
        (Path("v3"), "absolute path"),
        (Path("/dev"), "not under an allowed directory"),
    ]
    for path, why in cases:
        t = time.perf_counter()
        status, body = await call(
            url, "/update_weights_from_disk", {"model_path": str(path), "weight_version": "66"},
            key=ADMIN, timeout=20,
        )  # fmt: skip
        assert status == 400 and body["success"] is False and why in body["message"], (path, body)
        assert time.perf_counter() - t < 5
    assert await state(url) == before


async def test_weight_group_requests_are_checked_and_never_stop_generation(keyed) -> None:
    url = keyed.url
    before = await state(url)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]  # nothing listens once the socket closes
    group = {"master_address": "127.0.0.1", "master_port": closed, "world_size": 2,
             "rank_offset": 1, "backend": "gloo"}  # fmt: skip
    bad = [({"timeout_s": 1e8}, "timeout_s"), ({"timeout_s": -1}, "timeout_s"),
           ({"master_port": 70000}, "master_port"), ({"world_size": 1}, "world_size"),
           ({"rank_offset": 0}, "rank_offset"), ({"backend": "mpi"}, "backend"),
           ({"master_address": ["x"]}, "master_address")]  # fmt: skip
    for change, field in bad:
        status, body = await call(url, "/init_weights_update_group", group | change, key=ADMIN)
        assert status == 400 and field in body["message"], body
    # eight joins of a closed port: one waits out its 1 s in a thread, the rest are refused at
    # once, and generation goes on meanwhile (it once stopped for 109 s)
    joins = [
        asyncio.create_task(
            call(url, "/init_weights_update_group", group | {"timeout_s": 1}, key=ADMIN)
        )  # fmt: skip
        for _ in range(8)
    ]
    await asyncio.sleep(0.3)
    t = time.perf_counter()
    status, out = await call(url, "/generate", GEN, key=API)
    assert status == 200 and time.perf_counter() - t < 2.5
    results = await asyncio.gather(*joins)
    assert all(status == 400 for status, _ in results)
    assert sum("already forming" in body["message"] for _, body in results) == 7
    status, body = await call(
        url, "/update_weights_from_distributed",
        {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]]}, key=ADMIN,
    )  # fmt: skip
    assert status == 400 and "init it first" in body["message"]
    assert await state(url) == before


async def test_a_bucket_larger_than_the_model_is_refused_unallocated(keyed) -> None:
    """A group formed with this process as rank 0; a 1 GiB bucket is refused before any buffer
    exists and the server leaves the group (its sender would otherwise wait)."""
    url = keyed.url
    before = await state(url)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    here = asyncio.to_thread(open_group, master_address="127.0.0.1", master_port=port, rank=0,
                             world_size=2, backend="gloo", device="cpu", timeout_s=30)  # fmt: skip
    join = {"master_address": "127.0.0.1", "master_port": port, "world_size": 2,
            "backend": "gloo", "timeout_s": 30}  # fmt: skip
    mine, (status, body) = await asyncio.gather(
        here, call(url, "/init_weights_update_group", join, key=ADMIN)
    )
    try:
        assert status == 200, body
        rss = rss_mb(keyed.proc.pid)
        huge = {"names": ["model.embed_tokens.weight"], "dtypes": ["float32"],
                "shapes": [[2**15, 2**13]]}  # fmt: skip
        status, body = await call(url, "/update_weights_from_distributed", huge, key=ADMIN)
        assert status == 400 and "left" in body["message"], body
        assert rss_mb(keyed.proc.pid) - rss < 64
        status, body = await call(url, "/destroy_weights_update_group", {}, key=ADMIN)
        assert status == 400  # already left
    finally:
        mine.close(timeout_s=5)
    assert await state(url) == before


class _Alloc:
    def __reduce__(self) -> Any:
        return (torch.Tensor, (2**28,))  # 1 GiB from a few bytes of pickle


async def test_tensor_payloads_are_checked_before_allocation(keyed) -> None:
    url = keyed.url
    before = await state(url)
    rss = rss_mb(keyed.proc.pid)
    alloc = base64.b64encode(pickle.dumps([("model.embed_tokens.weight", _Alloc())])).decode()
    wrong = dump_named_tensors([("model.embed_tokens.weight", torch.zeros(3, 3))])
    unknown = dump_named_tensors([("nope", torch.zeros(2))])
    for entry, why in ((alloc, "not callable"), (wrong, "expected"), (unknown, "unknown")):
        status, body = await call(
            url, "/update_weights_from_tensor", {"serialized_named_tensors": [entry]}, key=ADMIN
        )
        assert status == 400 and why in body["message"], body
    assert rss_mb(keyed.proc.pid) - rss < 64
    assert await state(url) == before


async def test_client_sends_its_keys_and_updates_weights(keyed, weights, tiny, teacher_logprobs):
    """The client's keys reach every route; weight updates, pause and continue go through."""
    url, tokenizer = keyed.url, tiny[1]

    def sp(n: int, **kw: Any) -> SamplingParams:
        return SamplingParams(max_new_tokens=n, temperature=0.9, ignore_eos=True, **kw)

    async with SGLangClient(url, max_retries=0) as stranger:
        with pytest.raises(ServerError, match="401"):
            await stranger.generate([1, 2], sp(2))
    async with SGLangClient(url, api_key=API, max_retries=0) as user:  # no admin key
        assert (await user.generate([1, 2], sp(2))).output_ids
        with pytest.raises(ServerError, match="401"):
            await user.pause()
    async with SGLangClient(url, api_key=API, admin_api_key=ADMIN) as client:
        assert await client.health()
        prompt = [1, 30, 31]
        await client.update_weights_from_disk(str(weights / "v0"), 0)
        before = await client.generate(prompt, sp(16, seed=9))
        await client.update_weights_from_disk(str(weights / "v3"), 3)
        assert (await client.model_info())["weight_version"] == "3"
        after = await client.generate(prompt, sp(16, seed=9))
        assert after.versions == [3] * 16 and after.output_ids != before.output_ids
        new = teacher_logprobs(build_tiny_model(tokenizer, seed=1), prompt, after.output_ids, 0.9)
        assert max(abs(a - b) for a, b in zip(after.logprobs, new, strict=True)) < TOL
        with pytest.raises(ServerError, match="weight update"):
            await client.update_weights_from_disk(str(weights / "missing"), 9)
        # a partial rollout across an update: pause (in place), push v4, continue
        task = asyncio.create_task(client.generate(prompt, sp(900), rid="span"))
        async with asyncio.timeout(30):
            while (await call(url, "/v1/loads", key=API, method="GET"))[1]["loads"][0][
                "num_running_reqs"
            ] < 1:
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        await client.pause("in_place")
        assert (await call(url, "/flush_cache", key=ADMIN))[0] == 400  # requests are open
        await client.update_weights_from_disk(str(weights / "v4"), 4)
        await client.continue_generation()
        out = await task
        split = out.versions.index(4)
        assert out.versions == [3] * split + [4] * (900 - split) and split > 0
        await client.abort()  # abort_all with the admin key
        assert await client.flush_cache()


async def test_weight_pushes_send_the_admin_key(keyed) -> None:
    """The trainer's tensor push presents the admin key; without it the server refuses the push."""
    from agentrl.inference.client.weight_push import TensorWeightPush

    model = build_tiny_model(build_tiny_tokenizer(), seed=5)
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    stranger = TensorWeightPush([keyed.url], api_key=API)
    try:
        with pytest.raises(ServerError, match="401"):
            await stranger.push(weights, 41)
    finally:
        await stranger.aclose()
    assert (await state(keyed.url))[0] != "41"
    push = TensorWeightPush([keyed.url], api_key=API, admin_key=ADMIN)
    try:
        await push.push(weights, 42)
    finally:
        await push.aclose()
    assert (await state(keyed.url))[0] == "42"


def test_config_keys_come_from_env_or_file_never_inline(tmp_path, monkeypatch) -> None:
    from agentrl.config import InferenceConfig, load_config

    monkeypatch.setenv("AGENTRL_K", "k-1")
    (tmp_path / "admin").write_text("k-2\n")
    cfg = InferenceConfig(api_key="env:AGENTRL_K", admin_api_key=f"file:{tmp_path / 'admin'}")
    options = cfg.client_options()
    assert (options["api_key"], options["admin_api_key"]) == ("k-1", "k-2")
    with pytest.raises(ConfigError, match="inference.api_key: environment variable 'NOPE_43'"):
        InferenceConfig(api_key="env:NOPE_43").client_options()
    with pytest.raises(ConfigError, match="env:NAME or file:PATH"):
        load_config({"inference": {"api_key": "k-1"}})  # a key itself would be saved


def test_serve_refuses_an_unreadable_key_in_one_line(capsys) -> None:
    from agentrl.cli import main

    assert main(["serve", "--model", "tiny", "--api-key", "env:NOPE_43_UNSET"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["agentrl serve: error: --api-key: environment variable 'NOPE_43_UNSET' is not "
                   "set or empty"]  # fmt: skip


def test_serving_beyond_loopback_without_a_key_warns(caplog) -> None:
    from agentrl.inference.server.guard import allowed_hosts, warn_if_open

    with caplog.at_level("WARNING"):
        warn_if_open("127.0.0.1", None, None)
        warn_if_open("0.0.0.0", "k", None)
        assert not caplog.records
        warn_if_open("0.0.0.0", None, None)
    assert "without --api-key" in caplog.text
    assert allowed_hosts("0.0.0.0", ["*"]) is None
    names = allowed_hosts("10.0.0.5", ["gpu7.lan,head"])
    assert names is not None and {"gpu7.lan", "head", "10.0.0.5", "localhost"} <= names
