"""``agentrl serve`` as a subprocess for the benchmarks: started, waited for, stopped."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path


def start_server(
    source: list[str], log: Path, timeout_s: float = 600.0, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[str], str]:
    """``agentrl serve SOURCE --port 0``, its output going to ``log``; the process and its URL.

    ``source`` names what to serve (``["--model", DIR, "--device", D]`` or
    ``["--config", FILE]``, with any other ``agentrl serve`` options); ``env`` is added to this
    process's environment. The output goes to a file, not a pipe: the server never blocks on a
    reader, and its stack dumps survive a hung client.

    Raises:
        RuntimeError: the server exited or did not listen within ``timeout_s`` (with its log's
            tail).
    """
    cmd = [sys.executable, "-m", "agentrl.cli", "serve", *source, "--port", "0",
           "--log-level", "WARNING"]  # fmt: skip
    with log.open("w") as sink:
        proc = subprocess.Popen(
            cmd, stdout=sink, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})}
        )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in log.read_text(errors="replace").splitlines():
            if "listening on " in line:
                return proc, line.rsplit("listening on ", 1)[1].strip()
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    proc.wait()
    raise RuntimeError("agentrl serve did not start:\n" + log.read_text(errors="replace")[-4000:])


def stop_server(proc: subprocess.Popen[str], timeout_s: float = 60.0) -> None:
    """Terminate the server; kill it if it has not exited within ``timeout_s``."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
