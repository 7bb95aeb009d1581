"""Shared fixtures: the tiny model, teacher-forced log-probs, real `agentrl serve` processes.

- ``tiny``: a fresh ``(model, tokenizer)`` from ``agentrl.tiny.build_tiny()`` (seeded, no download).
- ``teacher_logprobs``: ``f(model, prompt, output, temperature) -> list[float]``, the log-probs of
  ``output`` under one teacher-forced forward pass (SGLang's convention; 0 means greedy = T 1).
- ``tiny_server``: one ``agentrl serve --model tiny`` subprocess for the whole session, on a free
  loopback port, ready (``/health`` answered 200). Treat it as read-only: do not update its
  weights or leave it paused (use ``tiny_server_factory`` for that).
- ``scratch_server``: a second session server for tests that update weights or pause. Tests
  must not assume its weights or version label (read ``/model_info``) and must leave it unpaused.
- ``tiny_server_factory``: ``start(*extra_args) -> ServerProcess``; stopped after the test.
- ``proxy_factory``: ``await start(target_url, fault=None) -> Proxy``, a real HTTP proxy on loopback
  that records every JSON body and can inject faults (``fault(path, n) -> Response | None``,
  ``n`` counting the requests to ``path`` so far, this one included).
- ``sglang_api_types``: SGLang's generated JSON contract module (``api_types.py``), or a skip.
  Found via ``$AGENTRL_SGLANG_API_TYPES``, ``.venv/sglang_api_types.py`` or an installed
  ``sglang`` distribution; loaded by file path with only ``msgspec`` (never imports ``sglang``).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import aiohttp
import pytest
import torch
from aiohttp import web

from agentrl.tiny import build_tiny

REPO = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Modules with a ``slow`` test run first; ``gpu`` tests skip where there is no CUDA device.

    Slow first: pytest-xdist hands files out in this order (``--dist loadfile``), so the long
    ones start early and the workers finish together (a long test handed out last would run
    alone). A module's tests stay together (its module fixtures are built once), in their order.
    """
    slow = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow)  # stable
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (marked gpu)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture
def tiny() -> tuple[Any, Any]:
    return build_tiny()


def _teacher_logprobs(
    model: Any, prompt: list[int], output: list[int], temperature: float = 1.0
) -> list[float]:
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    logprobs = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return logprobs.gather(1, torch.tensor(output)[:, None])[:, 0].tolist()


@pytest.fixture
def teacher_logprobs() -> Callable[..., list[float]]:
    return _teacher_logprobs


@dataclass
class ServerProcess:
    """A running `agentrl serve` subprocess."""

    url: str
    proc: subprocess.Popen[str]
    log: deque[str] = field(default_factory=lambda: deque(maxlen=300))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)

    def kill(self) -> None:
        """SIGKILL: the server dies mid-whatever, like a crashed node."""
        self.proc.kill()
        self.proc.wait(timeout=15)


def start_tiny_server(
    *extra_args: str,
    timeout_s: float = 90.0,
    source: tuple[str, ...] = ("--model", "tiny"),
    allow_tmp: bool = True,
) -> ServerProcess:
    """Start `agentrl serve --model tiny --port 0` (or another ``source``: ``--config F``) and
    wait until /health answers 200. ``allow_tmp``: disk weight loads from the temp root (where
    the tests' own directories are) are allowed."""
    cmd = [sys.executable, "-m", "agentrl.cli", "serve", *source, "--port", "0"]
    cmd += ["--torch-threads", "1", "--log-level", "WARNING", *extra_args]
    if allow_tmp:  # tests push weights from their own tmp_path directories
        cmd += ["--weights-dir", tempfile.gettempdir()]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    log: deque[str] = deque(maxlen=300)
    urls: queue.Queue[str] = queue.Queue()

    def pump() -> None:  # keep draining so the server never blocks on a full pipe
        assert proc.stdout is not None
        for line in proc.stdout:
            log.append(line)
            if "listening on " in line:
                urls.put(line.rsplit("listening on ", 1)[1].strip())

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    try:
        url = urls.get(timeout=timeout_s)
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        return ServerProcess(url, proc, log)
            except OSError:
                time.sleep(0.1)
        raise TimeoutError("/health never answered 200")
    except Exception as exc:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"agentrl serve did not start ({exc}):\n{''.join(log)}") from exc


@pytest.fixture(scope="session")
def tiny_server() -> Iterator[ServerProcess]:
    server = start_tiny_server()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def scratch_server() -> Iterator[ServerProcess]:
    server = start_tiny_server()
    yield server
    server.stop()


@pytest.fixture
def tiny_server_factory() -> Iterator[Callable[..., ServerProcess]]:
    started: list[ServerProcess] = []

    def start(*extra_args: str) -> ServerProcess:
        server = start_tiny_server(*extra_args)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


class Proxy:
    """A loopback HTTP proxy that records requests and can answer some with a fault instead."""

    def __init__(
        self, target: str, fault: Callable[[str, int], web.Response | None] | None = None
    ) -> None:
        self.target = target
        self.fault = fault
        self.requests: list[tuple[str, Any]] = []  # (path, parsed JSON body or None)
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    async def _handle(self, request: web.Request) -> web.Response:
        raw = await request.read()
        self.requests.append((request.path, json.loads(raw) if raw.strip() else None))
        if self.fault is not None:
            injected = self.fault(request.path, len(self.bodies(request.path)))
            if injected is not None:
                return injected
        assert self._session is not None
        async with self._session.request(
            request.method, self.target + request.path_qs, data=raw, headers=request.headers
        ) as resp:
            body = await resp.read()
            return web.Response(status=resp.status, body=body, content_type=resp.content_type)

    async def start(self) -> Proxy:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    def bodies(self, path: str) -> list[Any]:
        return [body for p, body in self.requests if p == path]


@pytest.fixture
async def proxy_factory():
    proxies: list[Proxy] = []

    async def start(
        target: str, fault: Callable[[str, int], web.Response | None] | None = None
    ) -> Proxy:
        proxy = await Proxy(target, fault).start()
        proxies.append(proxy)
        return proxy

    yield start
    for proxy in proxies:
        await proxy.close()


def _find_api_types() -> Path | None:
    candidates = [os.environ.get("AGENTRL_SGLANG_API_TYPES", "")]
    candidates.append(str(REPO / ".venv" / "sglang_api_types.py"))
    try:
        sglang = importlib.metadata.distribution("sglang")
        candidates.append(str(sglang.locate_file("sglang/api/v1/api_types.py")))
    except importlib.metadata.PackageNotFoundError:
        pass
    return next((Path(c) for c in candidates if c and Path(c).is_file()), None)


@pytest.fixture(scope="session")
def sglang_api_types() -> ModuleType:
    if importlib.util.find_spec("msgspec") is None:
        pytest.skip("conformance needs msgspec (pip install msgspec)")
    path = _find_api_types()
    if path is None:
        pytest.skip(
            "SGLang's api_types.py not found: set AGENTRL_SGLANG_API_TYPES, or put it at "
            ".venv/sglang_api_types.py (unzip sglang/api/v1/api_types.py from the sglang==0.5.23 "
            "wheel), or install sglang"
        )
    spec = importlib.util.spec_from_file_location("sglang_api_types", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # msgspec resolves the Structs' annotations through it
    spec.loader.exec_module(module)
    return module
