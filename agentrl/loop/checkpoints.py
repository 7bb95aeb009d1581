"""A run's checkpoint directories: written aside, sealed by a manifest, renamed into place.

Layout under ``RUN_DIR/checkpoints``::

    step-000004/          a committed checkpoint (only :func:`commit` creates one, by rename)
        MANIFEST          what the checkpoint holds (below); written last, before the rename
        trainer_state.pt  step, data cursor, RNG states (rank r > 0: trainer_state-rank{r}.pt)
        learner/...       model and optimizer shards, RNG, meta (torch.distributed.checkpoint)
    latest                the name of the newest committed checkpoint (informative)
    .tmp-step-000006/     a checkpoint being written (or left by a killed writer: ignored)

A checkpoint is written into ``.tmp-<name>`` by every rank, then rank 0 fsyncs its files, writes
the ``MANIFEST``, renames the directory to ``<name>`` and fsyncs ``checkpoints``: a kill at any
instant leaves either no ``<name>`` or a whole one. ``MANIFEST`` is JSON::

    {"format": "agentrl-checkpoint/1", "step": 4, "hash": "sha256",
     "files": {"trainer_state.pt": {"size": 1234, "sha256": "<64 hex digits>"}, ...}}

``files`` names every other file of the directory (``/``-separated paths relative to it). Resume
(:func:`verify`) rejects a checkpoint whose manifest is missing or unreadable, whose files are
missing, extra, of another size or another SHA-256; it then tries the next older one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

from agentrl.loop.atomic import disk_errors, fsync_dir, fsync_file, replace_file

log = logging.getLogger(__name__)

MANIFEST = "MANIFEST"
FORMAT = "agentrl-checkpoint/1"
_NAME = re.compile(r"^step-(\d{6,})$")
_CHUNK = 1 << 20


def name_of(step: int) -> str:
    """The directory name of the checkpoint of ``step``."""
    return f"step-{step:06d}"


def step_of(name: str) -> int | None:
    """The step a checkpoint directory name stands for (``None``: not a checkpoint name)."""
    m = _NAME.match(name)
    return int(m.group(1)) if m else None


def committed(root: Path) -> list[Path]:
    """The committed checkpoint directories under ``root``, newest (highest step) first."""
    if not root.is_dir():
        return []
    found = [(step_of(p.name), p) for p in root.iterdir() if p.is_dir()]
    return [p for s, p in sorted(((s, p) for s, p in found if s is not None), reverse=True)]


def sha256_of(path: Path) -> str:
    """The SHA-256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file() and p.name != MANIFEST)


def manifest_of(path: Path, step: int) -> dict[str, Any]:
    """The manifest of the files now under ``path`` (fsyncing each: they are read back)."""
    files = {}
    for p in _files(path):
        fsync_file(p)
        files[p.relative_to(path).as_posix()] = {"size": p.stat().st_size, "sha256": sha256_of(p)}
    return {"format": FORMAT, "step": step, "hash": "sha256", "files": files}


def begin(root: Path, step: int) -> Path:
    """A fresh, empty temporary directory for the checkpoint of ``step`` (rank 0 calls)."""
    tmp = root / f".tmp-{name_of(step)}"
    with disk_errors(tmp):
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # left by a killed writer
            shutil.rmtree(tmp)
        tmp.mkdir()
    return tmp


def commit(tmp: Path, step: int, *, keep: int | None) -> Path:
    """Seal ``tmp`` with its manifest and rename it into place; prune old ones (rank 0 calls).

    A committed checkpoint of the same step (one a resume skipped as bad, or one a resumed run
    is about to redo) is replaced. Only the ``keep`` newest checkpoints are kept (``None``: all).

    Returns:
        The committed directory.
    """
    root = tmp.parent
    final = root / name_of(step)
    with disk_errors(final):
        manifest = manifest_of(tmp, step)
        replace_file(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
        for d in sorted({p.parent for p in _files(tmp)}, key=lambda p: -len(p.parts)):
            fsync_dir(d)
        if final.exists():
            _remove(final)
        os.replace(tmp, final)
        fsync_dir(root)
        replace_file(root / "latest", final.name)
    if keep is not None:
        for old in committed(root)[keep:]:
            _remove(old)
    return final


def _remove(path: Path) -> None:
    """Remove a checkpoint directory: renamed out of sight first, so a kill never tears one."""
    trash = path.with_name(f".trash-{path.name}")
    if trash.exists():
        shutil.rmtree(trash)
    os.replace(path, trash)
    shutil.rmtree(trash)


def clean(root: Path) -> None:
    """Remove what killed writers left (``.tmp-*``, ``.trash-*``) under ``root`` (rank 0)."""
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith((".tmp-", ".trash-")) and p.is_dir():
                shutil.rmtree(p, ignore_errors=True)


def verify(path: Path) -> str | None:
    """Why the checkpoint at ``path`` cannot be trusted, or ``None`` when its manifest holds."""
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return f"no {MANIFEST} (torn, or written before checkpoints had one)"
    except (OSError, ValueError) as e:
        return f"unreadable {MANIFEST} ({type(e).__name__})"
    try:
        if manifest["format"] != FORMAT or manifest["hash"] != "sha256":
            return f"{MANIFEST} of an unknown format {manifest['format']!r}"
        want: dict[str, dict[str, Any]] = dict(manifest["files"])
        sizes = {name: int(v["size"]) for name, v in want.items()}
        digests = {name: str(v["sha256"]) for name, v in want.items()}
    except (KeyError, TypeError, ValueError, AttributeError):
        return f"malformed {MANIFEST}"
    try:
        return _check_files(path, sizes, digests)
    except OSError as e:
        return f"unreadable file ({e.strerror}: {e.filename})"


def _check_files(path: Path, sizes: dict[str, int], digests: dict[str, str]) -> str | None:
    want = sizes
    have = {p.relative_to(path).as_posix(): p for p in _files(path)}
    missing = sorted(set(want) - set(have))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        return f"missing file {missing[0]}{more}"
    extra = sorted(set(have) - set(want))
    if extra:
        return f"file {extra[0]} is not in its {MANIFEST}"
    for name, p in have.items():  # sizes first: cheap, and catch a truncation at once
        if p.stat().st_size != sizes[name]:
            return f"{name} has {p.stat().st_size} bytes, its {MANIFEST} says {sizes[name]}"
    for name, p in have.items():
        if sha256_of(p) != digests[name]:
            return f"checksum mismatch in {name}"
    return None
