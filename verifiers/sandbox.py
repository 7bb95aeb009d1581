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
run, which no live process has); with namespaces the process limit is set inside the sandbox's
user namespace, so it counts that sandbox's processes only. When that uid cannot reach the
interpreter (a pyenv under ``/root``), a private mount namespace shows it the interpreter's
folder first.

The program runs as ``python -I -S`` (stdlib only, unless ``site_packages=True``) through a small
bootstrap that sets the in-sandbox limits, restores ``exit``/``quit``, runs ``main.py`` as
``__main__`` (runpy would cost ~10 ms of imports) and trims its own frames from tracebacks. In
namespace mode the program is the sandbox's pid 1 (``--as-pid-1``): when it ends, the kernel kills
whatever it left behind. Executions run in worker threads bounded by the sandbox's concurrency
limit, never on the event loop.

This module holds the public API and the run logic; the OS plumbing lives in private modules: a
run's limits, pipes and outcome (:mod:`~agentrl.verifiers._sandbox_io`), its processes (start,
child setup, uids, kills: :mod:`~agentrl.verifiers._sandbox_processes`) and namespace mode
(bwrap's options and status: :mod:`~agentrl.verifiers._sandbox_bwrap`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import os
import queue
import resource
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from agentrl.errors import VerifierError
from agentrl.verifiers._sandbox_bwrap import (
    _await_namespace,
    _bwrap_args,
    _hidden_dirs,
    _kill_namespace,
)
from agentrl.verifiers._sandbox_io import (
    ExecStatus,
    Isolation,
    IsolationChoice,
    Limits,
    _outcome,
    _Pipes,
)
from agentrl.verifiers._sandbox_processes import (
    _MARKER,
    _PATH,
    _blocking_ancestor,
    _child_setup,
    _count_tasks,
    _kill_group,
    _kill_strays,
    _popen,
    _release_uid,
    _Setup,
    _take_uid,
)

logger = logging.getLogger(__name__)


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
        ok = works("rlimits")
        if not ok and self._drop:
            self._drop = False
            logger.warning(
                "sandbox: cannot run %s as an unprivileged uid; running as root, so "
                "process limits do not apply",
                self.python,
            )
            ok = works("rlimits")
        if not ok:  # also on a second probe, once the first gave up the unprivileged uid
            raise VerifierError(f"sandbox cannot run {self.python}")
        logger.warning("sandbox: rlimits only (no namespaces): network and files not isolated")
        return "rlimits"

    def _run(self, level: Isolation, job: _Job, slot: int) -> ExecResult:
        uid = _take_uid() if self._drop else None
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
        if level == "namespaces":
            launch = self._launch_namespaces(job.code, env, setup)
        else:
            launch = self._launch_rlimits(job.code, env, setup, uid)
        # The clock starts once the program is exec'd: forking this (large, maybe loaded) process
        # and running the pre-exec setup is the host's time, not the program's; counted in, it
        # made a 1 s limit end before the program had run under load (and time_s exceed 2 s).
        start = time.monotonic()
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
            if uid is not None:
                _release_uid(uid)
        reason = reason or pipes.reason
        status, code, out, err = _outcome(level, reason, returncode, pipes)
        return ExecResult(status, code, out, err, elapsed, level)

    def _launch_namespaces(self, code: str, env: dict[str, str], setup: _Setup) -> _Launch:
        mfd = os.memfd_create("main.py")
        status_r, status_w = os.pipe()
        try:
            os.write(mfd, code.encode("utf-8", "replace"))
            os.lseek(mfd, 0, os.SEEK_SET)
            opts = _bwrap_args(mfd, status_w, env, self._hidden, self._prefix, self.limits.tmp_mb)
            bwrap = [shutil.which("bwrap") or "bwrap", *opts]
            cmd = [*bwrap, "--", *self._python_cmd(self.limits.nproc)]
            proc = _popen(cmd, {"PATH": _PATH}, setup, pass_fds=(mfd, status_w))
        except BaseException:
            os.close(status_r)
            raise
        finally:
            os.close(mfd)
            os.close(status_w)
        return _Launch(proc, status_fd=status_r)

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
