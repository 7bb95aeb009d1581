"""OS plumbing behind :mod:`agentrl.verifiers.sandbox`: pipes, kills, child setup, bwrap options.

:mod:`~agentrl.verifiers.sandbox` holds the public API and decides *what* runs (isolation level,
limits, slots); this private module holds *how*, split out to keep both modules small:

- :class:`_Pipes` feeds stdin and reads stdout, stderr and bwrap's JSON status under a deadline
  and a byte cap; :func:`_outcome` turns what was read into a status and exit code.
- process scans and kills: the process group, bwrap's pid 1 (through a pidfd, checked against
  the sandbox's pid namespace), and stray processes of a rlimits run (by uid or marker variable).
- child setup run between fork and exec: the private mount that exposes the interpreter to an
  unprivileged uid, dropping root, resource limits, no-new-privs and the parent-death signal.
- the run uids (``_take_uid``), the host folders hidden in namespace mode and bwrap's options.

Nothing here is public; names keep their leading underscore and may change without notice.
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
import os
import resource
import secrets
import selectors
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

logger = logging.getLogger("agentrl.verifiers.sandbox")

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


_UID_BASE = 1_999_000_000
_UID_RANGE = 1 << 20
"""As root each run takes a uid/gid of its own in ``_UID_BASE + [0, _UID_RANGE)`` (uids no account
uses) that no live process has. RLIMIT_NPROC counts a uid's tasks system-wide: when runs shared a
uid (two sandboxes, or two processes with one each, numbering their slots alike), one run's
processes used up another's limit and its program failed to fork."""
_uids_taken: set[int] = set()
_uids_lock = threading.Lock()


def _take_uid() -> int:
    """A uid for one run: random in the range, unused here and by every live process."""
    with _uids_lock:
        while True:
            uid = _UID_BASE + secrets.randbelow(_UID_RANGE)
            if uid not in _uids_taken and _count_tasks(uid) == 0:
                _uids_taken.add(uid)
                return uid


def _release_uid(uid: int) -> None:
    """Give a run's uid back (its processes are gone)."""
    with _uids_lock:
        _uids_taken.discard(uid)
_PATH = "/usr/local/bin:/usr/bin:/bin"
_HIDE = ("/root", "/home", "/work", "/run", "/mnt", "/media", "/srv", "/opt", "/var/tmp")
_SYSTEM = tuple("/usr /bin /sbin /lib /lib32 /lib64 /libx32 /etc /proc /dev /sys /tmp /var".split())
_MARKER = "AGENTRL_SANDBOX_RUN"
_Setup = functools.partial[None]


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


# ----------------------------------------------------------------------------- bwrap


def _bwrap_args(
    mfd: int, status_w: int, env: dict[str, str], hidden: list[str], prefix: str, tmp_mb: int
) -> list[str]:
    """Options for ``bwrap`` (up to ``--``) for one run: namespaces, mounts, hidden folders, env.

    ``mfd`` holds the program (shown as ``/tmp/main.py``), bwrap writes its JSON status to
    ``status_w``; ``hidden`` folders become empty read-only tmpfs mounts, except that the
    interpreter's folder ``prefix`` is shown again; ``/tmp`` and ``/dev/shm`` hold ``tmp_mb``.
    """
    args = (
        "--unshare-all --unshare-user --disable-userns --die-with-parent --as-pid-1 "
        "--new-session --hostname sandbox --ro-bind / / --proc /proc --dev /dev"
    ).split()
    args += ["--size", str(tmp_mb << 20), "--tmpfs", "/dev/shm", "--remount-ro", "/dev"]
    # Hide folders behind empty tmpfs mounts; show the interpreter again if it was under one,
    # then hide what lies inside the interpreter's folder; finally make all of them read-only.
    under = [d for d in hidden if d.startswith(prefix + "/")]
    outer = [d for d in hidden if not any(d.startswith(q + "/") for q in hidden)]
    for d in outer:
        args += ["--tmpfs", d]
    if any(prefix.startswith(d + "/") or prefix == d for d in outer):
        args += ["--ro-bind", prefix, prefix]
    for d in under:
        args += ["--tmpfs", d]
    for d in outer + under:
        args += ["--remount-ro", d]
    args += ["--size", str(tmp_mb << 20), "--tmpfs", "/tmp", "--file", str(mfd)]
    args += "/tmp/main.py --chdir /tmp --clearenv --uid 65534 --gid 65534".split()
    args += ["--json-status-fd", str(status_w)]
    for k, v in {**env, "HOME": "/tmp", "TMPDIR": "/tmp"}.items():
        args += ["--setenv", k, v]
    return args
