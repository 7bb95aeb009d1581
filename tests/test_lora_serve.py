"""LoRA adapters on the embedded engine and `agentrl serve` (issue 46), on CPU in float32.

A learner with ``learner.lora`` takes two steps (and its ``B`` is perturbed so that the adapter
changes the model clearly); the engine, given only the adapter tensors or the peft directory
the learner wrote, then serves the learner's log-probs to 1e-5. One keyed `agentrl serve`
process for the module (``--admin-api-key``): SGLang's bodies and responses, refusals.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from conftest import ServerProcess, _teacher_logprobs, start_tiny_server
from test_learner import make_samples
from test_lora import LORA, perturb

from agentrl.errors import ServerError
from agentrl.inference.base import SamplingParams
from agentrl.inference.engine import LocalEngine
from agentrl.learner import Learner, LearnerConfig
from agentrl.tiny import build_tiny

ADMIN = "lora-admin-key"
TOL = 1e-5
PROMPT = [1, 39, 37, 23, 36, 2, 1, 19, 37]
SCORED = [1, 9, 10, 11, 12, 2, 40, 41]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Learner, Any, Path]:
    """A LoRA learner after two steps (``B`` perturbed), its model, and its peft directory."""
    torch.manual_seed(0)
    model, _ = build_tiny()
    learner = Learner(model, LearnerConfig(lr=1e-2, lora=LORA))
    for seed in (0, 1):
        learner.step(make_samples(model, n=4, seed=seed))
    perturb(model)
    model.eval()
    path = learner.save_adapter(tmp_path_factory.mktemp("lora") / "adapter", base_model="tiny")
    return learner, model, path


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = start_tiny_server("--admin-api-key", ADMIN)
    yield proc
    proc.stop()


async def call(
    url: str, path: str, body: Any = None, key: str | None = ADMIN, method: str = "POST"
) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = body if isinstance(body, (str, bytes)) or body is None else json.dumps(body)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        async with http.request(method, url + path, data=data, headers=headers) as resp:
            text = await resp.text()
            try:
                return resp.status, json.loads(text)
            except ValueError:
                return resp.status, text


def scored(out: dict[str, Any]) -> list[float]:
    return [e[0] for e in out["meta_info"]["input_token_logprobs"][1:]]


def score_body(lora: Any = None) -> dict[str, Any]:
    body: dict[str, Any] = {"input_ids": SCORED, "sampling_params": {"max_new_tokens": 0}}
    return body | {"return_logprob": True, "logprob_start_len": 0, "lora_path": lora}


def gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


async def test_tensor_push_serves_the_learners_logprobs(trained) -> None:
    learner, model, _ = trained
    base = build_tiny()[0]
    engine = LocalEngine(build_tiny()[0], build_tiny()[1])
    adapter = learner.adapter_state()
    assert adapter and all(".lora_A." in k or ".lora_B." in k for k in adapter)  # only these
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    try:
        await engine.load_lora_adapter_tensors("run-v3", adapter, LORA.alpha / LORA.rank, 3)
        assert engine.loaded_lora_adapters == {"run-v3": "<tensors>"}
        assert engine.weight_version == 3 and engine.active_lora_adapter == "run-v3"
        params = SamplingParams(max_new_tokens=12, temperature=0.7, seed=3)
        out = await engine.generate(PROMPT, params, lora_path="run-v3")
        assert out.versions == [3] * 12
        want = _teacher_logprobs(model, PROMPT, out.output_ids, 0.7)
        assert gap(out.logprobs, want) < TOL
        teacher = _teacher_logprobs(model, SCORED[:1], SCORED[1:])
        assert gap(await engine.prompt_logprobs(SCORED), teacher) < TOL
        assert gap(teacher, _teacher_logprobs(base, SCORED[:1], SCORED[1:])) > 1e-2
        live = next(iter(adapter.values()))  # the learner's own tensor (shared storage)
        kept = live.clone()
        with torch.no_grad():  # the engine copied the tensors: the learner trains on
            live.add_(1.0)
        try:
            assert gap(await engine.prompt_logprobs(SCORED), teacher) < TOL
        finally:
            with torch.no_grad():
                live.copy_(kept)
        with pytest.raises(ServerError, match="not loaded"):
            await engine.generate(PROMPT, params, lora_path="nope")
        with pytest.raises(ServerError, match="already loaded"):
            await engine.load_lora_adapter_tensors("run-v3", adapter, 2.0)
        await engine.unload_lora_adapter("run-v3")
        after = engine.model.state_dict()
        assert all(torch.equal(after[k], v) for k, v in before.items())  # the base, bit for bit
        assert engine.loaded_lora_adapters == {} and engine.active_lora_adapter is None
    finally:
        await engine.aclose()


async def test_adapter_load_checks_before_changing_anything(trained, tmp_path: Path) -> None:
    learner, _, path = trained
    engine = LocalEngine(build_tiny()[0], build_tiny()[1])
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    adapter = learner.adapter_state()
    key = next(k for k in adapter if k.endswith("q_proj.lora_B.weight"))
    bad_cases = [
        ({**adapter, key: adapter[key][:-1]}, "the base weight is"),
        ({k.replace("q_proj", "zz_proj"): v for k, v in adapter.items()}, "no linear module"),
        ({k: v for k, v in adapter.items() if k != key}, "lacks lora_A or lora_B"),
        ({"base_model.model.lm_head.weight": adapter[key]}, "not a lora_A/lora_B"),
    ]
    try:
        for bad, message in bad_cases:
            with pytest.raises(ServerError, match=message):
                await engine.load_lora_adapter_tensors("bad", bad, 2.0)
        with pytest.raises(ServerError, match="at most 256"):
            await engine.load_lora_adapter_tensors("x" * 257, adapter, 2.0)
        (tmp_path / "adapter_config.json").write_text("{not json")
        with pytest.raises(ServerError, match="no adapter_model.safetensors"):
            await engine.load_lora_adapter("bad", str(tmp_path))
        cfg = json.loads((path / "adapter_config.json").read_text()) | {"use_dora": True}
        (tmp_path / "adapter_config.json").write_text(json.dumps(cfg))
        (tmp_path / "adapter_model.safetensors").write_bytes(b"garbage")
        with pytest.raises(ServerError, match="use_dora is not supported"):
            await engine.load_lora_adapter("bad", str(tmp_path))
        (tmp_path / "adapter_config.json").write_text(json.dumps(cfg | {"use_dora": False}))
        with pytest.raises(ServerError, match="cannot read it"):
            await engine.load_lora_adapter("bad", str(tmp_path))
        after = engine.model.state_dict()
        assert all(torch.equal(after[k], v) for k, v in before.items())
        assert engine.loaded_lora_adapters == {}
        await engine.load_lora_adapter("good", str(path))  # the peft dir, read by the engine
        assert engine.loaded_lora_adapters == {"good": str(path)}
    finally:
        await engine.aclose()


@pytest.mark.parametrize("paged", [False, True])
async def test_reloads_and_full_updates_keep_the_base_exact(trained, paged: bool) -> None:
    """Both engine paths (the paged one on CPU too): adapter, full update, adapter again."""
    learner, model, _ = trained
    engine = LocalEngine(build_tiny()[0], build_tiny()[1], paged=paged, page_size=4)
    adapter, full = learner.adapter_state(), build_tiny()[0].state_dict()
    teacher = _teacher_logprobs(model, SCORED[:1], SCORED[1:])
    base = _teacher_logprobs(build_tiny()[0], SCORED[:1], SCORED[1:])
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    try:
        for i in range(2):
            await engine.load_lora_adapter_tensors(f"v{i}", adapter, 2.0, i)
            out = await engine.generate(SCORED, greedy)  # decoded on the merged weights
            assert gap(out.logprobs, _teacher_logprobs(model, SCORED, out.output_ids)) < TOL
            assert gap(await engine.prompt_logprobs(SCORED), teacher) < TOL
            await engine.update_weights_from_state_dict(full, 10 + i)  # the base, whole
            assert engine.active_lora_adapter is None and engine.loaded_lora_adapters
            with pytest.raises(ServerError, match="loaded but not active"):
                engine.check_lora(f"v{i}")
            out = await engine.generate(SCORED, greedy)
            base_out = _teacher_logprobs(build_tiny()[0], SCORED, out.output_ids)
            assert gap(out.logprobs, base_out) < TOL
            assert gap(await engine.prompt_logprobs(SCORED), base) < TOL
            await engine.unload_lora_adapter(f"v{i}")  # inactive: nothing to undo
        assert engine.loaded_lora_adapters == {}
    finally:
        await engine.aclose()


async def test_served_logprobs_after_a_peft_load_equal_the_learners(trained, server) -> None:
    _, model, path = trained
    url = server.url
    teacher = _teacher_logprobs(model, SCORED[:1], SCORED[1:])
    base = _teacher_logprobs(build_tiny()[0], SCORED[:1], SCORED[1:])
    status, out = await call(url, "/generate", score_body())
    assert status == 200 and gap(scored(out), base) < TOL
    load = {"lora_name": "run-v1", "lora_path": str(path), "pinned": False}
    status, out = await call(url, "/load_lora_adapter", load)
    assert (status, out) == (
        200,
        {"success": True, "error_message": "", "loaded_adapters": {"run-v1": str(path)}},
    )
    for lora in ("run-v1", None):  # the name, or null: what is served
        status, out = await call(url, "/generate", score_body(lora))
        assert status == 200 and gap(scored(out), teacher) < TOL
    batch = {"input_ids": [PROMPT, PROMPT[:4]], "lora_path": ["run-v1", None]}
    batch |= {"sampling_params": {"max_new_tokens": 6, "temperature": 0.5}, "return_logprob": True}
    status, outs = await call(url, "/generate", batch)
    assert status == 200
    for prompt, item in zip([PROMPT, PROMPT[:4]], outs, strict=True):
        got = [e[0] for e in item["meta_info"]["output_token_logprobs"]]
        assert gap(got, _teacher_logprobs(model, prompt, item["output_ids"], 0.5)) < TOL
    info = (await call(url, "/get_server_info", method="GET"))[1]
    assert info["loaded_lora_adapters"] == {"run-v1": str(path)}
    status, out = await call(url, "/unload_lora_adapter", {"lora_name": "run-v1"})
    assert (status, out) == (200, {"success": True, "error_message": "", "loaded_adapters": {}})
    status, out = await call(url, "/generate", score_body())
    assert status == 200 and gap(scored(out), base) < TOL  # the base again


async def test_lora_routes_refuse_strangers_and_bad_input(trained, server, tmp_path) -> None:
    _, _, path = trained
    url = server.url
    load = {"lora_name": "r", "lora_path": str(path)}
    for key in (None, "wrong"):
        status, _ = await call(url, "/load_lora_adapter", load, key=key)
        assert status == 401
        assert (await call(url, "/unload_lora_adapter", {"lora_name": "r"}, key=key))[0] == 401
    status, out = await call(url, "/generate", score_body("ghost"))
    assert status == 400 and "not loaded: ghost" in out["error"]["message"]
    status, out = await call(url, "/generate", score_body(["a", "b"]))  # a list, single form
    assert status == 400 and "expected a string" in out["error"]
    (tmp_path / "adapter_config.json").write_text("{}")
    bad = [
        ({"lora_name": "x" * 257, "lora_path": str(path)}, "at most 256 characters"),
        ({"lora_name": "r"}, "lora_path: expected a non-empty string"),
        ({"lora_name": "r", "lora_path": "relative/dir"}, "expected an absolute path"),
        ({"lora_name": "r", "lora_path": "/etc"}, "not under an allowed directory"),
        ({"lora_name": "r", "lora_path": str(tmp_path)}, "holds no adapter_model.safetensors"),
        ({"lora_name": "r", "lora_path": str(path / "nope")}, "expected a peft adapter dir"),
        ({"lora_name": "r", "lora_path": str(path), "pinned": "yes"}, "pinned"),
    ]
    for body, message in bad:
        status, out = await call(url, "/load_lora_adapter", body)
        assert status == 400 and out["success"] is False, body
        assert message in out["error_message"] and "\n" not in out["error_message"], out
        assert out["loaded_adapters"] == {}
    status, out = await call(url, "/unload_lora_adapter", {"lora_name": "never"})
    assert status == 400 and out["error_message"] == "unload_lora_adapter failed: " + (
        "LoRA adapter 'never' is not loaded"
    )
    status, _ = await call(url, "/load_lora_adapter", "x" * (70 * 1024))
    assert status == 413


async def test_generate_with_lora_path_conforms_to_sglang(sglang_api_types, server) -> None:
    body = score_body(["a"]) | {"input_ids": [SCORED]}
    request = sglang_api_types.GenerateRequest.from_json_value(body)
    assert request.lora_path == ["a"]
    status, out = await call(server.url, "/generate", body)
    assert status == 400 and "not loaded: a" in out["error"]["message"]
