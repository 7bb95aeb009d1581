"""OpenEnv environments through ``openenv:`` ids: docs/envs.md's env, served by openenv-core."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("openenv")

from agentrl.env import env_class, make  # noqa: E402
from agentrl.errors import ConfigError, EnvError  # noqa: E402
from agentrl.types import Task  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def write_env(folder: Path) -> None:
    """docs/envs.md's OpenEnv example, as its page shows it."""
    text = (ROOT / "docs" / "envs.md").read_text().split("## OpenEnv environments", 1)[1]
    for lang in ("python", "toml"):
        code = text.split(f"```{lang}\n", 1)[1].split("```", 1)[0]
        (folder / code.splitlines()[0].removeprefix("# ")).write_text(code)


def serve(folder: Path) -> tuple[str, subprocess.Popen[bytes]]:
    """``uvicorn guess_openenv:app`` on a free loopback port, ready (``/health`` answers)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "uvicorn", "guess_openenv:app", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--log-level", "warning"]
    log = folder / f"server-{port}.log"  # a file, not a pipe: a full pipe would stall the server
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=folder, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return url, proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    proc.wait()
    raise RuntimeError(f"the OpenEnv server did not start: {log.read_text()[-2000:]}")


def sessions(url: str) -> int:
    """Established TCP connections the server holds (one per WebSocket session)."""
    port = f"{int(url.rsplit(':', 1)[1]):04X}"
    rows = Path("/proc/net/tcp").read_text().splitlines()[1:]
    return sum(1 for r in rows if r.split()[1].endswith(":" + port) and r.split()[3] == "01")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("openenv")
    write_env(path)
    return path


@pytest.fixture(scope="module")
def server(folder: Path) -> Iterator[str]:
    url, proc = serve(folder)
    yield url
    proc.terminate()
    proc.wait(timeout=10)


def secret(seed: int) -> int:
    return random.Random(seed).randint(1, 8)


async def play(env_id: str, seed: int) -> list[tuple[float, bool, str]]:
    """An episode: a non-digit, then 1, 2, ... until right; (reward, terminated, obs) per turn."""
    env = make(env_id)
    try:
        messages, _ = await env.reset(Task(id="t", prompt="", data={"seed": seed}))
        assert [m.content for m in messages] == [
            "Guess my number from 1 to 8. Answer with a digit."
        ]
        turns = []
        for action in ["?", *map(str, range(1, 9))]:
            r = await env.step(action)
            turns.append(
                (r.reward, r.terminated, r.observation[0].content if r.observation else "")
            )
            if r.terminated:
                return turns
        raise AssertionError("never terminated")
    finally:
        await env.close()


def expected(seed: int) -> list[tuple[float, bool, str]]:
    n = secret(seed)
    out = [(-0.1, False, "Answer with a digit.")]
    out += [(0.0, False, "No, higher.") for _ in range(1, n)]
    return [*out, (1.0, True, "")]


async def test_served_env_maps_reset_step_rewards_and_done(server: str) -> None:
    assert await play(f"openenv:{server}", 3) == expected(3)
    # many episodes at once, one session each: all see their own secret, and the server holds
    # many sessions at the same time (counted, not timed: timings fail on a loaded machine)
    seeds = list(range(40))
    peak, running = 0, True

    async def watch() -> None:
        nonlocal peak
        while running:
            peak = max(peak, sessions(server))
            await asyncio.sleep(0.005)

    watcher = asyncio.create_task(watch())
    got = await asyncio.gather(*(play(f"openenv:{server}", s) for s in seeds))
    running = False
    await watcher
    assert got == [expected(s) for s in seeds]
    assert peak >= 10, peak
    for _ in range(50):  # the server closes its side right after our close
        if sessions(server) == 0:
            break
        await asyncio.sleep(0.02)
    assert sessions(server) == 0


async def test_in_process_class_and_its_concurrency_flag(folder: Path) -> None:
    sys.path.insert(0, str(folder))
    try:
        env_id = "openenv:guess_openenv:GuessEnvironment"
        assert await play(env_id, 5) == expected(5)
        got = await asyncio.gather(*(play(env_id, s) for s in range(8)))
        assert got == [expected(s) for s in range(8)]
        from agentrl.envs import openenv_env

        assert all(n == 0 for n in openenv_env._LIVE.values())
        # a class without SUPPORTS_CONCURRENT_SESSIONS refuses a second live episode
        module: Any = sys.modules["guess_openenv"]
        solo = type("Solo", (module.GuessEnvironment,), {"SUPPORTS_CONCURRENT_SESSIONS": False})
        module.Solo = solo
        a, b = make("openenv:guess_openenv:Solo"), make("openenv:guess_openenv:Solo")
        await a.reset(Task(id="a", prompt=""))
        with pytest.raises(EnvError, match="does not set SUPPORTS_CONCURRENT_SESSIONS"):
            await b.reset(Task(id="b", prompt=""))
        await a.close()
        await b.close()
        await b.reset(Task(id="b", prompt=""))  # free again once the first one closed
        await b.close()
    finally:
        sys.path.remove(str(folder))


async def test_bad_ids_and_dead_servers_are_one_line_errors(folder: Path) -> None:
    with pytest.raises(ConfigError, match="expected openenv:http://HOST:PORT"):
        make("openenv:nothing")
    env = make("openenv:no_such_module_xyz:Env")
    with pytest.raises(ConfigError, match="cannot import it"):
        await env.reset(Task(id="t", prompt=""))
    await env.close()
    with socket.socket() as s:  # a port where nothing listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = make(f"openenv:http://127.0.0.1:{port}", action_field="guess")
    with pytest.raises(EnvError, match=rf"openenv:http://127.0.0.1:{port}: reset\(\) failed"):
        await env.reset(Task(id="t", prompt=""))
    await env.close()
    tasks = env_class("openenv:http://x:1").sample_tasks(3, seed=0)  # type: ignore[attr-defined]
    test = env_class("openenv:http://x:1").sample_tasks(3, seed=0, split="test")  # type: ignore[attr-defined]
    assert {t.data["seed"] % 2 for t in tasks} == {0} and {t.data["seed"] % 2 for t in test} == {1}


async def test_server_killed_mid_episode_fails_the_episode_as_data(folder: Path) -> None:
    from agentrl.envs.openenv_env import OpenEnvEnv
    from agentrl.inference.engine import LocalEngine
    from agentrl.rollout.engine import RolloutConfig, RolloutEngine

    url, proc = serve(folder)
    engine = LocalEngine.from_pretrained("tiny")
    calls = 0

    class KillsTheServer:  # the real tiny model; the server dies after the first turns
        async def generate(
            self, input_ids: Any, params: Any, *, rid: Any = None, session_id: Any = None
        ) -> Any:
            nonlocal calls
            calls += 1
            if calls == 3:
                proc.kill()
                proc.wait(timeout=10)
            return await engine.generate(list(input_ids), params, rid=rid, session_id=session_id)

        def __getattr__(self, name: str) -> Any:
            return getattr(engine, name)

    class SeesCutTurns(OpenEnvEnv):  # the tiny model's turns all hit max_new_tokens
        sees_cut_turns = True

    try:
        cfg = RolloutConfig(group_size=2, max_turns=6, max_new_tokens=2, max_total_tokens=256)
        ro = RolloutEngine(KillsTheServer(), engine.tokenizer, cfg)  # type: ignore[arg-type]
        t0 = time.perf_counter()
        [group] = await ro.run_groups(
            lambda: SeesCutTurns(url, message_timeout_s=5), [Task(id="t", prompt="")]
        )
        assert time.perf_counter() - t0 < 10  # no hang
        errors = [t.error for t in group.trajectories if t.error]
        assert errors, [t.finish_reason for t in group.trajectories]
        assert all(e.startswith(f"EnvError: openenv:{url}: step() failed:") for e in errors)
        assert all("\n" not in e for e in errors)
    finally:
        proc.kill()
        await engine.aclose()


def test_rollout_and_two_train_steps_from_the_cli(server: str, folder: Path) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "agentrl.cli", *args],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=folder,
        )

    out = cli(
        "rollout",
        f"openenv:{server}",
        "--num-tasks",
        "2",
        "--group-size",
        "2",
        "--max-turns",
        "3",
        "--max-new-tokens",
        "2",
        "--out",
        "guess.jsonl",
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    recs = [json.loads(ln) for ln in (folder / "guess.jsonl").read_text().splitlines()]
    assert len(recs) == 4 and all(r["env_id"] == f"openenv:{server}" for r in recs)
    errors = [r["trajectory"]["error"] for r in recs]
    assert errors == [None] * 4, errors
    short = ["--train.steps=2", "--train.eval_every=0", "--train.tasks_per_step=2"]
    short += ["--rollout.group_size=2", "--env.num_eval_tasks=2", f"--env.id=openenv:{server}"]
    out = cli("train", "guess_openenv.toml", *short)
    assert out.returncode == 0, out.stderr[-3000:]
    (run_dir,) = (folder / "runs").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["env"] == f"openenv:{server}" and summary["steps"] == 2
