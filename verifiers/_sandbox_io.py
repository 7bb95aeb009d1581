"""A run's limits, its pipes and its outcome, behind :mod:`agentrl.verifiers.sandbox`.

- :class:`Limits` and the result's types (:data:`ExecStatus`, :data:`Isolation`), re-exported by
  :mod:`~agentrl.verifiers.sandbox`.
- :class:`_Pipes` feeds stdin and reads stdout, stderr and bwrap's JSON status under a deadline
  and a byte cap; :func:`_outcome` turns what was read into a status and exit code.

Names with a leading underscore are private and may change without notice.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Literal

from agentrl.verifiers._sandbox_bwrap import _json_docs

ExecStatus = Literal["ok", "runtime_error", "timeout", "memory", "output_limit", "sandbox_error"]
Isolation = Literal["namespaces", "rlimits"]
IsolationChoice = Literal["auto", "namespaces", "rlimits"]


@dataclass(frozen=True, slots=True)
class Limits:
    """Per-sandbox limits besides the per-call ``timeout_s`` and ``memory_mb``."""

    nproc: int = 16
    """Processes plus threads the program may have at once (memory is per process: a run can
    use up to ``nproc * memory_mb``)."""
    nofile: int = 64
    """Open file descriptors."""
    fsize_mb: int = 16
    """Largest file the program may write."""
    tmp_mb: int = 64
    """Size of the private ``/tmp`` (namespaces only; rlimits bounds each file by ``fsize_mb``)."""
    max_output_bytes: int = 4 << 20
    """stdout plus stderr bytes read before the run is killed with ``output_limit``."""
    max_stderr_bytes: int = 8 << 10
    """stderr kept in the result (its tail)."""


class _Pipes:
    """Feeds stdin and reads stdout/stderr (and bwrap's status) under a deadline and a byte cap."""

    def __init__(
        self, proc: subprocess.Popen[bytes], data: bytes, status_fd: int | None, limits: Limits
    ) -> None:
        assert proc.stdin and proc.stdout and proc.stderr
        self.proc, self.limits, self.data, self.sent = proc, limits, data, 0
        self.out, self.err, self.status = bytearray(), bytearray(), bytearray()
        self.total = 0
        self.reason: Literal["output_limit"] | None = None
        self.sel = selectors.DefaultSelector()
        self.status_fd = status_fd
        self.pidfd: int | None = None
        try:
            self.pidfd = os.pidfd_open(proc.pid)
            self.sel.register(self.pidfd, selectors.EVENT_READ, "exit")
        except (AttributeError, OSError):  # old kernel: poll with waitid instead
            self.pidfd = None
        self.sel.register(proc.stdout, selectors.EVENT_READ, "out")
        self.sel.register(proc.stderr, selectors.EVENT_READ, "err")
        if status_fd is not None:
            self.sel.register(status_fd, selectors.EVENT_READ, "status")
        if data:
            os.set_blocking(proc.stdin.fileno(), False)
            self.sel.register(proc.stdin, selectors.EVENT_WRITE, "in")
        else:
            proc.stdin.close()

    def pump(self, deadline: float) -> Literal["timeout", "output_limit"] | None:
        """Move bytes until the process exits (None) or a limit hits (its name)."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return "timeout"
            wait = left if self.pidfd is not None else min(left, 0.01)
            for key, _ in self.sel.select(wait):
                if key.data == "exit":
                    return None
                if not self._move(key):
                    return "output_limit"
            if self.pidfd is None and _exited(self.proc.pid):
                return None

    def drain(self, deadline: float) -> None:
        """After the kill, read what is left until EOF or ``deadline``."""
        if self.pidfd is not None:
            self.sel.unregister(self.pidfd)
            os.close(self.pidfd)
            self.pidfd = None
        for key in list(self.sel.get_map().values()):
            if key.data == "in":
                self.sel.unregister(key.fileobj)
        while self.sel.get_map() and time.monotonic() < deadline and self.reason is None:
            for key, _ in self.sel.select(max(0.0, deadline - time.monotonic())):
                if not self._move(key):
                    self.reason = "output_limit"

    def _move(self, key: selectors.SelectorKey) -> bool:
        if key.data == "in":
            try:
                self.sent += os.write(key.fd, self.data[self.sent : self.sent + (1 << 16)])
            except (BrokenPipeError, BlockingIOError) as e:
                if isinstance(e, BrokenPipeError):
                    self.sent = len(self.data)
            if self.sent >= len(self.data):
                self.sel.unregister(key.fileobj)
                self.proc.stdin.close()  # type: ignore[union-attr]
            return True
        chunk = os.read(key.fd, 1 << 16)
        if not chunk:
            self.sel.unregister(key.fileobj)
            return True
        if key.data == "status":
            self.status += chunk[: max(0, (1 << 16) - len(self.status))]
            return True
        self.total += len(chunk)
        if self.total > self.limits.max_output_bytes:
            return False
        if key.data == "out":
            self.out += chunk
        else:
            self.err += chunk
            if len(self.err) > 2 * self.limits.max_stderr_bytes:
                del self.err[: -self.limits.max_stderr_bytes]
        return True

    def close(self) -> None:
        for key in list(self.sel.get_map().values()):
            self.sel.unregister(key.fileobj)
        self.sel.close()
        for fd in (self.pidfd, self.status_fd):
            if fd is not None:
                os.close(fd)
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if f is not None and not f.closed:
                f.close()


def _outcome(
    level: Isolation,
    reason: Literal["timeout", "output_limit"] | None,
    returncode: int,
    pipes: _Pipes,
) -> tuple[ExecStatus, int | None, str, str]:
    """(status, exit code, stdout, stderr tail) of a finished run, for an ``ExecResult``."""
    stdout = pipes.out.decode("utf-8", "replace")
    stderr = pipes.err[-pipes.limits.max_stderr_bytes :].decode("utf-8", "replace")
    code: int | None = returncode
    if level == "namespaces":
        docs = _json_docs(pipes.status.decode("utf-8", "replace"))
        exits = [d["exit-code"] for d in docs if "exit-code" in d]
        if not exits and reason is None:
            return "sandbox_error", returncode, stdout, stderr
        code = exits[0] if exits else None
        if code is not None and code > 128:  # bwrap reports death by signal N as 128 + N
            code = -(code - 128)
    status: ExecStatus
    if reason == "timeout":
        status, code = "timeout", None
    elif reason == "output_limit":
        status, code = "output_limit", None
    elif code == 0:
        status = "ok"
    elif _is_memory_error(stderr):
        status = "memory"
    elif code in (-signal.SIGKILL, -signal.SIGXCPU):  # the CPU limit (soft == hard: SIGKILL)
        status = "timeout"
    else:
        status = "runtime_error"
    return status, code, stdout, stderr


def _is_memory_error(stderr: str) -> bool:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    return bool(lines) and (
        lines[-1].startswith("MemoryError") or "Cannot allocate memory" in lines[-1]
    )


def _exited(pid: int) -> bool:
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
