"""Runs of decode steps end when the host needs them (the paged engine on CPU, the tiny model).

A run (``decode_steps`` > 1) ends after the step where a row sampled a stop token, where a
queued request could take a free row, or where the engine wants the model (a pause). On CPU
the host reads every step before launching the next, so a run ends right after that step;
sampling depends only on (seed, token index), so where runs end never changes what is sampled.
"""

from __future__ import annotations

import asyncio
import copy
import time
from typing import Any

from agentrl.inference.base import SamplingParams
from agentrl.inference.engine import LocalEngine

STOPS = (7, 11, 19)  # tokens random weights hit now and then


def sp(n: int, seed: int, **kw: Any) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=1.0, ignore_eos=True, seed=seed, **kw)


def engine(tiny: Any, steps: int) -> LocalEngine:
    model, tokenizer = tiny
    return LocalEngine(
        copy.deepcopy(model), tokenizer, seed=0, paged=True, page_size=4, decode_steps=steps
    )


def record_runs(eng: LocalEngine) -> list[tuple[int, int]]:
    """(steps planned, steps run) of every run of the engine from now on."""
    runner: Any = eng._batcher.paged  # type: ignore[attr-defined]
    runs: list[tuple[int, int]] = []
    decode_many = runner.decode_many

    def recorded(meta: Any, steps: int, cut: Any = None, launched: Any = None) -> Any:
        out = decode_many(meta, steps, cut, launched)
        runs.append((steps, out.shape[0]))
        return out

    runner.decode_many = recorded
    return runs


def at_step(eng: LocalEngine, step: int, action: Any, until: Any) -> None:
    """In the first run that reaches ``step``: call ``action`` on the event loop there and wait
    (in the worker thread, the run held) until ``until()`` holds."""
    batcher: Any = eng._batcher
    make_cut, loop, fired = batcher._cut, asyncio.get_running_loop(), []

    def hooked(plan: Any) -> Any:
        inner = make_cut(plan)

        def cut(i: int, sampled: list[list[float]]) -> bool:
            if i == step and not fired:
                fired.append(i)
                loop.call_soon_threadsafe(action)
                deadline = time.monotonic() + 10
                while not until():
                    assert time.monotonic() < deadline, "the event loop never acted"
                    time.sleep(0.001)
            return inner(i, sampled)

        return cut

    batcher._cut = hooked


async def test_a_run_ends_after_the_step_where_a_row_stops(tiny):
    jobs = [([1, 5, 6, 7], 23), ([1, 20], 9), ([3] * 13, 30), ([1, 40, 41], 17)]
    results = {}
    for steps in (1, 64):
        eng = engine(tiny, steps)
        runs = record_runs(eng)
        try:
            outs = await asyncio.gather(
                *(eng.generate(p, sp(n, i, stop_token_ids=STOPS)) for i, (p, n) in enumerate(jobs))
            )
        finally:
            await eng.aclose()
        results[steps] = (outs, runs)
    (single, _), (outs, runs) = results[1], results[64]
    for a, b in zip(single, outs, strict=True):
        assert a.output_ids == b.output_ids and a.finish_reason == b.finish_reason
        assert a.logprobs == b.logprobs
    assert sum(o.finish_reason == "stop" for o in outs) >= 2
    # each stop ended a run: as many runs ended early as rows stopped inside one
    stopped_in_run = [s for s, (planned, ran) in enumerate(runs) if ran < planned]
    assert len(stopped_in_run) >= 2
    # what every run decoded is what the rows kept: no step past a stop was run
    decoded = sum(ran for _, ran in runs)
    longest = max(len(o.output_ids) for o in outs)
    assert decoded <= longest  # (steps of rows that run side by side count once)


async def test_a_request_that_arrives_mid_run_joins_after_that_step(tiny):
    eng = engine(tiny, 64)
    runs = record_runs(eng)
    late: list[asyncio.Task[Any]] = []
    batcher: Any = eng._batcher
    at_step(
        eng,
        3,
        lambda: late.append(asyncio.ensure_future(eng.generate([2, 9, 4], sp(12, 1)))),
        lambda: len(batcher.waiting) == 1,
    )
    try:
        first = await eng.generate([1, 5, 6], sp(120, 0))
        second = await late[0]
        alone = [
            await eng.generate([1, 5, 6], sp(120, 0)),
            await eng.generate([2, 9, 4], sp(12, 1)),
        ]
    finally:
        await eng.aclose()
    assert runs[0] == (64, 4)  # steps 0..3 ran; the request joined at the next step
    assert first.output_ids == alone[0].output_ids and second.output_ids == alone[1].output_ids
    assert len(first.output_ids) == 120 and len(second.output_ids) == 12


async def test_a_pause_mid_run_ends_it_and_in_place_resumes_the_same_tokens(tiny):
    eng = engine(tiny, 64)
    runs = record_runs(eng)
    paused: list[asyncio.Task[Any]] = []
    batcher: Any = eng._batcher
    at_step(
        eng,
        5,
        lambda: paused.append(asyncio.ensure_future(eng.pause("in_place"))),
        lambda: batcher.cut_run,
    )
    try:
        task = asyncio.ensure_future(eng.generate([1, 5, 6], sp(100, 0)))
        while not paused:
            await asyncio.sleep(0.001)
        await paused[0]  # returns once the run in flight has ended
        held = len(batcher.running[0].output_ids)
        await eng.resume()
        out = await task
        again = await eng.generate([1, 5, 6], sp(100, 0))
    finally:
        await eng.aclose()
    assert runs[0] == (64, 6) and held == 1 + 6  # the prefill's token, then steps 0..5
    assert out.output_ids == again.output_ids and len(out.output_ids) == 100


async def test_an_abort_mid_run_ends_it_and_keeps_the_runs_tokens(tiny):
    eng = engine(tiny, 64)
    runs = record_runs(eng)
    aborts: list[Any] = []
    at_step(
        eng,
        4,
        lambda: aborts.append(asyncio.ensure_future(eng.abort())),
        lambda: bool(eng._batcher.running[0].aborted),
    )
    try:
        out = await eng.generate([1, 5, 6], sp(100, 0))
        full = await eng.generate([1, 5, 6], sp(100, 0))
    finally:
        await eng.aclose()
    assert runs[0] == (64, 5)
    assert out.finish_reason == "abort"
    assert out.output_ids == full.output_ids[:6]  # the prefill's token, then steps 0..4
