"""The ``agentrl`` command: help, and ``rollout`` end to end (embedded and over HTTP)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from agentrl.cli import build_parser
from agentrl.types import Trajectory


def agentrl(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agentrl.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_help_lists_the_commands() -> None:
    out = agentrl("--help")
    assert out.returncode == 0
    for cmd in ("serve", "train", "rollout", "report"):
        assert cmd in out.stdout


def test_unknown_argument_is_an_error() -> None:
    out = agentrl("rollout", "arith-v0", "--out", "x.jsonl", "--bogus")
    assert out.returncode == 2 and "unrecognized arguments: --bogus" in out.stderr


def test_serve_rejects_a_kv_cache_size_that_is_not_positive(
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = agentrl("serve", "--model", "tiny", "--kv-cache-gib", "0")  # before any model is built
    assert out.returncode == 2 and "expected a size in GiB > 0" in out.stderr
    for bad in ("-1", "nan"):  # the same parser in this process (a launch costs seconds)
        with pytest.raises(SystemExit) as exited:
            build_parser().parse_known_args(["serve", "--model", "tiny", "--kv-cache-gib", bad])
        assert exited.value.code == 2
        assert "expected a size in GiB > 0" in capsys.readouterr().err


def check_rollout_output(path: Path, stdout: str, episodes: int) -> None:
    lines = path.read_text().splitlines()
    assert len(lines) == episodes
    trajs = [Trajectory.model_validate(json.loads(ln)["trajectory"]) for ln in lines]
    assert all(t.env_id == "guess-v0" and t.error is None for t in trajs)
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["rollout/episodes"] == episodes
    assert "reward mean" in stdout


def test_rollout_embedded(tmp_path: Path) -> None:
    out_file = tmp_path / "out.jsonl"
    out = agentrl(
        "rollout",
        "guess-v0",
        "--num-tasks",
        "3",
        "--group-size",
        "2",
        "--max-new-tokens",
        "6",
        "--out",
        str(out_file),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    check_rollout_output(out_file, out.stdout, 6)


def test_rollout_against_a_server(tmp_path: Path, tiny_server) -> None:
    out_file = tmp_path / "out.jsonl"
    out = agentrl(
        "rollout",
        "guess-v0",
        "--endpoint",
        tiny_server.url,
        "--num-tasks",
        "2",
        "--group-size",
        "2",
        "--max-new-tokens",
        "6",
        "--out",
        str(out_file),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    check_rollout_output(out_file, out.stdout, 4)


def test_train_from_a_config_file_with_overrides(tmp_path: Path) -> None:
    config = Path(__file__).parents[1] / "recipes" / "configs" / "arith-tiny.toml"
    out = agentrl(
        "train",
        str(config),
        f"--run_dir={tmp_path}",
        "--train.steps=1",
        "--cold_start.steps=5",
        "--env.num_eval_tasks=8",
        "--rollout.group_size=2",
        "--train.tasks_per_step=4",
    )
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 1 and "held-out success at end" in out.stdout
    assert "steps: 1" in (tmp_path / "config.yaml").read_text()


def test_train_rejects_a_typo_naming_the_field(tmp_path: Path) -> None:
    config = Path(__file__).parents[1] / "recipes" / "configs" / "arith-tiny.toml"
    out = agentrl("train", str(config), "--learner.lr=1e-4", "--train.stepz=3")
    assert out.returncode == 2 and "train.stepz" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="no SIGUSR1 on this platform")
def test_usr1_prints_every_threads_stack_and_the_server_keeps_serving(tiny_server) -> None:
    """``kill -USR1`` on a stuck ``agentrl`` process shows where each thread is."""
    tiny_server.proc.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + 60
    while not any(line.startswith("Thread 0x") for line in list(tiny_server.log)):
        assert time.monotonic() < deadline, "no stack dump within 60 s"
        time.sleep(0.1)
    dump = "".join(tiny_server.log)
    assert "most recent call first" in dump and "File " in dump
    with urllib.request.urlopen(tiny_server.url + "/health", timeout=30) as resp:
        assert resp.status == 200
