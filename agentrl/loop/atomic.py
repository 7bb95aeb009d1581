"""Files that survive any kill: write aside, fsync, rename over; and a full disk in one line.

A kill (SIGKILL, power loss after the fsyncs) at any instant of :func:`replace_file` leaves the
old file or the new one, whole: the new bytes go to a temporary file in the same directory,
which is fsynced, renamed over the original (``os.replace`` is atomic on POSIX) and the
directory fsynced so the rename itself is durable. Leftover temporaries (``.NAME.tmp-PID``) of
a killed writer are never read and are removed by the next write of the same file.

:func:`disk_errors` turns ``ENOSPC``/``EDQUOT`` while writing into :class:`DiskFull`, whose
message is the one line the CLI prints.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

from agentrl.errors import TrainingError

_FULL = (errno.ENOSPC, errno.EDQUOT)
NEARLY_FULL = 1 << 20
"""Free bytes under which a failed write is taken for a full disk (see :func:`disk_errors`)."""


class DiskFull(TrainingError):
    """The disk (or quota) filled up while the run wrote ``path``."""

    def __init__(self, path: Path | str) -> None:
        super().__init__(f"disk full while writing {path}: free space or choose another run_dir")
        self.path = Path(path)


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` or an exception it came from is ``ENOSPC``/``EDQUOT``."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _FULL:
            return True
        todo += [e.__cause__, e.__context__]
        # torch.distributed.checkpoint wraps each rank's failure: {rank: (exception, traceback)}
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] for f in failures.values() if isinstance(f, tuple) and f]
    return False


def free_bytes(path: Path | str) -> int | None:
    """Bytes free to this user on the filesystem of ``path`` (its nearest existing parent)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


@contextlib.contextmanager
def disk_errors(path: Path | str) -> Iterator[None]:
    """Raise :class:`DiskFull` naming ``path`` when the body fails for lack of space.

    Lack of space is ``ENOSPC``/``EDQUOT`` anywhere in the error's chain, or any error while
    less than :data:`NEARLY_FULL` bytes are free there: ``torch.save`` into a file (as
    ``torch.distributed.checkpoint`` does) reports a short write as a RuntimeError with no
    errno ("unexpected pos ...").
    """
    try:
        yield
    except (DiskFull, KeyboardInterrupt, SystemExit, GeneratorExit, asyncio.CancelledError):
        raise
    except BaseException as e:  # torch.distributed.checkpoint's errors are BaseExceptions
        free = free_bytes(path)
        if is_disk_full(e) or (free is not None and free < NEARLY_FULL):
            raise DiskFull(path) from e
        raise


def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    """Flush a file's data to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary_of(path: Path) -> Path:
    """The temporary file a write of ``path`` goes through (same directory: same filesystem)."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def replace_file(path: Path | str, chunks: bytes | str | Iterable[bytes]) -> None:
    """Write ``chunks`` as the whole new content of ``path``, atomically and durably.

    Raises:
        DiskFull: no space left (the old file is untouched, the temporary removed).
    """
    path = Path(path)
    for stale in path.parent.glob(f".{path.name}.tmp-*"):  # a killed writer's
        stale.unlink(missing_ok=True)
    tmp = temporary_of(path)
    if isinstance(chunks, str):
        chunks = chunks.encode("utf-8")
    if isinstance(chunks, bytes):
        chunks = [chunks]
    with disk_errors(path):
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                for chunk in chunks:
                    _write_all(fd, chunk)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(path.parent)


def append_bytes(path: Path | str, data: bytes) -> None:
    """Append ``data`` to ``path`` (a log line; a kill leaves at worst a torn last line).

    Raises:
        DiskFull: no space left.
    """
    with disk_errors(path), open(path, "ab") as f:
        f.write(data)
