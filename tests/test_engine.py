"""LocalEngine in process: exact log-probs under batching; sampling, stops, abort, pause."""

from __future__ import annotations

import asyncio
import copy
import logging
from typing import Any

import pytest
import torch

from agentrl.errors import ServerError
from agentrl.inference import sglang_api
from agentrl.inference.base import InferenceClient, SamplingParams
from agentrl.inference.engine import LocalEngine
from agentrl.tiny import build_tiny_model

TOL = 1e-4  # float32 on CPU: batched decode vs one teacher-forced pass agree to ~1e-6


def sp(n: int = 16, temperature: float = 1.0, **kw: Any) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=temperature, ignore_eos=True, **kw)


async def wait_tokens(engine: LocalEngine, rid: str, n: int) -> None:
    async with asyncio.timeout(20):
        while (engine.num_output_tokens(rid) or 0) < n:
            await asyncio.sleep(0.001)


def max_err(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)


@pytest.fixture
async def engine(tiny):
    model, tokenizer = tiny
    eng = LocalEngine(model, tokenizer, seed=0)
    yield eng
    await eng.aclose()


def test_is_an_inference_client(engine):
    assert isinstance(engine, InferenceClient)
    assert isinstance(engine, LocalEngine) and engine.max_model_len == 1024


async def test_logprobs_equal_teacher_forcing_with_ragged_batch_and_late_joins(
    engine, teacher_logprobs
):
    # Different prompt lengths (left padding + per-row positions) and requests joining between
    # decode steps (cache merge): every log-prob must equal one teacher-forced forward pass.
    first = {"a": ([1, 5, 6, 7, 8, 9, 10, 11, 12], 1.0), "b": ([1, 20], 0.7)}
    late = {
        "c": ([1, 30, 31, 32, 33], 0.0),
        "d": ([1, 40, 41], 1.3),
        "e": (list(range(3, 40)), 1.0),
    }
    tasks = {
        rid: asyncio.create_task(engine.generate(p, sp(24, t), rid=rid))
        for rid, (p, t) in first.items()
    }
    await wait_tokens(engine, "a", 3)
    assert engine.num_output_tokens("b") is not None  # still running when the others join
    tasks |= {
        rid: asyncio.create_task(engine.generate(p, sp(24, t), rid=rid))
        for rid, (p, t) in late.items()
    }
    outs = {rid: await task for rid, task in tasks.items()}
    for rid, (prompt, temp) in (first | late).items():
        out = outs[rid]
        assert (out.rid, out.finish_reason, len(out.output_ids)) == (rid, "length", 24)
        assert out.versions == [0] * 24 and out.prompt_tokens == len(prompt)
        assert (
            max_err(out.logprobs, teacher_logprobs(engine.model, prompt, out.output_ids, temp))
            < TOL
        )


async def test_greedy_picks_the_argmax_of_teacher_forced_logits(engine):
    prompts = [[1, 50, 51, 52, 53, 54], [1, 60]]
    outs = await asyncio.gather(*(engine.generate(p, sp(12, 0.0)) for p in prompts))
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            logits = engine.model(input_ids=torch.tensor([prompt + out.output_ids])).logits[0]
        assert out.output_ids == logits[len(prompt) - 1 : -1].argmax(-1).tolist()
        # Greedy returns the plain log_softmax(logits).
        plain = torch.log_softmax(logits[len(prompt) - 1 : -1], -1).max(-1).values.tolist()
        assert max_err(out.logprobs, plain) < TOL


async def test_arrivals_together_prefill_in_one_forward_with_the_same_logprobs(engine):
    # Requests queued before a step (the re-sends after a weight update) are prefilled in one
    # left-padded forward; each row must compute what it computes alone (float32: 1e-5).
    prompts = [[1, *range(10, 10 + n)] for n in (3, 40, 17, 1, 64, 8)]
    alone = [await engine.generate(p, sp(6, 0.0)) for p in prompts]
    before = engine.prefill_stats()
    assert before["steps"] == len(prompts) and before["requests"] == len(prompts)
    together = await asyncio.gather(*(engine.generate(p, sp(6, 0.0)) for p in prompts))
    after = engine.prefill_stats()
    assert after["steps"] - before["steps"] == 1
    assert after["requests"] - before["requests"] == len(prompts)
    assert after["tokens"] - before["tokens"] == sum(map(len, prompts))
    for a, b in zip(alone, together, strict=True):
        assert a.output_ids == b.output_ids
        assert max_err(a.logprobs, b.logprobs) < 1e-5


async def test_seeded_sampling_does_not_depend_on_the_batch(engine):
    prompt = [1, 70, 71, 72]
    alone = await engine.generate(prompt, sp(20, seed=7))
    crowd = [engine.generate([1, 80 + i], sp(20)) for i in range(5)]
    together, *_ = await asyncio.gather(engine.generate(prompt, sp(20, seed=7)), *crowd)
    other = await engine.generate(prompt, sp(20, seed=8))
    assert together.output_ids == alone.output_ids
    assert other.output_ids != alone.output_ids


async def test_top_k_samples_from_the_top_k_but_returns_full_vocab_logprobs(
    engine, teacher_logprobs, caplog, monkeypatch
):
    monkeypatch.setattr(sglang_api, "_truncation_warned", False)
    prompt = [1, 90, 91]
    with caplog.at_level(logging.WARNING):
        outs = await asyncio.gather(*(engine.generate(prompt, sp(16, top_k=3)) for _ in range(3)))
    warnings = [r for r in caplog.records if "not the behaviour policy" in r.getMessage()]
    assert len(warnings) == 1  # once, not per request
    for out in outs:
        with torch.no_grad():
            logits = engine.model(input_ids=torch.tensor([prompt + out.output_ids])).logits[0]
        top3 = logits[len(prompt) - 1 : -1].topk(3, dim=-1).indices.tolist()
        assert all(tok in top for tok, top in zip(out.output_ids, top3, strict=True))
        assert max_err(out.logprobs, teacher_logprobs(engine.model, prompt, out.output_ids)) < TOL


async def test_stop_tokens_eos_and_ignore_eos(tiny):
    model, tokenizer = tiny
    engine = LocalEngine(model, tokenizer)
    prompt = [1, 33, 34]
    seeded: dict[str, Any] = {"temperature": 1.0, "seed": 5}  # same seed, same tokens
    free = (await engine.generate(prompt, sp(20, **seeded))).output_ids
    k = next(i for i in range(3, 20) if free[i] not in free[:i])  # a first occurrence, not at 0
    stop = await engine.generate(prompt, sp(20, stop_token_ids=(free[k],), **seeded))
    assert stop.output_ids == free[: k + 1]  # the stop token is included, as in SGLang
    assert (stop.finish_reason, stop.matched_stop) == ("stop", free[k])
    await engine.aclose()
    # The model's EOS stops unless ignore_eos.
    model.config.eos_token_id = model.generation_config.eos_token_id = free[k]
    engine = LocalEngine(model, tokenizer)
    eos = await engine.generate(prompt, SamplingParams(max_new_tokens=20, **seeded))
    assert eos.output_ids == free[: k + 1] and eos.finish_reason == "stop"
    assert (await engine.generate(prompt, sp(20, **seeded))).output_ids == free
    empty = await engine.generate(prompt, sp(0))
    assert (empty.output_ids, empty.finish_reason) == ([], "length")
    await engine.aclose()


async def test_abort_one_returns_partial_output_and_others_continue(engine, teacher_logprobs):
    prompt = [1, 44, 45]
    tasks = {r: asyncio.create_task(engine.generate(prompt, sp(600), rid=r)) for r in "xyz"}
    await wait_tokens(engine, "x", 5)
    await engine.abort("x")
    x = await tasks["x"]
    assert x.finish_reason == "abort" and 5 <= len(x.output_ids) < 600
    assert len(x.logprobs) == len(x.versions) == len(x.output_ids)
    assert x.meta["finish_message"] == "Aborted"
    assert max_err(x.logprobs, teacher_logprobs(engine.model, prompt, x.output_ids)) < TOL
    assert not tasks["y"].done()
    await engine.abort()  # all
    y, z = await tasks["y"], await tasks["z"]
    assert y.finish_reason == z.finish_reason == "abort"


async def in_flight_step(engine: LocalEngine, rid: str, n: int) -> int:
    """Wait until ``rid`` has ``n`` tokens and is in a step being computed; its token count.

    The step runs in the worker thread while the event loop polls, so between this return and
    the caller's next ``await`` that step is still in flight.
    """
    async with asyncio.timeout(20):
        while True:
            req = engine._batcher.requests.get(rid)  # (internals: the step's membership)
            if req is not None and len(req.output_ids) >= n and id(req) in engine._batcher.stepping:
                return len(req.output_ids)
            await asyncio.sleep(0)


@pytest.mark.parametrize("how", ["abort", "pause"])
async def test_abort_during_a_step_keeps_the_token_it_samples(engine, teacher_logprobs, how):
    # SGLang stops a running request after at most one more decode step and returns every
    # token: the token of the step in flight is kept, with its log-prob and version.
    prompt = [1, 50, 51, 52]
    task = asyncio.create_task(engine.generate(prompt, sp(600), rid="k"))
    other = asyncio.create_task(engine.generate([1, 7], sp(600), rid="o"))
    before = await in_flight_step(engine, "k", 6)
    if how == "abort":
        await engine.abort("k")
    else:
        assert await engine.pause("abort") == 0  # returns once the step in flight is applied
        assert task.done() and other.done()
    out = await task
    assert out.finish_reason == "abort" and out.meta["finish_message"] == "Aborted"
    assert len(out.output_ids) == before + 1
    assert out.versions == [0] * (before + 1)
    assert max_err(out.logprobs, teacher_logprobs(engine.model, prompt, out.output_ids)) < TOL
    if how == "pause":
        await engine.resume()
    else:
        assert not other.done()
        await engine.abort("o")
    assert (await other).finish_reason == "abort"


@pytest.mark.parametrize("paged", [False, True])
async def test_finished_requests_get_their_results_once_the_next_step_is_launched(
    tiny, teacher_logprobs, paged
):
    # A request's caller (an episode's next turn, its reward) must not hold up the next step's
    # launch: a request that ends in a step gets its result once the next step is queued (on a
    # CPU: as it starts), or as soon as no step follows.
    model, tokenizer = tiny
    eng = LocalEngine(copy.deepcopy(model), tokenizer, seed=0, paged=paged)
    batcher: Any = eng._batcher
    reqs: dict[str, Any] = {}
    seen: list[tuple[str, bool, bool]] = []  # (when, "short" ended, its caller has the result)
    submit, compute = batcher.submit, batcher.compute

    def submitted(req: Any) -> None:
        reqs[req.rid] = req
        submit(req)

    def observed(plan: Any, launched: Any) -> Any:
        short = reqs["short"]
        seen.append(("start", short.done, short.future.done()))

        def said() -> None:
            seen.append(("launched", short.done, short.future.done()))
            launched()

        return compute(plan, said)

    batcher.submit, batcher.compute = submitted, observed
    try:
        prompt = [1, 9, 8, 7]
        outs = await asyncio.gather(
            eng.generate(prompt, sp(3), rid="short"), eng.generate([1, 5], sp(9), rid="long")
        )
    finally:
        await eng.aclose()
    short, long = outs
    assert len(short.output_ids) == 3 and len(long.output_ids) == 9
    assert max_err(short.logprobs, teacher_logprobs(model, prompt, short.output_ids)) < TOL
    # the step after "short"'s last one starts with "short" ended, its result held until the
    # step says it is launched; every later step sees it delivered
    first = next(i for i, (_, ended, _) in enumerate(seen) if ended)
    assert seen[first] == ("start", True, False)
    assert seen[first + 1] == ("launched", True, False)
    assert all(delivered for _, _, delivered in seen[first + 2 :])
    assert len(seen) == 2 * 9 and not eng._batcher.undelivered


async def test_abort_in_waiting_queue(tiny):
    engine = LocalEngine(*tiny, max_batch_size=1)
    busy = asyncio.create_task(engine.generate([1, 2], sp(600), rid="busy"))
    queued = asyncio.create_task(engine.generate([1, 3], sp(5), rid="queued"))
    await wait_tokens(engine, "busy", 2)
    assert engine.stats() == {
        "num_running_reqs": 1,
        "num_waiting_reqs": 1,
        "max_running_requests": 1,
    }
    await engine.abort("queued")
    out = await queued
    assert (out.output_ids, out.finish_reason) == ([], "abort")
    assert out.meta["finish_message"] == "Abort in waiting queue"
    await engine.aclose()
    assert (await busy).finish_reason == "abort"


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("mode", ["retract", "in_place"])
async def test_pause_update_resume_splits_versions(tiny, teacher_logprobs, mode, paged):
    model, tokenizer = tiny
    # the paged engine (a GPU's path, here on the CPU) with small pages: the request spans several
    engine = LocalEngine(model, tokenizer, paged=paged, **({"page_size": 4} if paged else {}))
    new_model = build_tiny_model(tokenizer, seed=1)
    prompt = [1, 25, 26, 27]
    task = asyncio.create_task(engine.generate(prompt, sp(40, seed=3), rid="r"))
    await wait_tokens(engine, "r", 5)
    assert await engine.pause(mode) == 1
    before = engine.num_output_tokens("r")
    await asyncio.sleep(0.05)
    assert engine.num_output_tokens("r") == before  # paused means paused
    await engine.update_weights_from_state_dict(new_model.state_dict(), 1)
    await engine.resume()
    out = await task
    a = before or 0
    assert out.versions == [0] * a + [1] * (40 - a) and 5 <= a < 40
    # The engine's model now holds the new weights; a fresh seed-0 build is the old policy.
    old = teacher_logprobs(build_tiny_model(tokenizer), prompt, out.output_ids)
    assert max_err(out.logprobs[:a], old[:a]) < TOL
    new = teacher_logprobs(new_model, prompt, out.output_ids)
    if mode == "retract":  # the cache was rebuilt with the new weights: exact under them
        assert out.meta["num_retractions"] == 1
        assert max_err(out.logprobs[a:], new[a:]) < TOL
    else:  # in place: the prefix's cache still holds what the old weights computed
        assert max_err(out.logprobs[a:], new[a:]) > 1e-3
    await engine.aclose()


async def test_pause_abort_aborts_open_requests_and_queues_new_ones(engine):
    running = asyncio.create_task(engine.generate([1, 9], sp(600), rid="old"))
    await wait_tokens(engine, "old", 2)
    await engine.pause("abort")
    assert (await running).finish_reason == "abort"
    late = asyncio.create_task(engine.generate([1, 9], sp(4), rid="new"))
    await asyncio.sleep(0.05)
    assert engine.num_output_tokens("new") == 0 and not late.done()
    await engine.resume()
    assert len((await late).output_ids) == 4


async def test_update_without_pause_drains_the_running_batch(engine):
    running = asyncio.create_task(engine.generate([1, 9], sp(60), rid="old"))
    await wait_tokens(engine, "old", 2)
    state = build_tiny_model(engine.tokenizer, seed=2).state_dict()
    await engine.update_weights_from_state_dict(state, 5)
    assert running.done() and (await running).versions == [0] * 60  # finished on old weights
    assert engine.weight_version == 5
    assert (await engine.generate([1, 9], sp(3))).versions == [5, 5, 5]


async def test_update_from_disk_changes_version_and_outputs(engine, tmp_path, teacher_logprobs):
    prompt = [1, 12, 13]
    before = await engine.generate(prompt, sp(12, seed=11))
    new_model = build_tiny_model(engine.tokenizer, seed=1)
    new_model.save_pretrained(tmp_path / "v1")
    await engine.update_weights_from_disk(str(tmp_path / "v1"), 1)
    after = await engine.generate(prompt, sp(12, 1.0))
    assert engine.weight_version == 1 and after.versions == [1] * 12 and after.weight_version == 1
    # Same seed, new weights: other tokens (a random-init model's greedy just repeats its input).
    assert (await engine.generate(prompt, sp(12, seed=11))).output_ids != before.output_ids
    assert max_err(after.logprobs, teacher_logprobs(new_model, prompt, after.output_ids)) < TOL
    with pytest.raises(ServerError, match="no \\*.safetensors|expected a local HF model"):
        await engine.update_weights_from_disk(str(tmp_path / "missing"), 2)
    wrong = build_tiny_model(engine.tokenizer, hidden_size=64, head_dim=16)
    with pytest.raises(ServerError, match="expected shape"):
        await engine.update_weights_from_state_dict(wrong.state_dict(), 3)
    assert engine.weight_version == 1  # a failed update changes nothing


async def test_repeated_pushes_of_one_layout_are_one_copy_and_still_checked(engine):
    # The in-process push hands over the same names, shapes and dtypes at every step: after the
    # first (checked) load, one multi-tensor copy loads them, values read at that moment.
    first = build_tiny_model(engine.tokenizer, seed=1).state_dict()
    second = build_tiny_model(engine.tokenizer, seed=2).state_dict()
    assert not engine._loader.repeats(first)
    await engine.update_weights_from_state_dict(first, 1)
    assert engine._loader.repeats(second)
    await engine.update_weights_from_state_dict(second, 2)
    with torch.no_grad():
        second["model.norm.weight"].mul_(-3.0)  # a learner's update, in place
    await engine.update_weights_from_state_dict(second, 3)
    own = engine.model.state_dict()
    assert all(torch.equal(own[k], v) for k, v in second.items())
    assert own["model.norm.weight"].min() < 0  # the in-place change arrived
    assert engine.weight_version == 3
    wrong = build_tiny_model(engine.tokenizer, hidden_size=64, head_dim=16).state_dict()
    with pytest.raises(ServerError, match="expected shape"):
        await engine.update_weights_from_state_dict(wrong, 4)
    assert engine.weight_version == 3  # and the weights are still the third push's:
    assert all(torch.equal(engine.model.state_dict()[k], v) for k, v in second.items())
    missing = {k: v for k, v in second.items() if k != "model.norm.weight"}
    with pytest.raises(ServerError, match="missing parameters"):
        await engine.update_weights_from_state_dict(missing, 4)
    wide = {k: v.double() * 1.5 for k, v in first.items()}  # another dtype: cast as copied
    for version in (5, 6):
        await engine.update_weights_from_state_dict(wide, version)
        assert engine._loader.repeats(wide)
        assert all(torch.equal(engine.model.state_dict()[k], v.float()) for k, v in wide.items())
        wide["model.norm.weight"].add_(1.0)


async def test_prompt_logprobs_and_request_validation(engine, teacher_logprobs):
    ids = [1, 5, 9, 14, 2]
    assert (
        max_err(await engine.prompt_logprobs(ids), teacher_logprobs(engine.model, ids[:1], ids[1:]))
        < TOL
    )
    blocker = asyncio.create_task(engine.generate([1, 2], sp(600), rid="dup"))
    await wait_tokens(engine, "dup", 1)
    cases = [
        ([], sp(4), None, "non-empty"),
        ([1, 2], sp(4), "dup", "Duplicate request ID"),
        ([1, 10_000], sp(4), None, "expected ids in"),
        ([1] * 1000, sp(100), None, "maximum context length"),
    ]
    for ids_, params, rid, message in cases:
        with pytest.raises(ServerError, match=message) as info:
            await engine.generate(ids_, params, rid=rid)
        assert info.value.status == 400
    await engine.abort("dup")
    await blocker
