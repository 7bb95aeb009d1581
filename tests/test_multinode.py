"""``agentrl train`` on two "hosts": two torchrun launches joined by the c10d rendezvous.

Each launch (``--nnodes 2 --node-rank R --nproc-per-node 1``) runs in a working directory of
its own and gets the run directory as a relative path, so the two share no file: rank 0 writes
the run directory in its own, rank 1's checkpoint shards go to rank 0 over the gloo group
(:mod:`agentrl.loop.hosts`). The run equals one process's, as two ranks of one launch do
(``test_multiprocess_train``, whose config, run and comparison this reuses).
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_multiprocess_train import ENV, assert_same_run, metrics, write_config

from agentrl.config import load_config
from agentrl.loop.trainer import Trainer

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_nodes_train_like_one_process(tmp_path: Path) -> None:
    config = write_config(tmp_path / "config.yaml")
    one = tmp_path / "one"
    t = time.perf_counter()
    endpoint = f"127.0.0.1:{_free_port()}"
    procs = []
    for node in (0, 1):
        cwd = tmp_path / f"node{node}"  # each "host": its own directory, its own copy of the config
        cwd.mkdir()
        (cwd / "config.yaml").write_text(config.read_text())
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
               f"--node-rank={node}", "--nproc-per-node=1", "--rdzv-backend=c10d",
               f"--rdzv-endpoint={endpoint}", "-m", "agentrl.cli", "train", "config.yaml",
               "--run_dir=run"]  # fmt: skip
        log = (tmp_path / f"node{node}.log").open("w+b")  # files: a full pipe would block a rank
        procs.append((subprocess.Popen(cmd, cwd=cwd, env=ENV, stdout=log, stderr=log), log))
    # the one-process run while the two "hosts" train (they wait on each other, not on it)
    asyncio.run(Trainer(load_config(config, [f"--run_dir={one}"])).run())
    outs = []
    for p, log in procs:
        try:
            p.wait(timeout=120)
        except subprocess.TimeoutExpired:
            for q, _ in procs:
                q.kill()
            raise
        log.seek(0)
        outs.append(log.read().decode())
        log.close()
    for (p, _), out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-4000:]
    wall = time.perf_counter() - t
    run = tmp_path / "node0" / "run"
    # the metrics, trajectories and the weights of the checkpoint (sharded: rank 1's part came
    # over the group) equal one process's
    assert_same_run(one, run, weights_atol=1e-4, logprob_atol=2e-5)
    assert [m["step"] for m in metrics(run)] == [0, 1, 2, 2]
    ckpt = run / "checkpoints" / "step-000002"
    assert (ckpt / "learner" / "__1_0.distcp").exists()
    assert (ckpt / "trainer_state-rank1.pt").exists()
    assert (run / "export").is_dir()  # the final export read every shard on rank 0's disk
    # node 1 keeps no file of the run: no logs, and its checkpoint shards went to rank 0
    node1 = tmp_path / "node1"
    assert [p.relative_to(node1) for p in node1.rglob("*") if p.is_file()] == [Path("config.yaml")]
    assert outs[0].count("held-out success at end") == 1 and "held-out success" not in outs[1]
    assert wall < 120
