"""A connection to one MCP server (a command over stdio, or a URL), and the run's shared ones.

The ``mcp`` SDK's client is an anyio context manager that must be entered and left by one task;
an env's ``reset``, ``step`` and ``close`` run in different tasks, and the CLI runs several
event loops (cold start, training, evaluation) one after the other. So each connection is owned
by a private thread with its own event loop, and calls hop to it from whichever loop awaits
them (~0.1 ms, against ~1 ms for an MCP call over stdio).

Lifecycle (measured, ``benchmarks/mcp_overhead.py``): starting a stdio server written with the
SDK takes ~0.5 s of a CPU core, a call ~1 ms. A server per episode would cost a training step of
128 episodes a minute of CPU, so by default one server per (command or URL) serves the whole run
(:func:`shared_connection`; a server that died is restarted for the next episode). It stops at
:func:`close_servers`, at interpreter exit, or when the parent dies (the server sees its stdin
close; MCP servers exit then). A server per env instance is an option for stateful tools.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import os
import shlex
import signal
import tempfile
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from agentrl.errors import EnvError

_MARK = "AGENTRL_MCP_SERVER"
"""Environment variable set on every server we start (its value is the connection's token), so
the exit hook finds the process to kill even if the connection's thread is stuck."""


class MCPServerDied(EnvError):
    """The MCP server exited or broke the protocol; the episode using it fails."""


class MCPToolError(Exception):
    """A tool call failed (the tool raised, refused its arguments, or the server said no)."""


class MCPToolTimeout(MCPToolError):
    """A tool call took longer than its timeout."""


def _import_mcp() -> Any:
    try:
        import mcp
    except ImportError:
        raise EnvError("MCP tools need the mcp package: pip install 'agentrl[mcp]'") from None
    return mcp


@dataclass(frozen=True, slots=True)
class MCPServerSpec:
    """Where the tools are: a command to start (stdio) or a URL (streamable HTTP)."""

    command: tuple[str, ...] = ()
    url: str | None = None
    env: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, server: str | Sequence[str], env: dict[str, str] | None = None) -> MCPServerSpec:
        """``"http(s)://..."`` is a URL; any other string is a shell-quoted command; a list is argv.

        Raises:
            EnvError: an empty command.
        """
        if isinstance(server, str) and server.startswith(("http://", "https://")):
            return cls(url=server)
        argv = tuple(shlex.split(server) if isinstance(server, str) else server)
        if not argv or not all(isinstance(a, str) and a for a in argv):
            raise EnvError(f"mcp_server: expected a command or an http(s) URL, got {server!r}")
        return cls(command=argv, env=tuple(sorted((env or {}).items())))

    def __str__(self) -> str:
        return self.url or shlex.join(self.command)


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds on what a server may send and how long it may take."""

    start_timeout_s: float = 60.0
    max_tools: int = 64
    max_description_chars: int = 1024
    max_schema_chars: int = 8192


def _child_pids() -> list[int]:
    """This process's children (every thread's), from /proc (Linux); empty elsewhere."""
    out: list[int] = []
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{os.getpid()}/task"):
            with open(f"/proc/{os.getpid()}/task/{tid}/children") as f:
                out += [int(p) for p in f.read().split()]
    return out


def _marked_child(token: str) -> int | None:
    needle = f"{_MARK}={token}".encode()
    for pid in _child_pids():
        with contextlib.suppress(OSError), open(f"/proc/{pid}/environ", "rb") as f:
            if needle in f.read().split(b"\0"):
                return pid
    return None


class MCPConnection:
    """One MCP server and a client session to it, owned by a private thread and event loop.

    :meth:`start` (blocking) or :meth:`ready` (awaitable) waits until the tools are listed;
    :meth:`call` may be awaited from any event loop; :meth:`close` is idempotent and bounded.
    """

    def __init__(self, spec: MCPServerSpec, limits: Limits | None = None) -> None:
        _import_mcp()  # fail here, in one line naming the extra, not in the thread
        self.spec = spec
        self.limits = limits or Limits()
        self.error: str | None = None
        """Why the connection is unusable (the server died, or never started), else None."""
        self.pid: int | None = None
        self.tools: list[Any] = []
        self._token = uuid.uuid4().hex
        self._ready: concurrent.futures.Future[list[Any]] = concurrent.futures.Future()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._client: Any = None
        self._closing = threading.Event()
        self._errlog = tempfile.TemporaryFile(mode="w+", prefix="mcp-stderr-")
        self._thread = threading.Thread(target=self._run, name=f"mcp {spec}"[:60], daemon=True)
        self._thread.start()
        with _LOCK:
            _LIVE.add(self)

    # ------------------------------------------------------------------ owner thread

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:  # the thread must never die silently; callers read .error
            self._fail(f"{type(e).__name__}: {e}")
        finally:
            self._fail("closed")
            self._errlog.close()

    def _fail(self, reason: str) -> None:
        if self.error is None:
            self.error = reason
        if not self._ready.done():
            died = MCPServerDied(f"MCP server {self.spec} failed to start: {reason}")
            self._ready.set_exception(died)

    async def _main(self) -> None:
        mcp = _import_mcp()
        from mcp.client.stdio import stdio_client
        from mcp.client.streamable_http import streamable_http_client

        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        if self.spec.url is not None:
            transport = streamable_http_client(self.spec.url)
        else:
            params = mcp.StdioServerParameters(
                command=self.spec.command[0],
                args=list(self.spec.command[1:]),
                env={**dict(self.spec.env), _MARK: self._token},
            )
            transport = stdio_client(params, errlog=self._errlog)
        try:
            async with asyncio.timeout(self.limits.start_timeout_s):
                client = await mcp.Client(transport).__aenter__()
        except Exception as e:
            self._fail(_one_line(e, self._stderr_tail()))
            return
        self._client = client
        try:
            try:
                async with asyncio.timeout(self.limits.start_timeout_s):
                    self.tools = await self._list_tools()
                self.pid = _marked_child(self._token)
                self._ready.set_result(self.tools)
            except Exception as e:
                self._fail(_one_line(e, self._stderr_tail()))
                return
            if not self._closing.is_set():  # (close() before the loop existed: stop now)
                await self._stop.wait()
        finally:
            # the SDK closes stdin, waits 2 s, then kills the process group (every wait bounded)
            with contextlib.suppress(BaseException):
                await client.__aexit__(None, None, None)

    async def _list_tools(self) -> list[Any]:
        lim, tools, cursor = self.limits, [], None
        while True:
            page = await self._client.list_tools(cursor=cursor)
            tools += page.tools
            if len(tools) > lim.max_tools:
                raise EnvError(f"the server lists more than max_tools={lim.max_tools} tools")
            cursor = page.next_cursor
            if cursor is None:
                return tools

    def _stderr_tail(self, n: int = 400) -> str:
        with contextlib.suppress(Exception):  # the file the server's stderr goes to
            fd = self._errlog.fileno()
            size = os.fstat(fd).st_size
            text = os.pread(fd, n, max(0, size - n)).decode("utf-8", "replace")
            lines = [ln for ln in text.splitlines() if ln.strip()]
            return lines[-1].strip() if lines else ""
        return ""

    async def _call(self, name: str, arguments: dict[str, Any], timeout_s: float) -> Any:
        from mcp import MCPError
        from mcp_types import CONNECTION_CLOSED, REQUEST_TIMEOUT

        try:
            async with asyncio.timeout(timeout_s + 1.0):  # the SDK's own timeout, then this one
                return await self._client.call_tool(name, arguments, read_timeout_seconds=timeout_s)
        except TimeoutError:
            raise MCPToolTimeout(f"tool {name!r} took longer than {timeout_s:g} s") from None
        except MCPError as e:
            if e.code == REQUEST_TIMEOUT:
                raise MCPToolTimeout(f"tool {name!r} took longer than {timeout_s:g} s") from None
            if e.code != CONNECTION_CLOSED:
                raise MCPToolError(str(e)) from None
            self._die(f"the connection closed ({self._stderr_tail() or 'the server exited'})")
        except Exception as e:  # a malformed result, a broken pipe: the protocol is broken
            self._die(_one_line(e, self._stderr_tail()))

    def _die(self, reason: str) -> NoReturn:
        if self.error is None:
            self.error = reason
        assert self._stop is not None
        self._stop.set()  # the thread unwinds the client, which kills what is left
        raise MCPServerDied(f"MCP server {self.spec}: {reason}")

    # ------------------------------------------------------------------ any thread

    def start(self) -> list[Any]:
        """Wait (blocking) until the tools are listed; return them.

        Raises:
            MCPServerDied: the server did not start, or did not list its tools in time.
        """
        return self._ready.result()

    async def ready(self) -> list[Any]:
        """:meth:`start`, awaited from any event loop."""
        return await asyncio.wrap_future(self._ready)

    async def call(self, name: str, arguments: dict[str, Any], timeout_s: float) -> Any:
        """Call tool ``name``; return its ``CallToolResult`` (which may be an error result).

        Raises:
            MCPToolTimeout: past ``timeout_s``.
            MCPToolError: the server answered the call with a protocol error.
            MCPServerDied: the server is gone, or answered with something malformed.
        """
        await self.ready()
        if self.error is not None or self._loop is None:
            raise MCPServerDied(f"MCP server {self.spec}: {self.error}")
        try:
            call = self._call(name, arguments, timeout_s)
            fut = asyncio.run_coroutine_threadsafe(call, self._loop)
        except RuntimeError:  # its loop closed in the meantime
            call.close()
            raise MCPServerDied(f"MCP server {self.spec}: {self.error or 'closed'}") from None
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            fut.cancel()
            raise

    @property
    def alive(self) -> bool:
        """Whether the connection can take calls (or is still starting)."""
        return self.error is None and self._thread.is_alive()

    def close(self, timeout_s: float = 8.0) -> None:
        """Stop the server and the thread (idempotent); kill the server if that takes too long."""
        self._closing.set()  # before reading the loop: see _main
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None:
            with contextlib.suppress(RuntimeError):  # the loop already ended
                loop.call_soon_threadsafe(stop.set)
        self._thread.join(timeout_s)
        pid = self.pid if self._thread.is_alive() else None
        if pid is not None:  # stuck: the server runs in its own session, so kill its group
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
        with _LOCK:
            _LIVE.discard(self)


def _one_line(e: BaseException, stderr: str = "") -> str:
    while isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1:
        e = e.exceptions[0]
    text = " ".join(str(e).split())[:300] or type(e).__name__
    return f"{type(e).__name__}: {text}" + (f" (server stderr: {stderr[:300]})" if stderr else "")


# ---------------------------------------------------------------------- the run's servers

_LOCK = threading.Lock()
_START_LOCK = threading.Lock()
_LIVE: set[MCPConnection] = set()
_SHARED: dict[tuple[MCPServerSpec, Limits], MCPConnection] = {}


def shared_connection(spec: MCPServerSpec, limits: Limits | None = None) -> MCPConnection:
    """The run's connection to ``spec``: started on first use, restarted if it died."""
    key = (spec, limits or Limits())
    with _START_LOCK:  # one start per key (a dead one's thread ends by itself; exit joins it)
        with _LOCK:
            conn = _SHARED.get(key)
        if conn is None or not conn.alive:
            conn = MCPConnection(spec, key[1])  # returns at once; the thread starts it
            with _LOCK:
                _SHARED[key] = conn
        return conn


def close_servers() -> None:
    """Stop every MCP server this process started (run at interpreter exit too)."""
    with _LOCK:
        live = list(_LIVE)
        _SHARED.clear()
    for conn in live:
        conn.close()


atexit.register(close_servers)
