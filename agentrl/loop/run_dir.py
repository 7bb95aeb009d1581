"""The run directory: made once, never silently shared by two runs.

A run directory that already holds a run (its ``config.yaml``, logs or checkpoints) is only
reused by ``--resume`` (continue it) or ``--overwrite`` (replace it). Overwriting renames the
old directory out of the way before deleting it, so a kill mid-way never leaves the two runs
mixed, and it only ever deletes a directory that holds a run.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from agentrl.errors import ConfigError
from agentrl.loop.atomic import disk_errors

RUN_FILES = ("config.yaml", "metrics.jsonl", "trajectories.jsonl", "checkpoints", "summary.json")
"""What marks a directory as holding a run."""


def holds_run(path: Path) -> bool:
    """Whether ``path`` is a directory with a run's files in it."""
    return path.is_dir() and any((path / name).exists() for name in RUN_FILES)


def in_use_message(path: Path) -> str:
    """The one line refusing to reuse ``path``."""
    return f"run_dir {path} holds a run; pass --resume to continue it or --overwrite to replace it"


def prepare(path: Path, *, resume: bool, overwrite: bool) -> None:
    """Check and make the run directory before anything is built (rank 0 calls).

    Raises:
        ConfigError: ``resume`` with no such directory; ``path`` holds a run and neither
            ``resume`` nor ``overwrite`` was given; ``resume`` and ``overwrite`` together; the
            directory cannot be made (one line naming the reason).
        DiskFull: no space left to make it.
    """
    if resume and overwrite:
        raise ConfigError("--resume and --overwrite: pass one (continue the run or replace it)")
    if resume:
        if not path.is_dir():
            raise ConfigError(f"run_dir: resume needs an existing run directory: {path}")
        return
    if holds_run(path):
        if not overwrite:
            raise ConfigError(in_use_message(path))
        remove_run(path)
    try:
        with disk_errors(path):
            path.mkdir(parents=True, exist_ok=True)
            probe = path / f".write-test-{os.getpid()}"  # fail now, not at the first log line
            probe.write_bytes(b"")
            probe.unlink()
    except OSError as e:
        raise ConfigError(f"run_dir: cannot create {path}: {e.strerror or e}") from e


def remove_run(path: Path) -> None:
    """Delete a directory that holds a run: renamed aside first, then removed (symlinks unfollowed).

    Raises:
        ConfigError: ``path`` does not hold a run, or cannot be removed.
    """
    if not holds_run(path) or path.is_symlink():
        raise ConfigError(f"run_dir: --overwrite removes only a run directory, not {path}")
    aside = path.with_name(f".{path.name}.overwritten-{os.getpid()}")
    try:
        os.replace(path, aside)
        shutil.rmtree(aside)
    except OSError as e:
        raise ConfigError(f"run_dir: cannot remove {path} to overwrite it: {e.strerror}") from e
