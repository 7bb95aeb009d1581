"""Reproducible crashes, for the tests and ``benchmarks/faults.py``.

Two kinds:

* **kills at seeded instants**: :func:`kill_during` runs a child process
  (``python -m agentrl.loop.crash cut|checkpoint ...``) that performs a real log cut
  (:func:`agentrl.loop.logs.cut_logs`) or a real checkpoint write
  (:meth:`agentrl.loop.trainer.Trainer.save_checkpoint`) and SIGKILLs itself at its K-th
  filesystem event: an ``open``, ``mkdir``, rename or removal under the target directory (Python's
  audit events), or an ``os.write`` / ``os.fsync``. A first child counts the events; ``seed``
  draws K among them, so a seed names one instant, the same on every run of the same code;
* **checkpoint corruptions**: :data:`CORRUPTIONS`, eight ways a committed checkpoint directory
  goes bad on disk (flipped bytes, a truncated, grown or deleted shard, a deleted or garbled
  manifest, a torn directory, a checksum-valid file that cannot be loaded). Each must make
  resume skip that checkpoint with one line and use the previous one.

Example (``checkpoint`` resumes the run's config from ``RUN_DIR/config.yaml``)::

    n = count_events("cut", run_dir, step=2)
    for seed in range(20):                                   # each on a fresh copy of a run
        k, n = kill_during("cut", copy_of_run, seed, step=2, events=n)  # killed at event k of n
    k, n = kill_during("checkpoint", copy_of_run, seed=3)
    CORRUPTIONS["flip_64_bytes"](run_dir / "checkpoints" / "step-000004", seed=0)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentrl.loop.checkpoints import MANIFEST, manifest_of, step_of

# ---------------------------------------------------------------- corruptions


def shard_of(ckpt: Path) -> Path:
    """The checkpoint's largest learner file (the model and optimizer shard)."""
    return max((p for p in (ckpt / "learner").rglob("*") if p.is_file()), key=_size)


def _size(p: Path) -> int:
    return p.stat().st_size


def flip_64_bytes(ckpt: Path, seed: int = 0) -> None:
    """Invert 64 bytes at seeded offsets of the shard (its size unchanged)."""
    shard = shard_of(ckpt)
    data = bytearray(shard.read_bytes())
    for i in random.Random(seed).sample(range(len(data)), min(64, len(data))):
        data[i] ^= 0xFF
    shard.write_bytes(bytes(data))


def truncate_shard(ckpt: Path, seed: int = 0) -> None:
    """Cut the shard at a seeded point in its second half (a short write)."""
    shard = shard_of(ckpt)
    size = shard.stat().st_size
    os.truncate(shard, random.Random(seed).randrange(size // 2, size))


def grow_file(ckpt: Path, seed: int = 0) -> None:
    """Append seeded garbage to the trainer state (a file longer than its manifest says)."""
    with open(ckpt / "trainer_state.pt", "ab") as f:
        f.write(random.Random(seed).randbytes(100))


def delete_shard(ckpt: Path, seed: int = 0) -> None:
    """Delete the shard."""
    shard_of(ckpt).unlink()


def delete_manifest(ckpt: Path, seed: int = 0) -> None:
    """Delete the ``MANIFEST``."""
    (ckpt / MANIFEST).unlink()


def garble_manifest(ckpt: Path, seed: int = 0) -> None:
    """Overwrite the ``MANIFEST`` with seeded bytes (unreadable)."""
    (ckpt / MANIFEST).write_bytes(random.Random(seed).randbytes(256))


def torn_directory(ckpt: Path, seed: int = 0) -> None:
    """Leave the directory with its manifest and none of the files it names."""
    for p in list(ckpt.iterdir()):
        if p.name != MANIFEST:
            shutil.rmtree(p) if p.is_dir() else p.unlink()


def unloadable_state(ckpt: Path, seed: int = 0) -> None:
    """Garbage trainer state *with a matching manifest*: only loading it can tell."""
    (ckpt / "trainer_state.pt").write_bytes(random.Random(seed).randbytes(512))
    manifest = manifest_of(ckpt, step_of(ckpt.name) or 0)
    (ckpt / MANIFEST).write_text(json.dumps(manifest))


CORRUPTIONS: dict[str, Callable[..., None]] = {
    "flip_64_bytes": flip_64_bytes,
    "truncate_shard": truncate_shard,
    "grow_file": grow_file,
    "delete_shard": delete_shard,
    "delete_manifest": delete_manifest,
    "garble_manifest": garble_manifest,
    "torn_directory": torn_directory,
    "unloadable_state": unloadable_state,
}
"""Each ``f(checkpoint_dir, seed=0)`` corrupts a committed checkpoint in place."""


# ---------------------------------------------------------------- kills at seeded instants

_FS_EVENTS = ("open", "os.mkdir", "os.rename", "os.remove", "os.rmdir", "shutil.rmtree")


def _command(what: str, run_dir: Path, step: int | None) -> list[str]:
    out = [sys.executable, "-m", "agentrl.loop.crash", what, str(run_dir)]
    return out + ([] if step is None else ["--step", str(step)])


def count_events(what: str, target: Path, *, step: int | None = None) -> int:
    """How many filesystem events :func:`kill_during` can kill at (on a copy of ``target``)."""
    scratch = target.with_name(f"{target.name}.count")
    shutil.rmtree(scratch, ignore_errors=True)
    shutil.copytree(target, scratch, symlinks=True)
    try:
        counted = _child([*_command(what, scratch, step), "--count"], 120.0)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return int(counted.stdout.strip().splitlines()[-1])


def kill_during(
    what: str,
    target: Path,
    seed: int,
    *,
    step: int | None = None,
    events: int | None = None,
    timeout_s: float = 120.0,
) -> tuple[int, int]:
    """Run a log cut (``what="cut"``) or a checkpoint write (``"checkpoint"``) and kill it.

    Args:
        what: ``cut`` cuts the logs of run directory ``target`` back to ``step``;
            ``checkpoint`` builds ``target``'s trainer from its ``config.yaml`` and writes the
            checkpoint of the step after its newest.
        target: the run directory (changed in place: work on a copy).
        seed: picks the instant (see the module docstring).
        step: for ``cut``.
        events: :func:`count_events`'s answer for the same operation (counted when ``None``).
        timeout_s: per child.

    Returns:
        ``(k, n)``: the child was SIGKILLed at its ``k``-th of ``n`` filesystem events.

    Raises:
        RuntimeError: a child failed, or was not killed where it should have been.
    """
    n = events if events is not None else count_events(what, target, step=step)
    k = random.Random(seed).randint(1, n)
    proc = _child([*_command(what, target, step), "--kill-at", str(k)], timeout_s)
    if proc.returncode != -signal.SIGKILL:
        raise RuntimeError(f"crash {what}: expected a SIGKILL at event {k} of {n}: {proc.stderr}")
    return k, n


def _child(cmd: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
    if proc.returncode not in (0, -signal.SIGKILL):
        raise RuntimeError(f"crash child {cmd[3:]} failed: {proc.stderr.strip()[-2000:]}")
    return proc


def _arm(root: Path, kill_at: int | None) -> list[int]:
    """Count filesystem events under ``root`` from now on; SIGKILL this process at ``kill_at``."""
    count = [0]
    prefix = str(root.resolve())

    def tick() -> None:
        count[0] += 1
        if count[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    def audit(event: str, args: tuple[Any, ...]) -> None:
        if event in _FS_EVENTS and args and isinstance(args[0], (str, bytes, os.PathLike)):
            path = os.fsdecode(args[0])
            if os.path.abspath(path) == prefix or os.path.abspath(path).startswith(prefix + "/"):
                tick()

    real_write, real_fsync = os.write, os.fsync

    def write(fd: int, data: Any) -> int:
        tick()
        return real_write(fd, data)

    def fsync(fd: Any) -> None:
        tick()
        real_fsync(fd)

    sys.addaudithook(audit)
    os.write, os.fsync = write, fsync
    return count


def _main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="a log cut or checkpoint write, killed on demand")
    p.add_argument("what", choices=["cut", "checkpoint"])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--step", type=int, default=None)
    p.add_argument("--count", action="store_true", help="print the number of events")
    p.add_argument("--kill-at", type=int, default=None)
    args = p.parse_args(argv)
    run: Callable[[], object]
    if args.what == "cut":
        from agentrl.loop.logs import cut_logs

        def run() -> None:
            cut_logs(args.run_dir, args.step)
    else:
        from agentrl.config import load_config
        from agentrl.loop.checkpoints import committed
        from agentrl.loop.trainer import Trainer

        config = load_config(str(args.run_dir / "config.yaml"))
        config = config.model_copy(update={"run_dir": str(args.run_dir)})
        trainer = Trainer(config, resume=True)
        newest = committed(args.run_dir / "checkpoints")
        trainer.step = (step_of(newest[0].name) or 0) + 1 if newest else 1
        run = trainer.save_checkpoint
    count = _arm(args.run_dir, args.kill_at)
    run()
    if args.count:
        print(count[0], flush=True)


if __name__ == "__main__":
    _main()
