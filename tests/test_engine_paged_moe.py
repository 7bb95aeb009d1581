"""Qwen3-MoE on the paged engine (CPU, float32, the tiny MoE): log-probs and routed experts.

The paged path is forced on a CPU (no CUDA graphs; the experts loop over ``F.linear`` as the
learner's do there): greedy and sampled log-probs equal a teacher-forced transformers pass, and
equal the learner's (:class:`~agentrl.kernels.packed_body.PackedBody`, the same tokens); the
routed experts it records equal the routers' choice in that pass, across a reused prefix, a
run of decode steps and a retract over a weight update. A Qwen3-MoE model takes the paged path
by default where the paged path is the default (CUDA), and the engine says which path it took.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import numpy as np
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from agentrl.inference.base import SamplingParams
from agentrl.inference.engine import LocalEngine
from agentrl.inference.engine.paged_moe import RoutingSlots, route, slots_of
from agentrl.inference.engine.path_choice import choose_path
from agentrl.kernels.packed_body import PackedBody, unsupported_reason
from agentrl.routing import RoutingCapture
from agentrl.tiny import build_tiny, build_tiny_moe

TOL = 1e-4
LAYERS, TOP_K = 3, 2  # the tiny-moe preset


@pytest.fixture(scope="module")
def models() -> dict[int, Any]:
    torch.manual_seed(0)
    return {seed: build_tiny_moe(seed=seed)[0] for seed in (0, 1)}


def engine(**kw: Any) -> LocalEngine:
    model, tokenizer = build_tiny_moe(seed=0)
    return LocalEngine(model, tokenizer, seed=0, paged=True, page_size=4, **kw)


def sp(n: int, temperature: float = 1.0) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=temperature, ignore_eos=True)


def teacher(model: Any, prompt: list[int], out: list[int], t: float) -> tuple[Any, np.ndarray]:
    """Teacher-forced log-probs of ``out`` and routed experts of every fed token."""
    tokens = prompt + out
    with RoutingCapture(model) as cap, torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens[:-1]])).logits[0, len(prompt) - 1 :]
    logprobs = torch.log_softmax(logits.float() / (t or 1.0), dim=-1)
    picked = logprobs.gather(1, torch.tensor(out)[:, None])[:, 0]
    return picked, cap.pop().numpy().astype(np.int16)


def learner(model: Any, prompt: list[int], out: list[int], t: float) -> torch.Tensor:
    """The learner's log-probs of ``out`` (its packed body and head, float32)."""
    tokens = prompt + out
    body = PackedBody(model)
    with torch.no_grad():
        n = len(tokens) - 1
        hidden = body(torch.tensor(tokens[:-1]), torch.arange(n), [n])
        logits = model.lm_head(hidden[len(prompt) - 1 :]).float()
    return torch.log_softmax(logits / (t or 1.0), -1).gather(1, torch.tensor(out)[:, None])[:, 0]


async def test_moe_paged_logprobs_and_routing_equal_transformers_and_learner(models) -> None:
    eng = engine(max_batch_size=8)
    assert eng.paged and eng.path == "paged" and "Qwen3MoeForCausalLM" in eng.path_reason
    assert eng.return_routed_experts  # on by default for an MoE model
    cases = {"g": ([1, 5, 6, 7, 8, 9, 10], 0.0), "s": ([1, 11], 1.0), "t": ([3] * 13, 0.7)}
    outs = await asyncio.gather(
        *(
            eng.generate(p, sp(12, t), rid=r, return_routed_experts=True)
            for r, (p, t) in cases.items()
        )
    )
    # the same prompt again: its full pages come from the prefix cache (rows included)
    again = await eng.generate(cases["g"][0], sp(12, 0.0), return_routed_experts=True)
    await eng.aclose()
    assert eng.prefill_stats()["cached_tokens"] >= 4
    assert again.output_ids == outs[0].output_ids
    for out, (prompt, t) in [*zip(outs, cases.values(), strict=True), (again, cases["g"])]:
        ref, experts = teacher(models[0], prompt, out.output_ids, t)
        got = torch.tensor(out.logprobs)
        assert (got - ref).abs().max().item() < TOL
        assert (got - learner(models[0], prompt, out.output_ids, t)).abs().max().item() < TOL
        assert out.routed_experts is not None and out.routed_experts.dtype == np.int16
        np.testing.assert_array_equal(out.routed_experts, experts)
        assert len(np.unique(out.routed_experts)) > TOP_K  # the routing depends on the token
    greedy = outs[0]
    ref, _ = teacher(models[0], cases["g"][0], greedy.output_ids, 0.0)
    with torch.no_grad():  # greedy: each token is the argmax of the teacher's logits
        tokens = cases["g"][0] + greedy.output_ids
        logits = models[0](input_ids=torch.tensor([tokens[:-1]])).logits[0, 6:]
    assert logits.argmax(-1).tolist() == greedy.output_ids


async def test_moe_runs_of_steps_and_retract_keep_the_rows_that_sampled(models) -> None:
    eng = engine(decode_steps=8)
    prompt = [1, 5, 6, 7, 8]
    task = asyncio.create_task(eng.generate(prompt, sp(20), rid="r", return_routed_experts=True))
    async with asyncio.timeout(30):
        while (eng.num_output_tokens("r") or 0) < 5:
            await asyncio.sleep(0.001)
    await eng.pause("retract")
    k = eng.num_output_tokens("r")
    assert k is not None and 5 <= k < 20
    await eng.update_weights_from_state_dict(models[1].state_dict(), 1)
    await eng.resume()  # recomputed on version 1; the rows recorded before keep version 0's
    out = await task
    await eng.aclose()
    assert out.versions == [0] * k + [1] * (20 - k)
    tokens, cut = prompt + out.output_ids, len(prompt) + k - 1
    got = out.routed_experts
    assert got is not None and got.shape == (len(tokens) - 1, LAYERS, TOP_K)
    _, old = teacher(models[0], prompt, out.output_ids, 1.0)
    _, new = teacher(models[1], prompt, out.output_ids, 1.0)
    np.testing.assert_array_equal(got[:cut], old[:cut])
    np.testing.assert_array_equal(got[cut:], new[cut:])
    assert (old != new).any()


async def test_moe_path_is_said_and_routing_can_be_off(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="agentrl.inference.engine"):
        eng = engine(return_routed_experts=False)
    assert "engine path: paged (Qwen3MoeForCausalLM" in caplog.text
    assert not eng.return_routed_experts
    out = await eng.generate([1, 2, 3], sp(3))
    assert out.routed_experts is None and len(out.output_ids) == 3
    await eng.aclose()
    model, tokenizer = build_tiny_moe(seed=0)
    plain = LocalEngine(model, tokenizer)  # CPU default: transformers, and it says why
    assert plain.path == "transformers" and "not on CUDA" in plain.path_reason
    with pytest.raises(ValueError, match="dense models only"):
        engine(batch_invariant=True)


def test_moe_models_take_the_paged_path_by_default_on_cuda() -> None:
    moe, _ = build_tiny_moe(seed=0)
    dense, _ = build_tiny(seed=0)
    assert unsupported_reason(moe, moe=True) is None  # the engine's default check
    path, why = choose_path(moe, None, True)  # on CUDA, by default
    assert path == "paged" and why.startswith("Qwen3MoeForCausalLM: paged")
    assert choose_path(moe, None, False)[0] == "transformers"  # off CUDA
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    path, why = choose_path(gpt2, None, True)
    assert path == "transformers"
    assert why.startswith("the paged engine does not support architecture GPT2"), why
    assert choose_path(dense, False, True) == ("transformers", "paged=False")


def test_route_equals_the_router_module_and_slots_hold_rows(models) -> None:
    gate = models[0].model.layers[0].mlp.gate
    h = torch.randn(7, gate.hidden_dim, generator=torch.Generator().manual_seed(0))
    _, ref_w, ref_e = gate(h)
    w, e = route(h, gate.weight, int(gate.top_k), bool(gate.norm_topk_prob))
    assert torch.equal(e, ref_e) and torch.equal(w, ref_w)
    slots = RoutingSlots(2, 2, 16, torch.device("cpu"))
    where = slots_of([3, 1], 4, 2, 6)  # positions 2..5: page 3 slots 14, 15; page 1 slots 4, 5
    assert where.tolist() == [14, 15, 4, 5]
    slots.layer(1).index_copy_(0, where, e[:4].to(torch.int16))
    rows = slots.rows(where)
    assert rows.shape == (4, 2, 2) and (rows[:, 0] == -1).all()
    assert torch.equal(rows[:, 1], e[:4].to(torch.int16))


def test_benchmark_dry_run_reports_both_paths(monkeypatch) -> None:
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "benchmarks" / "moe_engine_gpu.py"
    spec = importlib.util.spec_from_file_location("moe_engine_gpu", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.syspath_prepend(str(path.parent))
    spec.loader.exec_module(bench)
    result = bench.main(["--dry-run"])
    assert result["hf_tokens_per_s"] > 0 and result["paged_tokens_per_s"] > 0
    assert result["speedup"] == pytest.approx(  # the speedup is printed to 2 decimals
        result["paged_tokens_per_s"] / result["hf_tokens_per_s"], rel=0.01, abs=0.006
    )
    assert result["logprob_mismatch"] < TOL and result["routing_agreement"] == 1.0
    assert result["paged_path"].startswith("paged (Qwen3MoeForCausalLM") and result["card"]
