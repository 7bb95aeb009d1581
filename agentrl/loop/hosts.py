"""Training ranks on several hosts: what rank 0 needs from ranks whose disk it cannot read.

``torchrun --nnodes N --node-rank R --rdzv-backend c10d --rdzv-endpoint HOST:PORT`` starts
the ranks of :mod:`agentrl.loop.ranks` on several hosts. Rank 0 alone writes the run directory;
the only files other ranks write are their shards of each checkpoint (every rank saves its
part, ``torch.distributed.checkpoint``). With no filesystem shared between the hosts those
land in each host's own copy of the path, and rank 0's checkpoint would lack them (the final
export and a resume read them). :func:`collect_files` ships them to rank 0 before the
checkpoint is sealed; on a shared filesystem (or one host) rank 0 sees them and nothing moves.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist

CHUNK_BYTES = 64 * 2**20  # one message: bounds the memory a file in flight takes


def _listing(path: Path) -> dict[str, int]:
    """Every file under ``path``: its path relative to ``path`` and its size."""
    if not path.is_dir():
        return {}
    return {str(p.relative_to(path)): p.stat().st_size for p in sorted(path.rglob("*"))
            if p.is_file()}  # fmt: skip


def _has(path: Path, size: int) -> bool:
    return path.is_file() and path.stat().st_size == size


def collect_files(ranks: Any, path: Path) -> int:
    """Copy to rank 0 the files under ``path`` that other ranks wrote and rank 0 cannot see.

    Every rank calls (``ranks``: :class:`~agentrl.loop.ranks.Ranks`), after the files are
    written (a barrier). A rank that cannot see rank 0's files is on a disk of its own; each
    of its files that rank 0 lacks (or holds at another size) is sent by the lowest such rank,
    in chunks over the ranks' gloo group, and written by rank 0 under the same relative path;
    a rank that sent files then removes its copy of ``path`` (nothing reads it: the checkpoint
    rank 0 seals is the run's).

    Returns:
        The number of bytes rank 0 received (0 on one host or a shared filesystem).
    """
    if ranks.world_size == 1:
        return 0
    listed: list[dict[str, int]] = ranks.all_gather(_listing(path))
    plan: list[tuple[int, str, int]] | None = None  # (sender, name, size)
    if ranks.is_main:
        plan, seen = [], set(listed[0])
        for r in range(1, ranks.world_size):
            if seen <= set(listed[r]):  # it sees rank 0's files: the same disk, nothing to send
                continue
            for name, size in listed[r].items():
                if name not in seen and not _has(path / name, size):
                    plan.append((r, name, size))
                seen.add(name)
    plan = ranks.broadcast(plan)
    assert plan is not None
    for sender, name, size in plan:
        if ranks.rank == sender:
            with open(path / name, "rb") as f:
                while chunk := f.read(CHUNK_BYTES):
                    dist.send_object_list([chunk], dst=0, group=ranks.group)
        elif ranks.is_main:
            (path / name).parent.mkdir(parents=True, exist_ok=True)
            with open(path / name, "wb") as f:
                left = size
                while left > 0:
                    box: list[Any] = [None]
                    dist.recv_object_list(box, src=sender, group=ranks.group)
                    f.write(box[0])
                    left -= len(box[0])
    ranks.barrier()  # every file is on rank 0: its senders' copies can go
    if any(sender == ranks.rank for sender, _, _ in plan):
        shutil.rmtree(path, ignore_errors=True)
    return sum(size for _, _, size in plan)
