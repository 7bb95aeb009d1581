"""A run's processes behind :mod:`agentrl.verifiers.sandbox`: start, child setup, uids, kills.

- start: :func:`_popen` in a new session, with :func:`_child_setup` run between fork and exec
  (the private mount that exposes the interpreter to an unprivileged uid, dropping root,
  resource limits, no-new-privs and the parent-death signal).
- the run uids (:func:`_take_uid`): as root each run gets one that no live process has.
- kills: the process group, and stray processes of a rlimits run (by uid or marker variable).

Nothing here is public; names keep their leading underscore and may change without notice.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import resource
import secrets
import signal
import subprocess
import threading
import time
from pathlib import Path

logger = logging.getLogger("agentrl.verifiers.sandbox")

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
_MARKER = "AGENTRL_SANDBOX_RUN"
_Setup = functools.partial[None]


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


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


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
