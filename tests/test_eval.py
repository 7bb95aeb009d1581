"""``agentrl eval`` and held-out pass@k: the estimator, the command, a run, a server."""

from __future__ import annotations

import asyncio
import json
import math
from collections import defaultdict
from pathlib import Path

import pytest

from agentrl.cli import main
from agentrl.config import load_config
from agentrl.env import StepResult, SyncEnv, register
from agentrl.loop.evaluate import MAX_TASK_FILE_BYTES
from agentrl.loop.trainer import Trainer
from agentrl.pass_at_k import mean_pass_at_k, pass_at_k
from agentrl.types import Message, Task


class CoinEnv(SyncEnv):
    """One turn; reward 1 when the answer's code points sum to an even number: about half."""

    sees_cut_turns = True  # a turn cut at max_new_tokens is still an answer

    def reset_sync(self, task: Task, *, seed: int | None = None) -> tuple[list[Message], dict]:
        return [Message(role="user", content=task.prompt)], {}

    def step_sync(self, action: str) -> StepResult:
        return StepResult(reward=float(sum(map(ord, action)) % 2 == 0), terminated=True)

    @classmethod
    def sample_tasks(cls, n: int, *, seed: int = 0, split: str = "train") -> list[Task]:
        return [Task(id=f"{split}-{i}", prompt=f"flip {i}") for i in range(n)]


register("test-coin-v0", CoinEnv)

FAST = ["--max-new-tokens", "3", "--max-total-tokens", "48"]


def test_estimator_equals_the_closed_form() -> None:
    n, c = 10, 3
    for k in range(1, n + 1):
        want = 1 - math.comb(n - c, k) / math.comb(n, k)
        assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12)
    assert all(pass_at_k(n, 0, k) == 0.0 for k in range(1, n + 1))
    assert all(pass_at_k(n, n, k) == 1.0 for k in range(1, n + 1))
    assert pass_at_k(10, 8, 3) == 1.0  # n - c < k: every draw holds a success
    assert all(pass_at_k(n, c, 1) == pytest.approx(c / n) for c in range(n + 1))
    assert pass_at_k(10**6, 1, 1) == pytest.approx(1e-6)  # no overflow where C(n, k) would
    assert mean_pass_at_k([(4, 1), (4, 4)], 2) == pytest.approx((0.5 + 1.0) / 2)
    for bad in ((4, 5, 1), (4, 1, 0), (4, 1, 5), (4, -1, 1)):
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def read_episodes(out: Path) -> dict[str, list[float]]:
    rewards: dict[str, list[float]] = defaultdict(list)
    for line in (out / "episodes.jsonl").read_text().splitlines():
        t = json.loads(line)["trajectory"]
        rewards[t["task_id"]].append(t["reward"])
    return rewards


def check_summary(out: Path, samples: int, tasks: int) -> dict:
    """summary.json's pass@k and avg@k recomputed from episodes.jsonl."""
    summary = json.loads((out / "summary.json").read_text())
    rewards = read_episodes(out)
    assert len(rewards) == tasks and all(len(r) == samples for r in rewards.values())
    counts = [(len(r), sum(x >= 1.0 for x in r)) for r in rewards.values()]
    for k in range(1, samples + 1):
        want = sum(1 - math.comb(n - c, k) / math.comb(n, k) for n, c in counts) / len(counts)
        assert summary[f"pass@{k}"] == pytest.approx(want, abs=1e-12)
    assert f"pass@{samples + 1}" not in summary
    flat = [x for r in rewards.values() for x in r]
    assert summary[f"avg@{samples}"] == pytest.approx(sum(flat) / len(flat))
    assert summary["pass@1"] == pytest.approx(summary["success_rate"])
    assert summary["episodes"] == samples * tasks and summary["failed"] == 0
    for key in ("turns_mean", "tool_calls_mean", "tool_use_frac", "reward_mean", "wall_s"):
        assert key in summary
    return summary


def test_eval_tiny_writes_episodes_and_pass_at_k(tmp_path: Path, capsys) -> None:
    out = tmp_path / "ev"
    args = ["eval", "tiny", "--env", "test-coin-v0", "--samples", "4", "--num-tasks", "4"]
    assert main([*args, *FAST, "--out", str(out)]) == 0
    assert len((out / "episodes.jsonl").read_text().splitlines()) == 16
    summary = check_summary(out, 4, 4)
    assert 0 < summary["pass@1"] < summary["pass@4"] <= 1  # mixed outcomes: k matters
    assert summary["temperature"] == 1.0  # K > 1 samples
    printed = capsys.readouterr()
    assert json.loads(printed.out.strip().splitlines()[-1]) == summary
    assert "16/16 episodes" in printed.err  # progress (not a terminal: plain lines)
    # a task file, in the format of env.eval_tasks and `agentrl rollout --tasks`
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(
        "".join(json.dumps({"question": f"flip {i}", "answer": "-"}) + "\n" for i in range(3))
    )
    again = tmp_path / "again"
    assert (
        main([*args[:4], "--samples", "2", "--tasks", str(tasks), *FAST, "--out", str(again)]) == 0
    )
    check_summary(again, 2, 3)


def test_bad_inputs_are_one_line_errors(tmp_path: Path, capsys) -> None:
    base = ["eval", "tiny", "--env", "test-coin-v0", "--out", str(tmp_path / "o")]
    huge = tmp_path / "huge.jsonl"
    with huge.open("wb") as f:
        f.truncate(MAX_TASK_FILE_BYTES + 1)  # sparse: nothing is written, nothing read
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "summary.json").write_text("{}")
    cases = [
        (["--samples", "0"], "--samples: expected 1 <= K"),
        (["--num-tasks", "1000000", "--samples", "4"], "--num-tasks: expected"),
        (["--tasks", str(huge)], "over the 256 MiB limit"),
        (["--tasks", str(tmp_path / "missing.jsonl")], "no such file"),
        (["--step", "3"], "--step: expected a run directory"),
    ]
    for extra, said in cases:
        assert main([*base, *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert said in err and len(err.splitlines()) == 1, err
    assert main(["eval", "tiny", "--out", str(tmp_path / "used")]) == 2
    assert "--env: expected an env id" in capsys.readouterr().err
    assert main(["eval", "tiny", "--env", "test-coin-v0", "--out", str(tmp_path / "used")]) == 2
    assert "summary.json exists" in capsys.readouterr().err


def test_training_eval_and_eval_of_the_run_agree(tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    config = {
        "run_dir": str(run), "seed": 5,
        "env": {"id": "test-coin-v0", "num_train_tasks": 8, "num_eval_tasks": 3},
        "rollout": {"group_size": 2, "max_turns": 1, "max_new_tokens": 3, "max_total_tokens": 48},
        "learner": {"lr": 5e-2},
        "train": {"steps": 1, "tasks_per_step": 2, "eval_every": 0, "max_staleness": 0,
                  "eval_samples": 4, "eval_temperature": 1.0},
    }  # fmt: skip
    summary = asyncio.run(Trainer(load_config(config)).run())
    end = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert {f"eval/pass@{k}" for k in range(1, 5)} | {"eval/avg@4"} <= set(end)
    assert end["eval/pass@1"] == pytest.approx(end["eval/success_rate"])
    assert summary["success_end"] == end["eval/success_rate"]  # the report's keys are kept
    out = tmp_path / "ev"
    assert main(["eval", str(run), "--samples", "4", "--out", str(out)]) == 0
    got = check_summary(out, 4, 3)
    assert got["checkpoint"] == str(run / "checkpoints" / "step-000001")
    # the run's own final evaluation, repeated: same tasks, seeds and (trained) weights
    for k in range(1, 5):
        assert got[f"pass@{k}"] == pytest.approx(end[f"eval/pass@{k}"])
    # the run's initial weights and the same sampling seeds sample other tokens: trained ones
    steps = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps[1]["rollout/zero_signal_groups"] < 2  # the step did update the policy
    fresh = tmp_path / "fresh"
    assert main(["eval", "tiny", "--env", "test-coin-v0", "--samples", "4", "--seed", "5",
                 "--rollout.seed=0", "--num-tasks", "3", "--max-new-tokens", "3",
                 "--max-total-tokens", "48", "--out", str(fresh)]) == 0  # fmt: skip
    assert tokens(fresh) != tokens(out)
    capsys.readouterr()


def tokens(out: Path) -> list[list[int]]:
    lines = (out / "episodes.jsonl").read_text().splitlines()
    trajs = [json.loads(ln)["trajectory"] for ln in lines]
    return [t["tokens"] for t in sorted(trajs, key=lambda t: (t["task_id"], t["group_index"]))]


def test_eval_against_a_server(tmp_path: Path, tiny_server) -> None:
    out = tmp_path / "ev"
    args = ["eval", "tiny", "--env", "test-coin-v0", "--samples", "3", "--num-tasks", "2"]
    assert main([*args, *FAST, "--endpoint", tiny_server.url, "--out", str(out)]) == 0
    summary = check_summary(out, 3, 2)
    assert summary["endpoints"] == [tiny_server.url]
