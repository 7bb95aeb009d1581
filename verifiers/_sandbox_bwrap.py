"""Namespace mode behind :mod:`agentrl.verifiers.sandbox`: bubblewrap's options and its status.

- what the program sees: the host folders hidden behind empty tmpfs mounts (:func:`_hidden_dirs`)
  and bwrap's options for one run (:func:`_bwrap_args`: namespaces, mounts, environment).
- what bwrap reports: its JSON status (:func:`_json_docs`), from which the sandbox's pid 1 is
  found, killed (the kernel then kills the rest of the namespace) and awaited.

Nothing here is public; names keep their leading underscore and may change without notice.
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import signal
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger("agentrl.verifiers.sandbox")

_HIDE = ("/root", "/home", "/work", "/run", "/mnt", "/media", "/srv", "/opt", "/var/tmp")
_SYSTEM = tuple("/usr /bin /sbin /lib /lib32 /lib64 /libx32 /etc /proc /dev /sys /tmp /var".split())


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
