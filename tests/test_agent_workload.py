"""benchmarks/agent_loop_gpu.py's synthetic agent workload: seeded long tails, the env on a real
tiny engine (per-turn lengths through ``Env.turn_max_new_tokens``), the probes, and the
benchmark's ``--dry-run`` end to end in a subprocess."""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from _agent_workload import AgentEnv, Drawn, HistoryClient, Spans, Workload  # noqa: E402

from agentrl.inference.engine import LocalEngine  # noqa: E402
from agentrl.rollout.engine import RolloutConfig, RolloutEngine  # noqa: E402
from agentrl.types import Task  # noqa: E402

KEYS = [f"train-0-{i}/{g}" for i in range(500) for g in range(4)]


def test_draws_are_seeded_bounded_and_long_tailed() -> None:
    w = Workload(turns=8)
    assert w.plan("train-0-3/1") == w.plan("train-0-3/1")  # same key, same draws
    assert w.plan("train-0-3/1") != w.plan("train-0-3/2")
    assert Workload(turns=8, seed=1).plan("train-0-3/1") != w.plan("train-0-3/1")
    d = Drawn.of(w, KEYS)
    assert len(d.responses) == len(d.latencies_s) == 8 * len(KEYS)
    assert len(d.observations) == 7 * len(KEYS)  # none after the last turn
    for values, (lo, hi, median) in ((d.responses, w.response), (d.observations, w.observation),
                                     (d.latencies_s, w.latency_s)):  # fmt: skip
        assert lo <= min(values) and max(values) <= hi
        assert statistics.median(values) == pytest.approx(median, rel=0.1)
        assert max(values) == hi  # the tail reaches the bound (clipped there)
    long = sum(r > 4 * 256 for r in d.responses) / len(d.responses)
    assert 0.04 < long < 0.15  # lognormal sigma 1: P(> 4x median) = 8.3%
    assert statistics.mean(d.responses) > 1.4 * statistics.median(d.responses)  # right skew
    slow = sum(s > 1.0 for s in d.latencies_s) / len(d.latencies_s)
    assert 0.01 < slow < 0.06  # sigma 1.2: P(> 10x median) = 2.8%
    assert min(d.latencies_s) == 0.01  # clipped at 10 ms too


@pytest.fixture(scope="module")
def engine():
    eng = LocalEngine.from_pretrained("tiny")
    yield eng
    asyncio.run(eng.aclose())


TINY: dict[str, Any] = {"response": (3, 12, 5), "observation": (4, 20, 8),
                        "latency_s": (0.002, 0.03, 0.005), "prompt_tokens": 12,
                        "group_size": 2}  # fmt: skip


async def test_env_sets_each_turn_length_observation_and_latency(engine) -> None:
    spans = Spans()
    client = HistoryClient(engine, spans)
    cfg = RolloutConfig(group_size=2, max_turns=8, max_new_tokens=12, max_total_tokens=1024,
                        ignore_eos=True, seed=0)  # fmt: skip
    ro = RolloutEngine(client, engine.tokenizer, cfg)
    client.counting = True
    w = Workload(turns=3, **TINY)
    task = Task(id="t7", prompt="go")
    t0 = time.perf_counter()
    (group,) = await ro.run_groups(lambda: AgentEnv(spans=spans, **w.kwargs()), [task])
    wall = time.perf_counter() - t0
    waits = []
    for traj in group.trajectories:
        plan = w.plan(f"t7/{traj.group_index}")
        assert traj.error is None and traj.finish_reason == "terminated"
        said = [s.end - s.start for s in traj.turns if s.kind == "assistant"]
        seen = [s.end - s.start for s in traj.turns if s.kind == "observation"]
        assert said == plan.responses  # the env's length, not rollout.max_new_tokens
        # the tool text is one token a character; the markup around it is the same each turn
        markup = {n - k for n, k in zip(seen, plan.observations, strict=True)}
        assert len(markup) == 1 and 0 < markup.pop() < 40
        assert 0 <= traj.reward < 1  # the hashed reward
        waits.append(sum(plan.latencies_s))
    assert len(spans.spans["env_wait"]) == 6  # one wait a turn, two episodes
    slept = sorted(b - a for a, b in spans.spans["env_wait"])
    assert sum(slept) >= sum(waits) - 1e-3 and wall >= max(waits)
    # turns 2 and 3 re-send the conversation so far: all of it is history
    assert client.resent == sum(t.turns[3].start + t.turns[1].start for t in group.trajectories)


class _BadCap(AgentEnv):
    def turn_max_new_tokens(self, turn: int) -> int | None:
        return 0


class _Capped(AgentEnv):
    def turn_max_new_tokens(self, turn: int) -> int | None:
        return 3


async def test_turn_cap_is_checked_and_cut_turns_say_max_new_tokens(engine) -> None:
    cfg = RolloutConfig(group_size=1, max_turns=4, max_new_tokens=12, max_total_tokens=512, seed=0)
    ro = RolloutEngine(engine, engine.tokenizer, cfg)
    kw = Workload(turns=2, **TINY).kwargs()
    (bad,) = await ro.run_groups(lambda: _BadCap(**kw), [Task(id="b", prompt="go")])
    traj = bad.trajectories[0]
    assert traj.info["failure"] == "env"
    assert "turn_max_new_tokens(0) returned 0" in str(traj.error)
    # EOS not ignored: a turn cut by the env's cap is cut by "max_new_tokens", not the context
    (cut,) = await ro.run_groups(lambda: _Capped(**kw), [Task(id="c", prompt="go")])
    traj = cut.trajectories[0]
    assert traj.finish_reason == "max_new_tokens" and traj.num_response_tokens == 3  # (seeded)


def test_split_partitions_the_window_by_priority() -> None:
    s = Spans()
    s.spans["generation"] += [(0.0, 4.0), (3.0, 6.0)]
    s.spans["update"] += [(2.0, 5.0)]
    s.spans["push"] += [(5.0, 5.5)]
    s.spans["env_wait"] += [(6.0, 8.0), (7.0, 8.5)]
    got = s.split(1.0, 10.0)
    # generation [1, 6] less the update and push [2, 5.5]; idle: [8.5, 10]
    assert got == pytest.approx({"push": 0.5, "update": 3.0, "generation": 1.5,
                                 "env_wait": 2.5, "idle": 1.5})  # fmt: skip
    assert s.busy("generation", 1.0, 10.0) == pytest.approx(5.0)


def test_dry_run_end_to_end() -> None:
    args = "--dry-run --turns 1 3 --steps 1 --warmup 1 --tasks 2 --group 2".split()
    cmd = [sys.executable, str(ROOT / "benchmarks" / "agent_loop_gpu.py"), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "[progress] K=3 loop step 2/2" in out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("loop_tokens_per_s", "sync_tokens_per_s", "speedup_vs_sync", "loop_vs_ceiling",
                "prefix_reuse_frac", "gpu_busy", "time_split", "card"):  # fmt: skip
        assert key in res, key
    assert res["card"] == "cpu" and res["headline_turns"] == 3
    assert res["loop_tokens_per_s"] > 0 and res["sync_tokens_per_s"] > 0
    assert res["speedup_vs_sync"] == pytest.approx(
        res["loop_tokens_per_s"] / res["sync_tokens_per_s"], rel=1e-2
    )
    assert sum(res["time_split"].values()) == pytest.approx(1.0, abs=1e-2)
    assert set(res["time_split"]) == {"push", "update", "generation", "env_wait", "idle"}
    assert res["trl"]["runs_workload"] is False and res["trl"]["reason"]
    three = res["settings"]["3"]
    for phase in ("sync", "ceiling", "loop"):
        assert three[phase]["episodes"]["turns_mean"] == 3.0
        assert three[phase]["episodes"]["failed"] == 0.0
    assert three["sync"]["tokens_per_step"] == three["ceiling"]["tokens_per_step"]  # same episodes
    assert three["ceiling"]["time_split"]["env_wait"] == 0.0  # no latency: generation alone
    assert three["sync"]["time_split"]["env_wait"] > 0.0
    assert three["loop"]["prefix_reuse"]["resent_history_tokens"] > 0
    assert "numeric_mean_abs" in three["loop"]["mismatch"]
