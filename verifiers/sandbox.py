"""Run untrusted Python in a sandbox: Linux namespaces through bubblewrap, or resource limits alone.

Two isolation levels, reported on every :class:`ExecResult`:

- ``namespaces``: the program runs under bubblewrap (``bwrap``) with every namespace unshared (no
  network, its own pids, mounts, IPC and hostname), a read-only view of ``/``, fresh ``/proc`` and
  ``/dev``, a size-bounded private tmpfs as its working directory (``/tmp``), the home, working
  directory and project folder of the parent (and ``/root``, ``/home``, ``/work``, ``/run``, ...)
  hidden behind empty read-only tmpfs mounts, and a cleared environment.
- ``rlimits``: the fallback where bwrap is missing or fails its self-test. Resource limits, a new
  session, a clean environment and a temporary working directory, nothing else: **the network and
  the host's files are not isolated** beyond file permissions (as root, the program runs under an
  unprivileged uid, so it can read world-readable files but not write root's).

Both levels limit address space (memory), CPU seconds, processes and threads, open files and file
size; the wall-clock timeout and the output cap (read at most N bytes, then kill) SIGKILL the whole
process tree at once (no SIGTERM grace, which a program could ignore), and no process of a run
survives :meth:`Sandbox.execute`. Memory is capped per process (``RLIMIT_AS``; no cgroups needed),
so one run can hold up to ``nproc * memory_mb``. The kernel ignores
``RLIMIT_NPROC`` for root, so as root the program runs under a dedicated unprivileged uid (one per
concurrent slot); with namespaces the process limit is set inside the sandbox's user namespace, so
it counts that sandbox's processes only. When that uid cannot reach the interpreter (a pyenv under
``/root``), a private mount namespace shows it the interpreter's folder first.

The program runs as ``python -I -S`` (stdlib only, unless ``site_packages=True``) through a small
bootstrap that sets the in-sandbox limits, restores ``exit``/``quit``, runs ``main.py`` as
``__main__`` (runpy would cost ~10 ms of imports) and trims its own frames from tracebacks. In
namespace mode the program is the sandbox's pid 1 (``--as-pid-1``): when it ends, the kernel kills
whatever it left behind. Executions run in worker threads bounded by the sandbox's concurrency
limit, never on the event loop.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import json
import logging
import math
import os
import queue
import resource
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from agentrl.errors import VerifierError

logger = logging.getLogger(__name__)

ExecStatus = Literal["ok", "runtime_error", "timeout", "memory", "output_limit", "sandbox_error"]
Isolation = Literal["namespaces", "rlimits"]
IsolationChoice = Literal["auto", "namespaces", "rlimits"]

_UID_BASE = 1_999_000_000
"""As root, slot ``i`` runs under uid/gid ``_UID_BASE + i`` (uids no account uses)."""
_PATH = "/usr/local/bin:/usr/bin:/bin"
_HIDE = ("/root", "/home", "/work", "/run", "/mnt", "/media", "/srv", "/opt", "/var/tmp")
_SYSTEM = tuple("/usr /bin /sbin /lib /lib32 /lib64 /libx32 /etc /proc /dev /sys /tmp /var".split())
_MARKER = "AGENTRL_SANDBOX_RUN"
_Setup = functools.partial[None]
_DRAIN_S = 1.0
_BOOT = """\
import builtins, resource, sys, _sitebuiltins
if int(sys.argv[1]):
    resource.setrlimit(resource.RLIMIT_NPROC, (int(sys.argv[1]), int(sys.argv[1])))
if sys.argv[2] == "1":
    import site; site.main()
builtins.exit = _sitebuiltins.Quitter("exit", "Ctrl-D (i.e. EOF)")
builtins.quit = _sitebuiltins.Quitter("quit", "Ctrl-D (i.e. EOF)")
def _hook(t, v, tb, _orig=sys.excepthook):
    while tb is not None and tb.tb_frame.f_code.co_filename != "main.py":
        tb = tb.tb_next
    _orig(t, v.with_traceback(tb) if v is not None else v, tb)
sys.excepthook = _hook
sys.argv[:] = ["main.py"]
_main = type(sys)("__main__")
_main.__file__, _main.__builtins__ = "main.py", builtins
sys.modules["__main__"] = _main
with open("main.py", "rb") as _f:
    _code = compile(_f.read(), "main.py", "exec")
del _f, _hook
exec(_code, _main.__dict__)
"""


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


@dataclass(frozen=True, slots=True)
class ExecResult:
    """Outcome of one execution."""

    status: ExecStatus
    exit_code: int | None
    """Exit status; ``-N`` when killed by signal N; ``None`` when the sandbox killed it."""
    stdout: str
    stderr: str
    """The tail of stderr (``Limits.max_stderr_bytes``)."""
    time_s: float
    isolation: Isolation

    @property
    def ok(self) -> bool:
        """Whether the program exited with status 0 within every limit."""
        return self.status == "ok"


@dataclass(frozen=True, slots=True)
class _Job:
    code: str
    stdin: str
    timeout_s: float
    memory_mb: int
    env: Mapping[str, str]


@dataclass(slots=True)
class _Launch:
    proc: subprocess.Popen[bytes]
    status_fd: int | None = None
    workdir: str | None = None


class Sandbox:
    """Runs Python programs in isolation; one instance can serve many threads and event loops.

    Args:
        isolation: ``"auto"`` (namespaces if bwrap passes its self-test, else rlimits),
            ``"namespaces"`` (fail if unavailable) or ``"rlimits"``.
        max_concurrency: executions at once (default: the CPUs this process may use).
        limits: process, file and output limits (defaults: :class:`Limits`).
        python: interpreter to run programs with (default: the base interpreter of this one).
        site_packages: let programs import the interpreter's site-packages (else stdlib only).
        hide: more host folders to hide in namespace mode.
    """

    def __init__(
        self,
        *,
        isolation: IsolationChoice = "auto",
        max_concurrency: int | None = None,
        limits: Limits | None = None,
        python: str | None = None,
        site_packages: bool = False,
        hide: Sequence[str] = (),
    ) -> None:
        if isolation not in ("auto", "namespaces", "rlimits"):
            raise ValueError(f"isolation: expected auto/namespaces/rlimits, got {isolation!r}")
        n = max_concurrency or len(os.sched_getaffinity(0)) or 1
        if n < 1:
            raise ValueError(f"max_concurrency: expected >= 1, got {n}")
        self.choice: IsolationChoice = isolation
        self.max_concurrency = n
        self.limits = limits or Limits()
        base: str = getattr(sys, "_base_executable", None) or sys.executable
        self.python = os.path.realpath(python or base)
        self.site_packages = site_packages
        self._prefix = str(Path(self.python).parent.parent)
        self._root = os.geteuid() == 0
        self._drop = self._root
        self._expose = _blocking_ancestor(self._prefix) if self._root else None
        self._hidden = _hidden_dirs(hide)
        self._slots: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(n):
            self._slots.put(i)
        self._level: Isolation | None = None
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    @property
    def isolation(self) -> Isolation:
        """The active level; the first access runs the self-test.

        Raises:
            VerifierError: ``"namespaces"`` was asked for and does not work, or nothing works.
        """
        with self._lock:
            if self._level is None:
                self._level = self._probe()
            return self._level

    @property
    def separate_uid(self) -> bool:
        """Whether programs run under a uid of their own (as root: a dedicated unprivileged one).

        False as a non-root user (programs share the user's uid) and for root when no unprivileged
        uid could run the interpreter; then rlimits mode guards neither files nor processes.
        """
        _ = self.isolation
        return self._drop

    def execute(
        self,
        code: str,
        *,
        stdin: str = "",
        timeout_s: float = 10.0,
        memory_mb: int = 512,
        env: Mapping[str, str] | None = None,
    ) -> ExecResult:
        """Run ``code`` as ``main.py`` with ``stdin``; block until it ends or a limit hits.

        Args:
            code: the Python program.
            stdin: text fed to its standard input.
            timeout_s: wall-clock limit (the CPU limit is this, rounded up, plus one second).
            memory_mb: address-space limit.
            env: extra environment variables for the program.
        """
        if timeout_s <= 0 or memory_mb < 16:
            raise ValueError(
                f"expected timeout_s > 0 and memory_mb >= 16, got {timeout_s}, {memory_mb}"
            )
        level = self.isolation
        slot = self._slots.get()
        try:
            return self._run(level, _Job(code, stdin, timeout_s, memory_mb, env or {}), slot)
        finally:
            self._slots.put(slot)

    async def execute_async(
        self,
        code: str,
        *,
        stdin: str = "",
        timeout_s: float = 10.0,
        memory_mb: int = 512,
        env: Mapping[str, str] | None = None,
    ) -> ExecResult:
        """:meth:`execute` in this sandbox's worker threads (at most ``max_concurrency``).

        Cancelling the awaiting task does not stop the run early: it ends within its limits.
        """
        call = functools.partial(
            self.execute, code, stdin=stdin, timeout_s=timeout_s, memory_mb=memory_mb, env=env
        )
        return await asyncio.get_running_loop().run_in_executor(self._executor(), call)

    def close(self) -> None:
        """Stop the worker threads (idempotent); running executions finish first."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="sandbox")
            return self._pool

    def _probe(self) -> Isolation:
        def works(level: Isolation) -> bool:
            slot = self._slots.get()
            try:
                r = self._run(level, _Job("print(6 * 7)", "", 10.0, 256, {}), slot)
            except (OSError, subprocess.SubprocessError) as e:
                logger.warning("sandbox self-test (%s) failed: %s", level, e)
                return False
            finally:
                self._slots.put(slot)
            if r.stdout.strip() != "42":
                logger.warning("sandbox self-test (%s) failed: %s %s", level, r.status, r.stderr)
            return r.stdout.strip() == "42"

        if self.choice != "rlimits":
            if shutil.which("bwrap") and works("namespaces"):
                logger.info("sandbox: namespaces (bwrap), python %s", self.python)
                return "namespaces"
            if self.choice == "namespaces":
                raise VerifierError("namespaces isolation unavailable (bwrap missing or failing)")
        if not works("rlimits") and self._drop:
            self._drop = False
            logger.warning(
                "sandbox: cannot run %s as an unprivileged uid; running as root, so "
                "process limits do not apply",
                self.python,
            )
            if not works("rlimits"):
                raise VerifierError(f"sandbox cannot run {self.python}")
        logger.warning("sandbox: rlimits only (no namespaces): network and files not isolated")
        return "rlimits"

    def _run(self, level: Isolation, job: _Job, slot: int) -> ExecResult:
        uid = _UID_BASE + slot if self._drop else None
        marker = secrets.token_hex(8)
        env = {"PATH": _PATH, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", _MARKER: marker, **job.env}
        r = resource
        rlim = [(r.RLIMIT_AS, job.memory_mb << 20), (r.RLIMIT_CPU, math.ceil(job.timeout_s) + 1)]
        rlim += [(r.RLIMIT_NOFILE, self.limits.nofile), (r.RLIMIT_CORE, 0)]
        rlim += [(r.RLIMIT_FSIZE, self.limits.fsize_mb << 20)]
        if level == "rlimits":  # namespaces: set inside the sandbox by _BOOT
            # RLIMIT_NPROC counts every task of the uid: allow for those a shared uid already has
            extra = 0 if uid is not None else _count_tasks(os.getuid())
            rlim.append((r.RLIMIT_NPROC, self.limits.nproc + extra))
        setup = functools.partial(_child_setup, uid, self._expose, rlim, level == "rlimits")
        start = time.monotonic()
        if level == "namespaces":
            launch = self._launch_namespaces(job.code, env, setup)
        else:
            launch = self._launch_rlimits(job.code, env, setup, uid)
        data = job.stdin.encode("utf-8", "replace")  # model text may hold lone surrogates
        pipes = _Pipes(launch.proc, data, launch.status_fd, self.limits)
        try:
            reason = pipes.pump(start + job.timeout_s)
            elapsed = time.monotonic() - start
            if level == "namespaces" and reason is not None:
                _kill_namespace(pipes.status)
            elif level == "rlimits":
                _kill_group(launch.proc.pid)
                _kill_strays(uid, marker.encode())
            pipes.drain(time.monotonic() + _DRAIN_S)
            try:  # bwrap exits once it has reaped the sandbox's pid 1: the namespace is gone
                returncode = launch.proc.wait(timeout=_DRAIN_S)
            except subprocess.TimeoutExpired:
                _kill_group(launch.proc.pid)
                returncode = launch.proc.wait()
                if level == "namespaces":  # pid 1 now dies of --die-with-parent: wait for it
                    _await_namespace(pipes.status)
        finally:
            pipes.close()
            if launch.workdir is not None:
                shutil.rmtree(launch.workdir, ignore_errors=True)
        reason = reason or pipes.reason
        return _result(level, reason, returncode, pipes, elapsed)

    def _launch_namespaces(self, code: str, env: dict[str, str], setup: _Setup) -> _Launch:
        mfd = os.memfd_create("main.py")
        status_r, status_w = os.pipe()
        try:
            os.write(mfd, code.encode("utf-8", "replace"))
            os.lseek(mfd, 0, os.SEEK_SET)
            bwrap = [shutil.which("bwrap") or "bwrap", *self._bwrap_args(mfd, status_w, env)]
            cmd = [*bwrap, "--", *self._python_cmd(self.limits.nproc)]
            proc = _popen(cmd, {"PATH": _PATH}, setup, pass_fds=(mfd, status_w))
        except BaseException:
            os.close(status_r)
            raise
        finally:
            os.close(mfd)
            os.close(status_w)
        return _Launch(proc, status_fd=status_r)

    def _bwrap_args(self, mfd: int, status_w: int, env: dict[str, str]) -> list[str]:
        lim = self.limits
        args = (
            "--unshare-all --unshare-user --disable-userns --die-with-parent --as-pid-1 "
            "--new-session --hostname sandbox --ro-bind / / --proc /proc --dev /dev"
        ).split()
        args += ["--size", str(lim.tmp_mb << 20), "--tmpfs", "/dev/shm", "--remount-ro", "/dev"]
        # Hide folders behind empty tmpfs mounts; show the interpreter again if it was under one,
        # then hide what lies inside the interpreter's folder; finally make all of them read-only.
        under = [d for d in self._hidden if d.startswith(self._prefix + "/")]
        outer = [d for d in self._hidden if not any(d.startswith(q + "/") for q in self._hidden)]
        for d in outer:
            args += ["--tmpfs", d]
        if any(self._prefix.startswith(d + "/") or self._prefix == d for d in outer):
            args += ["--ro-bind", self._prefix, self._prefix]
        for d in under:
            args += ["--tmpfs", d]
        for d in outer + under:
            args += ["--remount-ro", d]
        args += ["--size", str(lim.tmp_mb << 20), "--tmpfs", "/tmp", "--file", str(mfd)]
        args += "/tmp/main.py --chdir /tmp --clearenv --uid 65534 --gid 65534".split()
        args += ["--json-status-fd", str(status_w)]
        for k, v in {**env, "HOME": "/tmp", "TMPDIR": "/tmp"}.items():
            args += ["--setenv", k, v]
        return args

    def _launch_rlimits(
        self, code: str, env: dict[str, str], setup: _Setup, uid: int | None
    ) -> _Launch:
        workdir = tempfile.mkdtemp(prefix="agentrl-sandbox-")
        try:
            Path(workdir, "main.py").write_bytes(code.encode("utf-8", "replace"))
            if uid is not None:
                os.chown(workdir, uid, uid)
            env = {**env, "HOME": workdir, "TMPDIR": workdir}
            proc = _popen(self._python_cmd(0), env, setup, cwd=workdir)
        except BaseException:
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        return _Launch(proc, workdir=workdir)

    def _python_cmd(self, nproc: int) -> list[str]:
        flags = ["-I", "-S", "-B", "-c", _BOOT, str(nproc), str(int(self.site_packages))]
        return [self.python, *flags]


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


def _result(
    level: Isolation,
    reason: Literal["timeout", "output_limit"] | None,
    returncode: int,
    pipes: _Pipes,
    elapsed: float,
) -> ExecResult:
    stdout = pipes.out.decode("utf-8", "replace")
    stderr = pipes.err[-pipes.limits.max_stderr_bytes :].decode("utf-8", "replace")
    code: int | None = returncode
    if level == "namespaces":
        docs = _json_docs(pipes.status.decode("utf-8", "replace"))
        exits = [d["exit-code"] for d in docs if "exit-code" in d]
        if not exits and reason is None:
            return ExecResult("sandbox_error", returncode, stdout, stderr, elapsed, level)
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
    return ExecResult(status, code, stdout, stderr, elapsed, level)


def _json_docs(text: str) -> list[dict]:
    docs: list[dict] = []
    pos, dec = 0, json.JSONDecoder()
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos >= len(text):
            return docs
        try:
            obj, pos = dec.raw_decode(text, pos)
        except json.JSONDecodeError:
            return docs
        if isinstance(obj, dict):
            docs.append(obj)


def _is_memory_error(stderr: str) -> bool:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    return bool(lines) and (
        lines[-1].startswith("MemoryError") or "Cannot allocate memory" in lines[-1]
    )


# ----------------------------------------------------------------------------- processes


def _popen(
    cmd: list[str],
    env: dict[str, str],
    setup: _Setup,
    cwd: str | None = None,
    pass_fds: tuple[int, ...] = (),
) -> subprocess.Popen[bytes]:
    pipe = subprocess.PIPE
    return subprocess.Popen(
        cmd,
        stdin=pipe,
        stdout=pipe,
        stderr=pipe,
        cwd=cwd,
        env=env,
        pass_fds=pass_fds,
        start_new_session=True,
        preexec_fn=setup,
    )


def _exited(pid: int) -> bool:
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _pid1(status: bytearray) -> int | None:
    """A pidfd of the sandbox's pid 1 (bwrap's ``child-pid``), if it is still that process.

    The pid is checked to be in the sandbox's pid namespace once the pidfd pins it (pids get
    reused).
    """
    docs = [d for d in _json_docs(status.decode("utf-8", "replace")) if "child-pid" in d]
    if not docs:
        return None
    pid, ns = docs[0]["child-pid"], docs[0].get("pid-namespace")
    try:
        fd = os.pidfd_open(pid)
    except OSError:  # gone already
        return None
    try:
        if os.readlink(f"/proc/{pid}/ns/pid") == f"pid:[{ns}]":
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def _kill_namespace(status: bytearray) -> None:
    """SIGKILL the sandbox's pid 1 (the program, ``--as-pid-1``): the kernel then kills the rest.

    Its parent, bwrap, reaps it and exits, so no zombie is left to the host's init.
    """
    fd = _pid1(status)
    if fd is not None:
        try:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        except OSError:
            pass
        os.close(fd)


def _await_namespace(status: bytearray, timeout_s: float = 2.0) -> None:
    """Wait until the sandbox's pid 1 is gone: the kernel kills the whole namespace before that."""
    fd = _pid1(status)
    if fd is not None:
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            if not sel.select(timeout_s):
                logger.warning("sandbox pid 1 still alive after %.1fs", timeout_s)
        os.close(fd)


def _proc_status(pid: str) -> tuple[int, str, int] | None:
    """(real uid, state letter, threads) of ``pid``, or None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return int(fields["Uid"].split()[0]), fields["State"].split()[0], int(fields["Threads"])


def _stray_pids(uid: int | None, marker: bytes) -> list[int]:
    """Live processes of a run: with the run's own ``uid``, or carrying its ``marker`` variable."""
    me, hits = os.getpid(), []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == me:
            continue
        st = _proc_status(pid)
        if st is None or st[1] in ("Z", "X"):
            continue
        if uid is not None:  # a dedicated uid: setuid programs keep it as their real uid
            if st[0] == uid:
                hits.append(int(pid))
            continue
        try:
            if st[0] == os.getuid() and marker in Path(f"/proc/{pid}/environ").read_bytes():
                hits.append(int(pid))
        except OSError:
            pass
    return hits


def _kill_strays(uid: int | None, marker: bytes, timeout_s: float = 2.0) -> None:
    """Kill every process of a rlimits run, including those that left its process group."""
    needle = f"{_MARKER}={marker.decode()}".encode()
    deadline = time.monotonic() + timeout_s
    while pids := _stray_pids(uid, needle):
        if time.monotonic() > deadline:
            logger.warning("sandbox: processes %s of run %s survived", pids, marker.decode())
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.002)


def _count_tasks(uid: int) -> int:
    """Threads of every process of ``uid`` (what RLIMIT_NPROC counts)."""
    stats = [_proc_status(pid) for pid in os.listdir("/proc") if pid.isdigit()]
    return sum(st[2] for st in stats if st is not None and st[0] == uid)


# ----------------------------------------------------------------------------- child setup

_CLONE_NEWNS, _MS_BIND, _MS_REC, _MS_PRIVATE = 0x20000, 0x1000, 0x4000, 1 << 18
_PR_SET_NO_NEW_PRIVS, _PR_SET_PDEATHSIG = 38, 1
_libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _child_setup(
    uid: int | None, expose: tuple[str, str] | None, rlim: list[tuple[int, int]], bare: bool
) -> None:
    """Runs in the forked child before exec: expose the interpreter, drop root, set limits."""
    if expose is not None:
        ancestor, prefix = expose
        _check(_libc.unshare(_CLONE_NEWNS), "unshare")
        _check(_libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None), "mount private")
        fd = os.open(prefix, os.O_PATH | os.O_DIRECTORY)  # after unshare: a mount of this ns
        _check(
            _libc.mount(b"tmpfs", ancestor.encode(), b"tmpfs", 0, b"mode=0755,size=1m"),
            "mount tmpfs",
        )
        os.makedirs(prefix, mode=0o755)
        _check(
            _libc.mount(
                f"/proc/self/fd/{fd}".encode(), prefix.encode(), None, _MS_BIND | _MS_REC, None
            ),
            "bind interpreter",
        )
        os.close(fd)
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    for res, value in rlim:
        resource.setrlimit(res, (value, value))
    if bare:  # what bwrap does for itself: no setuid gains; die with the thread that started it
        _check(_libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl")
        _check(_libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl")


def _blocking_ancestor(prefix: str) -> tuple[str, str] | None:
    """The topmost folder on the way to ``prefix`` that other users cannot enter, if any."""
    parts = Path(prefix).parts
    for i in range(2, len(parts) + 1):
        d = str(Path(*parts[:i]))
        if not os.stat(d).st_mode & 0o001:
            return (d, prefix) if d != prefix else None
    return None


def _hidden_dirs(extra: Sequence[str]) -> list[str]:
    """Host folders to cover in namespace mode: defaults, HOME, cwd, the project, ``extra``.

    Never ``/``, an ancestor of a system folder, or anything under ``/tmp``, ``/proc``, ``/dev``
    and ``/sys`` (the sandbox gets its own).
    """
    found: set[str] = set()
    cands = [*_HIDE, os.path.expanduser("~"), str(Path(__file__).resolve().parents[1]), *extra]
    try:
        cands.append(os.getcwd())
    except OSError:
        pass
    for c in cands:
        p = os.path.realpath(c)
        ancestor = p == "/" or any(s == p or s.startswith(p + "/") for s in _SYSTEM)
        private = any(p.startswith(s + "/") for s in ("/tmp", "/proc", "/dev", "/sys"))
        if os.path.isdir(p) and not ancestor and not private:
            found.add(p)
    return sorted(found, key=lambda p: (p.count("/"), p))


# ----------------------------------------------------------------------------- module API

_DEFAULTS: dict[str, Sandbox] = {}
_DEFAULTS_LOCK = threading.Lock()


def default_sandbox(isolation: IsolationChoice = "auto") -> Sandbox:
    """The shared sandbox for ``isolation`` (created on first use, default limits)."""
    with _DEFAULTS_LOCK:
        if isolation not in _DEFAULTS:
            _DEFAULTS[isolation] = Sandbox(isolation=isolation)
        return _DEFAULTS[isolation]


def execute(
    code: str,
    *,
    stdin: str = "",
    timeout_s: float = 10.0,
    memory_mb: int = 512,
    isolation: IsolationChoice = "auto",
) -> ExecResult:
    """Run ``code`` in the shared sandbox of ``isolation``; see :meth:`Sandbox.execute`."""
    return default_sandbox(isolation).execute(
        code, stdin=stdin, timeout_s=timeout_s, memory_mb=memory_mb
    )


async def execute_async(
    code: str,
    *,
    stdin: str = "",
    timeout_s: float = 10.0,
    memory_mb: int = 512,
    isolation: IsolationChoice = "auto",
) -> ExecResult:
    """Async :func:`execute`, run in the sandbox's worker threads."""
    return await default_sandbox(isolation).execute_async(
        code, stdin=stdin, timeout_s=timeout_s, memory_mb=memory_mb
    )
