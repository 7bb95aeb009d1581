"""MCP tools: a ToolEnv whose tools a real MCP server (the SDK's, over stdio or HTTP) provides."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("mcp")

from agentrl.env import make  # noqa: E402
from agentrl.envs.add_mcp import SERVER, AddMCPEnv  # noqa: E402
from agentrl.envs.add_tool import AddToolEnv, tool_call_text  # noqa: E402
from agentrl.errors import EnvError  # noqa: E402
from agentrl.mcp_client import _MARK, _child_pids, close_servers  # noqa: E402

TEST_SERVER = [sys.executable, "-P", SERVER, "--test-tools"]
TASK = AddToolEnv.sample_tasks(1, seed=3)[0]


def servers() -> list[int]:
    """Our children that are MCP servers we started (found by the mark in their environment)."""
    out = []
    for pid in _child_pids():
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if any(kv.startswith(_MARK.encode()) for kv in f.read().split(b"\0")):
                    out.append(pid)
        except OSError:
            pass
    return out


def call(name: str, **arguments: object) -> str:
    import json

    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


@pytest.fixture(scope="module", autouse=True)
def _no_servers_left() -> Iterator[None]:
    yield
    close_servers()
    assert servers() == []


def env(**kw: object) -> AddMCPEnv:
    return AddMCPEnv(mcp_server=TEST_SERVER, tool_timeout_s=0.5, max_result_chars=64, **kw)


async def test_tools_listed_into_schemas_and_called() -> None:
    e = env()
    messages, _ = await e.reset(TASK)
    assert [m.role for m in messages] == ["user"]
    assert [t.name for t in e.tools] == ["add", "slow", "fail", "big"]
    [add] = [s["function"] for s in e.tool_schemas() if s["function"]["name"] == "add"]
    assert add["description"] == "a + b for two integers"
    assert add["parameters"]["required"] == ["a", "b"]
    r = await e.step(call("add", a=4821, b=7390))
    assert r.observation[0].role == "tool"
    assert r.observation[0].content == "<tool_response>\n12211\n</tool_response>"
    assert r.info == {"tool_calls": 1, "tool_errors": 0} and not r.terminated
    r = await e.step(TASK.answer or "")
    assert r.terminated and r.reward == 1.0
    await e.close()


async def test_same_conversation_as_add_tool_v0() -> None:
    """The demonstration replays to the same tool message through the MCP server."""
    local, remote = make("add-tool-v0"), make("add-mcp-v0")
    outs = []
    for e in (local, remote):
        first, _ = await e.reset(TASK)
        demo = e.demonstration(TASK)
        assert demo is not None and demo[0] == tool_call_text(TASK.data["a"], TASK.data["b"])
        outs.append((first, (await e.step(demo[0])).observation, (await e.step(demo[1])).reward))
        await e.close()
    assert outs[0] == outs[1] and outs[0][2] == 1.0


async def test_tool_errors_timeouts_and_big_results_are_tool_messages() -> None:
    e = env()
    await e.reset(TASK)
    t0 = time.monotonic()
    r = await e.step(call("slow", seconds=5))
    assert time.monotonic() - t0 < 2.5
    assert r.observation[0].content == (
        "<tool_response>\nerror: MCPToolTimeout: tool 'slow' took longer than 0.5 s\n"
        "</tool_response>"
    )
    assert r.info["tool_errors"] == 1 and not r.terminated
    r = await e.step(call("fail", reason="no"))
    assert "error: MCPToolError: Error executing tool fail: failed: no" in r.observation[0].content
    r = await e.step(call("add", a="x", b=1))
    assert "a: expected an integer, got 'x'" in r.observation[0].content
    r = await e.step(call("big", n=100_000))  # cut before it becomes a message
    text = r.observation[0].content
    assert "x" * 64 + "\n[truncated to 64 characters]" in text and len(text) < 200
    r = await e.step(call("add", a=1, b=2))  # the server still serves after all that
    assert "\n3\n" in r.observation[0].content and r.info["tool_errors"] == 0
    await e.close()


async def test_server_killed_mid_episode_fails_the_episode_as_data() -> None:
    from agentrl.inference.engine import LocalEngine
    from agentrl.rollout.engine import RolloutConfig, RolloutEngine

    class Calls(AddMCPEnv):
        """Kills its server at the first step, then calls ``add`` whatever the model wrote (the
        tiny untrained model writes no call)."""

        sees_cut_turns = True

        async def step(self, action: str):  # type: ignore[no-untyped-def]
            assert self._conn is not None and self._conn.pid is not None
            killed.append(self._conn.pid)
            os.kill(self._conn.pid, signal.SIGKILL)
            return await super().step(tool_call_text(1, 2))

    killed: list[int] = []
    engine = LocalEngine.from_pretrained("tiny")
    try:
        cfg = RolloutConfig(group_size=2, max_turns=2, max_new_tokens=4, max_total_tokens=128,
                            seed=1, env_timeout_s=20)
        ro = RolloutEngine(engine, engine.tokenizer, cfg)
        t0 = time.monotonic()
        [g] = await ro.run_groups(lambda: Calls(mcp_server=TEST_SERVER, mcp_shared=False), [TASK])
        assert time.monotonic() - t0 < 15
    finally:
        await engine.aclose()
    for t in g.trajectories:
        assert t.finish_reason == "error" and t.info["failure"] == "env"
        assert t.error is not None and t.error.startswith("MCPServerDied")
        assert "connection closed" in t.error
    assert len(killed) == 2
    assert not [pid for pid in killed if os.path.exists(f"/proc/{pid}")]  # reaped, no zombie


async def test_no_server_left_after_closing_envs() -> None:
    before = set(servers())
    envs = [env(mcp_shared=False) for _ in range(3)]
    await asyncio.gather(*(e.reset(TASK) for e in envs))
    assert len(set(servers()) - before) == 3
    await asyncio.gather(*(e.close() for e in envs))
    assert set(servers()) - before == set()
    shared = [env() for _ in range(4)]  # four envs, one server
    await asyncio.gather(*(e.reset(TASK) for e in shared))
    assert len({e._conn for e in shared}) == 1
    close_servers()
    assert servers() == []


async def test_a_server_that_cannot_start_is_one_line_error() -> None:
    e = AddMCPEnv(mcp_server=[sys.executable, "-c", "import sys; sys.exit('no tools here')"])
    with pytest.raises(EnvError, match=r"failed to start: .*no tools here") as info:
        await e.reset(TASK)
    assert "\n" not in str(info.value)
    await e.close()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_server_ends_when_the_run_is_killed() -> None:
    """SIGKILL the run (no exit hook runs): its server sees stdin close and exits."""
    code = (
        "import sys, time; from agentrl.envs.add_mcp import server_command;"
        "from agentrl.mcp_client import MCPServerSpec, shared_connection;"
        "c = shared_connection(MCPServerSpec(command=tuple(server_command()))); c.start();"
        "print(c.pid, flush=True); time.sleep(60)"
    )
    run = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert run.stdout is not None
        pid = int(run.stdout.readline())
        assert _alive(pid)
    finally:
        run.kill()
        run.wait()
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)


def test_without_the_mcp_package_one_line_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "mcp", None)
    e = AddMCPEnv(mcp_shared=False)
    line = r"^MCP tools need the mcp package: pip install 'agentrl\[mcp\]'$"
    with pytest.raises(EnvError, match=line):
        asyncio.run(e.reset(TASK))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_tools_over_streamable_http() -> None:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-P", SERVER, "--http", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(200):  # up to 20 s on a loaded machine
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            await asyncio.sleep(0.1)
        e = AddMCPEnv(mcp_server=f"http://127.0.0.1:{port}/mcp")
        await e.reset(TASK)
        assert [t.name for t in e.tools] == ["add"]
        r = await e.step(call("add", a=20, b=22))
        assert r.observation[0].content == "<tool_response>\n42\n</tool_response>"
        await e.close()
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.slow
def test_cpu_tiny_mcp_preset_trains_two_steps(tmp_path: Path) -> None:
    from test_recipes import run_recipe

    s = run_recipe("math_agent.py", tmp_path, "train.steps=2", "train.tasks_per_step=2",
                   "cold_start.steps=4", "cold_start.check_every=2", "cold_start.batch_size=8",
                   "env.num_train_tasks=16", "env.num_eval_tasks=4", "rollout.group_size=4",
                   preset="cpu-tiny-mcp")
    assert s["env"] == "add-mcp-v0" and s["steps"] == 2
    assert "cold start on 16 demonstrations: 2.0 assistant turns" in s["stdout"]
    assert "MCPServerDied" not in s["stdout"] + s["stderr"]


async def test_the_docs_example_runs_as_written(tmp_path: Path) -> None:
    from agentrl.env import import_envs

    docs = (Path(__file__).parents[1] / "docs" / "envs.md").read_text()
    section = docs.split("## Tools from an MCP server", 1)[1]
    for code in [b.split("```", 1)[0] for b in section.split("```python\n")[1:]]:
        (tmp_path / code.splitlines()[0].removeprefix("# ")).write_text(code)
    import_envs([str(tmp_path / "calc_mcp_env.py")])
    e = make("mul-mcp-v0", tool_timeout_s=2)
    [task] = type(e).sample_tasks(1)
    messages, _ = await e.reset(task)
    assert '"name": "mul"' in messages[0].content and '"name": "sub"' in messages[0].content
    a, b = task.prompt.split("*")
    r = await e.step(call("mul", a=int(a), b=int(b)))
    assert r.observation[0].content == f"<tool_response>\n{task.answer}\n</tool_response>"
    r = await e.step(task.answer or "")
    assert r.terminated and r.reward == 1.0
    await e.close()
