"""Mistakes reported in one line that says what to fix: a bad ``score()`` return, a dead
inference server, a long exception chain (the full trace only with ``--debug``)."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from agentrl.env import ToolEnv
from agentrl.errors import EnvError
from agentrl.loop.jobs import exit_code
from agentrl.rollout.episode import EpisodeState, env_call
from agentrl.types import Message, Task

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "recipes" / "configs" / "arith-tiny.toml"
TASK = Task(id="t", prompt="1+1?", answer="2")


class Lookup(ToolEnv):
    """Returns whatever ``reply`` is from ``score``."""

    def __init__(self, reply: Any, sync: bool = False) -> None:
        super().__init__()
        self.reply = reply
        if sync:  # a plain `def score` works as well as `async def`
            self.score = lambda answer: self.reply  # type: ignore[method-assign]

    def prompt(self, task: Task) -> list[Message]:
        return [Message(role="user", content=task.prompt)]

    async def score(self, answer: str) -> tuple[float, dict[str, Any]]:
        return self.reply


def final(env: ToolEnv) -> Any:
    async def go() -> Any:
        await env.reset(TASK)
        return await env_call("step", env.step("2"), 5.0)

    return asyncio.run(go())


@pytest.mark.parametrize(
    ("reply", "said"),
    [
        (
            0.5,
            "Lookup.score() returned float 0.5; expected a (reward, info) tuple such as (1.0, {})",
        ),
        ((1.0,), "Lookup.score() returned a 1-tuple (1.0,); expected a (reward, info) tuple"),
        (("1", {}), "Lookup.score() reward is str '1'; expected a (reward, info) tuple"),
        ((float("nan"), {}), "Lookup.score() reward is nan; expected a finite number"),
        ((1.0, None), "Lookup.score() info is NoneType None; expected a (reward, info) tuple"),
    ],
)
def test_a_bad_score_return_names_the_class_the_method_and_the_contract(
    reply: Any, said: str
) -> None:
    with pytest.raises(EnvError) as err:
        final(Lookup(reply))
    assert str(err.value).startswith(said)
    # the episode records it as the env's fault, under score(), not step() or a TypeError
    ep = EpisodeState()
    ep.fail(err.value)
    assert ep.failure == "env" and ep.error == f"EnvError: {err.value}"


def test_a_good_score_return_async_or_sync_ends_the_episode() -> None:
    for sync in (False, True):
        result = final(Lookup((1, {"hit": True}), sync=sync))
        assert (result.reward, result.terminated, result.info) == (1.0, True, {"hit": True})
        assert isinstance(result.reward, float)


def test_exception_chains_fold_into_one_line_with_the_root_cause(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def broken() -> int:
        try:
            try:
                raise ConnectionResetError("peer reset the connection")
            except OSError as e:
                raise RuntimeError("reading the batch failed") from e
        except RuntimeError as e:
            raise ValueError("step 3 could not train\n(see above)") from e

    assert exit_code(broken) == 1
    err = capsys.readouterr().err
    assert err == (
        "agentrl: error: ValueError: step 3 could not train (see above) (root cause: "
        "ConnectionResetError: peer reset the connection); --debug for the full trace\n"
    )
    with pytest.raises(ValueError, match="step 3"):  # --debug: the whole trace, as Python prints
        exit_code(broken, debug=True)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_dead_server_is_one_line_naming_the_endpoint_and_the_step(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    out = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "train", str(CONFIG), f"--inference.endpoints={url}",
         "--inference.retry_s=0.2", "--cold_start.steps=0",
         "--train.steps=1", f"--run_dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 1, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("agentrl: error:")]
    assert len(errors) == 1 and errors[0] == out.stderr.splitlines()[-1], out.stderr[-3000:]
    assert len(errors[0]) < 500
    assert errors[0].startswith(
        f"agentrl: error: inference server {url} failed before the first step"
    )
    assert errors[0].endswith("; --debug for the full trace")


def test_rollout_against_a_dead_server_is_one_line(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    out = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "rollout", "arith-v0", "--endpoint", url,
         "--num-tasks", "2", "--tokenizer", "tiny", "--out", str(tmp_path / "out.jsonl")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 1, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last == (
        f"agentrl: error: inference server {url} does not answer /health (is it running? check "
        "inference.endpoints)"
    ), out.stderr[-3000:]
    assert "Traceback" not in out.stderr
