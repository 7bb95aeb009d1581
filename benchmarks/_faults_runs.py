"""Fault scenarios of a training run: ``agentrl train`` killed at each phase and resumed (issue
20); kills during a log cut and a checkpoint write at seeded instants, eight checkpoint
corruptions, and envs that block (issue 43).

Real parts only: ``agentrl train`` subprocesses, children SIGKILLed at their K-th filesystem
event (:mod:`agentrl.loop.crash`), checkpoints corrupted on disk and resumed. Each scenario
returns a dict in ``faults.py``'s shape: ``expected``, ``written``, ``duplicated``, ``lost``,
``failed`` (by cause) and ``hung``.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from agentrl.loop import crash
from agentrl.loop.checkpoints import committed, step_of, verify

HANG_S = 240.0
TIMING = ("time", "perf/", "rollout/generate_s", "cold_start_s")


def run_config(run_dir: Path, steps: int = 4) -> dict[str, Any]:
    """A small arithmetic run with a checkpoint every second step."""
    return {
        "run_dir": str(run_dir),
        "seed": 3,
        "env": {"id": "arith-v0", "task_kwargs": {"digits": 1}, "num_eval_tasks": 8},
        "rollout": {"group_size": 4, "max_turns": 1, "max_new_tokens": 4, "max_total_tokens": 48},
        "cold_start": {"steps": 20, "lr": 2e-3, "batch_size": 16},
        "learner": {"lr": 1e-4},
        "train": {"steps": steps, "tasks_per_step": 4, "eval_every": 0, "checkpoint_every": 2,
                  "max_staleness": 0},
    }  # fmt: skip


def train(run_dir: Path, *extra: str, config: dict[str, Any] | None = None) -> tuple[int, str]:
    """``agentrl train`` on ``run_dir``'s config (written beside it): exit code and stderr;
    ``-9`` when it ran past :data:`HANG_S` (killed)."""
    path = run_dir.parent / f"{run_dir.name}.yaml"
    if not path.exists():
        path.write_text(yaml.safe_dump(config or run_config(run_dir)))
    cmd = [sys.executable, "-m", "agentrl.cli", "train", str(path), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=HANG_S)
    except subprocess.TimeoutExpired as e:
        return -9, str(e.stderr or "")
    return out.returncode, out.stderr


def steps(run_dir: Path) -> list[dict[str, Any]]:
    """The run's logged training steps, without timings (what must be equal bit for bit)."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    rows = [json.loads(ln) for ln in lines if ln.endswith("}")]
    return [
        {k: v for k, v in r.items() if not k.startswith(TIMING)}
        for r in rows
        if "rollout/reward_mean" in r
    ]


def train_killed(run_dir: Path, resume: bool, kill_when: Callable[[Path], bool] | None) -> str:
    """``agentrl train`` on :func:`run_config`, SIGKILLed once ``kill_when(run_dir)``:
    ``killed``, ``ok``, ``error`` or ``hung``."""
    config = run_dir.parent / f"{run_dir.name}.yaml"
    config.write_text(yaml.safe_dump(run_config(run_dir)))
    cmd = [sys.executable, "-m", "agentrl.cli", "train", str(config)]
    cmd += ["--resume"] if resume else []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + HANG_S
    while proc.poll() is None:
        if time.monotonic() > deadline or (kill_when is not None and kill_when(run_dir)):
            proc.kill()
            proc.wait()
            return "hung" if time.monotonic() > deadline else "killed"
        time.sleep(0.02)
    return "ok" if proc.returncode == 0 else "error"


def has_checkpoint(run_dir: Path) -> bool:
    return (run_dir / "checkpoints").is_dir() and bool(committed(run_dir / "checkpoints"))


def train_reference(tmp: Path) -> Path:
    """The uninterrupted run every scenario compares with."""
    reference = tmp / "reference"
    code, err = train(reference)
    if code != 0:
        raise RuntimeError(f"the reference run failed: {err[-2000:]}")
    return reference


def resume_scenarios(tmp: Path, reference: Path) -> dict[str, dict[str, Any]]:
    """Kill ``agentrl train`` at each phase, resume it, compare with the reference run."""
    want = steps(reference)
    phases: dict[str, Callable[[Path], bool] | None] = {
        "kill in cold start": lambda d: (
            (d / "config.yaml").exists() and not (d / "summary_state.json").exists()
        ),
        "kill before 1st checkpoint": lambda d: len(steps(d)) >= 1,
        "kill after a checkpoint": lambda d: len(steps(d)) >= 3 and has_checkpoint(d),
        "resume a finished run": None,
    }
    results: dict[str, dict[str, Any]] = {}
    for name, when in phases.items():
        run_dir = tmp / name.replace(" ", "_")
        first = train_killed(run_dir, False, when)
        log = run_dir / "metrics.jsonl"
        before = log.read_text() if log.exists() else ""
        second = train_killed(run_dir, True, None)
        got = steps(run_dir)
        counts = collections.Counter(r["step"] for r in got)
        failed: dict[str, int] = {}
        if got != want:
            failed["not_bitwise_equal"] = 1
        if second != "ok":
            failed[f"resume_{second}"] = 1
        if when is None and log.read_text() != before:
            failed["finished_run_changed"] = 1
        results[name] = {
            "expected": len(want),
            "written": len(got),
            "duplicated": sum(n - 1 for n in counts.values() if n > 1),
            "lost": len({r["step"] for r in want} - set(counts)),
            "failed": failed,
            "hung": "hung" in (first, second),
        }
    return results


def _lines(data: bytes) -> list[bytes]:
    return [ln for ln in data.split(b"\n") if ln]


def log_cut_kills(tmp: Path, reference: Path, seeds: int) -> dict[str, Any]:
    """Cut a finished run's logs back to step 2, SIGKILLed at ``seeds`` seeded instants: each
    log must be whole afterwards, either as it was or as cut (a resume then cuts it again)."""
    src = tmp / "cut-src"
    shutil.copytree(reference, src)
    want = tmp / "cut-want"
    shutil.copytree(src, want)
    from agentrl.loop.logs import cut_logs

    cut_logs(want, 2)
    names = ("metrics.jsonl", "trajectories.jsonl")
    old = {n: (src / n).read_bytes() for n in names}
    new = {n: (want / n).read_bytes() for n in names}
    events = crash.count_events("cut", src, step=2)
    lost = dup = whole = 0
    failed: collections.Counter[str] = collections.Counter()
    for seed in range(seeds):
        d = tmp / f"cut-{seed}"
        shutil.copytree(src, d)
        try:
            crash.kill_during("cut", d, seed, step=2, events=events)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            failed[type(e).__name__] += 1
            continue
        for n in names:
            got = (d / n).read_bytes() if (d / n).exists() else b""
            if got in (old[n], new[n]):
                whole += 1
                continue
            failed["torn_" + n] += 1
            kept = collections.Counter(_lines(got))
            lost += sum(1 for ln in _lines(new[n]) if kept[ln] == 0)
            dup += sum(c - 1 for c in kept.values() if c > 1)
        shutil.rmtree(d)
    return {"expected": seeds * len(names), "written": whole, "duplicated": dup, "lost": lost,
            "failed": dict(failed), "hung": False, "events": events}  # fmt: skip


def checkpoint_kills(tmp: Path, reference: Path, seeds: int) -> dict[str, Any]:
    """Write the next checkpoint of a finished run, SIGKILLed at ``seeds`` seeded instants:
    every checkpoint still listed must verify, and the newest good one must still be there."""
    src = tmp / "ckpt-src"
    shutil.copytree(reference, src)
    before = step_of(committed(src / "checkpoints")[0].name)
    events = crash.count_events("checkpoint", src)
    lost = whole = 0
    failed: collections.Counter[str] = collections.Counter()
    for seed in range(seeds):
        d = tmp / f"ckpt-{seed}"
        shutil.copytree(src, d)
        try:
            crash.kill_during("checkpoint", d, seed, events=events)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            failed[type(e).__name__] += 1
            continue
        listed = committed(d / "checkpoints")
        bad = [p.name for p in listed if verify(p) is not None]
        good = [step_of(p.name) for p in listed if verify(p) is None]
        if bad:
            failed["listed_but_bad"] += len(bad)
        if not good or max(s or 0 for s in good) < (before or 0):
            lost += 1  # the newest good checkpoint is gone
        else:
            whole += 1
        shutil.rmtree(d)
    return {"expected": seeds, "written": whole, "duplicated": 0, "lost": lost,
            "failed": dict(failed), "hung": False, "events": events}  # fmt: skip


def corruption_resumes(tmp: Path, reference: Path, want: list[dict[str, Any]]) -> dict[str, Any]:
    """Corrupt the newest checkpoint eight ways, cut the run back and resume: each resume must say
    it skipped the checkpoint, fall back to the one before and end equal to the reference."""
    newest = committed(reference / "checkpoints")[0].name
    lost = dup = whole = 0
    failed: collections.Counter[str] = collections.Counter()
    hung = False
    for name, corrupt in crash.CORRUPTIONS.items():
        d = tmp / f"corrupt-{name}"
        shutil.copytree(reference, d)
        corrupt(d / "checkpoints" / newest, seed=1)
        summary = d / "summary.json"
        summary.unlink(missing_ok=True)  # as if killed before the end: resume must redo steps
        code, err = train(d, "--resume", config=run_config(d))
        hung |= code == -9
        got = steps(d)
        counts = collections.Counter(r["step"] for r in got)
        lost += len({r["step"] for r in want} - set(counts))
        dup += sum(n - 1 for n in counts.values() if n > 1)
        if code != 0:
            failed[f"{name}: exit {code}"] += 1
        elif "skipping checkpoint" not in err:
            failed[f"{name}: not reported"] += 1
        elif got != want:
            failed[f"{name}: not_bitwise_equal"] += 1
        else:
            whole += 1
        shutil.rmtree(d)
    return {"expected": len(crash.CORRUPTIONS), "written": whole, "duplicated": dup,
            "lost": lost, "failed": dict(failed), "hung": hung}  # fmt: skip


BLOCKING_ENVS = """
import asyncio, threading, time
from agentrl import Env, Message, StepResult, Task, register
from agentrl.env import SyncEnv

class _Base:
    sees_cut_turns = True

    @classmethod
    def sample_tasks(cls, n, *, seed=0, split="train"):
        return [Task(id=f"{split}-{i}", prompt=f"say {i}") for i in range(n)]

class Hang(_Base, SyncEnv):
    def reset_sync(self, task, *, seed=None):
        return [Message(role="user", content=task.prompt)], {}

    def step_sync(self, action):
        threading.Event().wait()  # forever

class Block(_Base, Env):
    async def reset(self, task, *, seed=None):
        return [Message(role="user", content=task.prompt)], {}

    async def step(self, action):
        time.sleep(600)  # blocks the event loop

class Threads(_Base, Env):
    async def reset(self, task, *, seed=None):
        return [Message(role="user", content=task.prompt)], {}

    async def step(self, action):
        await asyncio.to_thread(threading.Event().wait)  # a default thread, forever

register("hang-v0", Hang)
register("block-v0", Block)
register("threads-v0", Threads)
"""


def blocking_envs(tmp: Path) -> dict[str, dict[str, Any]]:
    """``agentrl train`` with an env that blocks forever (in its thread, on the event loop, in
    asyncio's threads): each run must end non-zero with one error line, well before HANG_S."""
    (tmp / "blocking_envs.py").write_text(BLOCKING_ENVS)
    results: dict[str, dict[str, Any]] = {}
    for env_id in ("hang-v0", "block-v0", "threads-v0"):
        run_dir = tmp / env_id
        config = run_config(run_dir, steps=5)
        config["env"] = {"id": env_id, "num_train_tasks": 4, "num_eval_tasks": 1}
        config["cold_start"] = {"steps": 0}
        config["rollout"] |= {"group_size": 2, "env_timeout_s": 0.5, "episode_timeout_s": 5.0}
        config["train"] |= {"tasks_per_step": 2, "max_failed_steps": 2}
        t0 = time.perf_counter()
        code, err = train(run_dir, "--import", str(tmp / "blocking_envs.py"), config=config)
        took = time.perf_counter() - t0
        errors = [ln for ln in err.splitlines() if ln.startswith("agentrl: error:")]
        failed: dict[str, int] = {}
        if code in (0, -9):
            failed[f"exit {code}"] = 1
        if len(errors) != 1:
            failed[f"{len(errors)} error lines"] = 1
        results[f"env blocks: {env_id.removesuffix('-v0')}"] = {
            "expected": 1, "written": int(not failed), "duplicated": 0, "lost": 0,
            "failed": failed, "hung": code == -9, "wall_s": round(took, 1),
        }  # fmt: skip
    return results


def run_scenarios(tmp: Path, reference: Path, seeds: int = 20) -> dict[str, dict[str, Any]]:
    """Kills at seeded instants, corruptions and blocking envs (issue 43)."""
    return {
        f"kill in log cut x{seeds}": log_cut_kills(tmp, reference, seeds),
        f"kill in checkpoint write x{seeds}": checkpoint_kills(tmp, reference, seeds),
        f"{len(crash.CORRUPTIONS)} corrupt checkpoints, resumed": corruption_resumes(
            tmp, reference, steps(reference)
        ),
        **blocking_envs(tmp),
    }
