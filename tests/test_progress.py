"""A run you can watch (issue 44): plain progress lines in a log, RL's rate and ETA without the
cold start, separate budgets, warnings once then counted, failed episodes in the summary."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from agentrl import Env, Message, StepResult, Task, register
from agentrl.config import load_config
from agentrl.loop.cold_start import next_check
from agentrl.loop.trainer import Trainer

ENV = textwrap.dedent(
    '''
    """Flat rewards (no learning signal) and an env bug on one task in four."""
    from agentrl import Env, Message, StepResult, Task, register


    class Leaky(Env):
        sees_cut_turns = True

        async def reset(self, task, *, seed=None):
            self.task = task
            return [Message(role="user", content=task.prompt)], {}

        async def step(self, action):
            if int(self.task.id.split("-")[1]) % 4 == 0 and action.strip() != self.task.answer:
                raise KeyError("no such record")
            return StepResult(reward=0.0, terminated=True)

        @classmethod
        def sample_tasks(cls, n, *, seed=0, split="train"):
            return [Task(id=f"{split}-{i}", prompt=f"say {i}", answer=str(i)) for i in range(n)]


    register("leaky-v0", Leaky)
    '''
)

CONFIG = """
name = "watch"
[env]
id = "leaky-v0"
num_train_tasks = 8
num_eval_tasks = 2
[rollout]
group_size = 2
max_turns = 1
max_new_tokens = 3
max_total_tokens = 48
[cold_start]
steps = 100000
batch_size = 4
lr = 1e-7  # learns nothing: the env's bug stays reachable
max_wall_s = 2
[learner]
num_minibatches = 1
[train]
steps = 4
tasks_per_step = 4
eval_every = 0
max_staleness = 0
"""


@pytest.fixture(scope="module")
def watched(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One ``agentrl train`` with stderr piped (not a terminal), shared by the tests below."""
    tmp = tmp_path_factory.mktemp("watch")
    (tmp / "leaky_env.py").write_text(ENV)
    (tmp / "run.toml").write_text(CONFIG)
    out = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "train", str(tmp / "run.toml"),
         f"--run_dir={tmp / 'run'}", "--import", str(tmp / "leaky_env.py")],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp / "run" / "summary.json").read_text())
    return {"stderr": out.stderr, "stdout": out.stdout, "summary": summary}


def test_a_log_gets_plain_lines_and_rl_rate_without_the_cold_start(watched: dict) -> None:
    err, summary = watched["stderr"], watched["summary"]
    assert "\r" not in err  # no tqdm bar in a log
    cold = re.findall(r"^cold start (\d+)/100000 \(\d+%\): loss [\d.]+", err, re.M)
    # the first step, then its last one (cut by cold_start.max_wall_s=2, counted apart from RL)
    assert cold[0] == "1" and 1 < int(cold[-1]) < 100000
    assert 2 <= summary["cold_start_s"] < 30
    steps = re.findall(
        r"^watch step (\d)/4: reward [\d.]+(?:, \d+ failed)?, ([\d.]+) (s/step|steps/s), ETA \w+",
        err,
        re.M,
    )
    assert [s[0] for s in steps] == ["1", "2", "3", "4"], err[-2000:]
    first = float(steps[0][1]) if steps[0][2] == "s/step" else 1 / float(steps[0][1])
    # RL's rate counts from the first RL step: the cold start's 2 s are not in it
    assert first < summary["rl_wall_s"] <= summary["wall_s"] - 2
    assert "held-out success at RL start" in watched["stdout"] and summary["steps"] == 4


def test_warnings_print_once_then_count(watched: dict) -> None:
    err, summary = watched["stderr"], watched["summary"]
    assert err.count("no learning signal") == 1
    assert re.search(r"^watch step 4/4: .*; warnings: no_learning_signal x4$", err, re.M)
    assert summary["warnings"] == {"no_learning_signal": 4}
    assert re.search(r"^warning no_learning_signal\s+4 times$", watched["stdout"], re.M)


def test_failed_episodes_by_cause_and_the_first_error(watched: dict) -> None:
    f = watched["summary"]["failures"]
    assert f["episodes"] == 4 * 4 * 2 and 0 < f["failed"] <= 4 * 2  # one task in four may fail
    assert f["by_cause"] == {"env": f["failed"]}
    assert f["first_error"].startswith("KeyError: 'no such record' (task train-")
    assert "\n" not in f["first_error"]
    out = watched["stdout"]
    assert re.search(
        rf"^failed training episodes\s+{f['failed']} of 32 \([\d.]+%\); under "
        r"train\.max_failed_frac=0\.5$",
        out,
        re.M,
    )
    assert re.search(r"^  first error\s+KeyError: 'no such record'", out, re.M)


def test_rl_budget_counts_from_the_first_rl_step(tmp_path: Path) -> None:
    """A cold start longer than ``train.max_wall_s`` leaves RL its step (it ran none before)."""
    tree = {
        "run_dir": str(tmp_path / "run"),
        "env": {"id": "arith-v0", "num_train_tasks": 8, "num_eval_tasks": 2},
        "rollout": {"group_size": 2, "max_turns": 1, "max_new_tokens": 3, "max_total_tokens": 48},
        "cold_start": {"steps": 1000, "batch_size": 4, "max_wall_s": 1.0},
        "learner": {"num_minibatches": 1},
        "train": {"steps": 5, "tasks_per_step": 2, "eval_every": 0, "max_staleness": 0,
                  "max_wall_s": 1e-3},
    }  # fmt: skip
    summary = asyncio.run(Trainer(load_config(tree)).run())
    assert summary["cold_start_s"] >= 1.0 and summary["steps"] == 1


class Echo(Env):
    """Reward 1 for repeating the number: the tiny model learns it in ~15 SFT steps."""

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[list[Message], dict]:
        self.task = task
        return [Message(role="user", content=task.prompt)], {}

    async def step(self, action: str) -> StepResult:
        return StepResult(reward=float(action.strip() == self.task.answer), terminated=True)

    @classmethod
    def sample_tasks(cls, n: int, *, seed: int = 0, split: str = "train") -> list[Task]:
        off = 0 if split == "train" else 37
        nums = [(i * 7 + off) % 100 for i in range(n)]
        return [
            Task(id=f"{split}-{i}", prompt=f"say {k}", answer=str(k)) for i, k in enumerate(nums)
        ]


register("progress-echo-v0", Echo)


def test_the_cold_start_stops_near_its_target(tmp_path: Path) -> None:
    """Held-out success jumps 0.15 -> 1.0 between steps 25 and 44 here; checked every 25 steps
    (before issue 44) a 0.3 target stopped at 1.0, measured; now it stops at 0.35."""
    checks: list[tuple[int, float]] = []

    def on_step(m: dict[str, float]) -> None:
        if "sft/held_out_success" in m:
            checks.append((int(m["sft/step"]), m["sft/held_out_success"]))

    tree = {
        "run_dir": str(tmp_path / "run"),
        "env": {"id": "progress-echo-v0", "num_train_tasks": 64, "num_eval_tasks": 20},
        "rollout": {"group_size": 2, "max_turns": 1, "max_new_tokens": 4, "max_total_tokens": 48},
        "cold_start": {"steps": 400, "batch_size": 16, "lr": 1e-3, "target_success": 0.3,
                       "check_every": 25},
        "train": {"steps": 0, "eval_every": 0, "max_staleness": 0},
    }  # fmt: skip
    summary = asyncio.run(Trainer(load_config(tree), on_step=on_step).run())
    assert checks[0][0] == 25 and len(checks) <= 6, checks
    assert 0.3 <= checks[-1][1] <= 0.5 and checks[-1][0] < 40, checks  # not 1.0 at step 50
    assert summary["success_start"] <= 0.5


def test_checks_come_sooner_near_the_target() -> None:
    assert next_check(0.0, 0.3, 25, (0, 0.0), 25) == 25  # far: the configured interval
    assert next_check(0.15, 0.3, 25, (0, 0.0), 25) <= 12  # halfway: half as far apart
    assert next_check(0.28, 0.3, 25, (25, 0.1), 50) == 2  # close: every tenth
    assert next_check(0.1, 0.3, 25, (0, 0.0), 50) == 16  # a third of the way
    assert next_check(0.1, 0.3, 25, (40, 0.02), 50) == 12  # rising fast: before it gets there


def test_a_terminal_keeps_its_bars_one_per_phase() -> None:
    import io

    from agentrl.loop.progress import Progress

    err, out = io.StringIO(), io.StringIO()
    progress = Progress("run", 2, stream=err, out=out, tty=True, warnings=lambda: {"x": 2})
    for i in (1, 2):
        progress({"step": 0, "sft/step": i, "sft/steps": 2, "sft/loss": 1.0 / i})
    progress({"step": 0, "sft/held_out_success": 0.5, "sft/step": 2, "sft/steps": 2,
              "sft/loss": 0.5})  # fmt: skip
    progress({"step": 0, "eval/success_rate": 0.5, "cold_start_s": 3.0})
    for i in (1, 2):
        progress({"step": i, "rollout/reward_mean": 0.25})
    progress.close()
    bars = err.getvalue()
    assert "\r" in bars and "cold start: 100%" in bars and "run: 100%" in bars
    assert "reward=0.250" in bars and "warnings=x x2" in bars
    assert out.getvalue().splitlines() == [
        "cold start step 2: loss 0.500, held-out success 0.500",
        "held-out success at RL start 0.500 (cold start 3.0s)",
    ]


def test_a_log_shows_a_stopping_check_once() -> None:
    import io

    from agentrl.loop.progress import Progress

    err, out = io.StringIO(), io.StringIO()
    progress = Progress("run", 2, stream=err, out=out, tty=False, warnings=lambda: {})
    progress({"step": 0, "sft/step": 1, "sft/steps": 100, "sft/loss": 1.0})
    # the cold start stops at its target between two progress lines: the check is said once,
    # and its step's progress line comes before the evaluation that opens RL
    progress({"step": 0, "sft/held_out_success": 0.5, "sft/step": 2, "sft/steps": 100,
              "sft/loss": 0.5})  # fmt: skip
    progress({"step": 0, "eval/success_rate": 0.5, "cold_start_s": 3.0})
    progress.close()
    lines = out.getvalue().splitlines() + err.getvalue().splitlines()
    assert lines.count("cold start step 2: loss 0.500, held-out success 0.500") == 1, lines
    assert any(ln.startswith("cold start 2/100 (2%): loss 0.500") for ln in lines), lines
