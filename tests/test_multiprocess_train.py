"""``agentrl train`` on two processes (gloo on CPU; NCCL on two cards for the ``gpu`` test).

Why the two-rank run equals one process: task group ``i`` runs on rank ``i % 2`` with the
per-request sampling seeds that one process gives it (they derive from ``i``, not from the
engine), so both runs sample the same tokens; the groups are gathered in task order, so the
advantages are the same; FSDP2 averages the ranks' gradients of their token-balanced shares,
which sum to the whole mini-batch's. What remains are float32 rounding differences: the engine
batches other rows together (log-probs agree to ~1e-6) and the gradient is summed in another
order, so after two RL steps of AdamW (lr 1e-3: each moves weights by ~1e-3) the weights agree to
~3e-5. The cold start runs on an unsharded replica on every rank, alike, and equals one process's.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from agentrl.config import load_config
from agentrl.loop.ranks import Ranks, fault_hook, sharded_weights
from agentrl.loop.trainer import Trainer
from agentrl.tiny import build_tiny

CONFIG: dict[str, Any] = {
    "seed": 3,
    "model": {"device": "cpu"},
    "env": {
        "id": "arith-v0",
        "task_kwargs": {"digits": 1},
        "num_train_tasks": 64,
        "num_eval_tasks": 6,
    },
    "rollout": {"group_size": 4, "max_turns": 1, "max_new_tokens": 4, "max_total_tokens": 48},
    # several ranks fine-tune a replica each, checked on the engines every 5 steps
    "cold_start": {"steps": 10, "lr": 2e-3, "batch_size": 16, "check_every": 5,
                   "target_success": 0.99},
    # a barely trained model scores 0 nearly everywhere: the length penalty gives every group a
    # signal
    "advantages": {"shapers": [{"name": "overlong", "max_tokens": 4, "cache": 3}]},
    "learner": {"lr": 1e-3, "num_minibatches": 2},
    "train": {
        "steps": 2,
        "tasks_per_step": 5,  # odd: rank 0 rolls out 3 groups, rank 1 two
        "eval_every": 0,
        "checkpoint_every": 1,
        "max_staleness": 0,
    },
}
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def write_config(path: Path, device: str = "cpu") -> Path:
    cfg = {**CONFIG, "model": {"device": device}}
    if device != "cpu":  # each engine's KV cache beside its learner on the card
        cfg["inference"] = {"kv_cache_gib": 1.0}
    path.write_text(yaml.safe_dump(cfg))
    return path


def torchrun(config: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 180):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += ["-m", "agentrl.cli", "train", str(config), *args]
    return subprocess.run(cmd, env=env or ENV, capture_output=True, text=True, timeout=timeout)


def trajectories(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run_dir / "trajectories.jsonl").read_text().splitlines()]


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    timing = ("time", "perf/", "cold_start_s", "rollout/generate_s")
    return [
        {k: v for k, v in json.loads(x).items() if not k.startswith(timing)} for x in lines
    ]


def final_weights(run_dir: Path, step: int = 2) -> dict[str, torch.Tensor]:
    """The model of the checkpoint of ``step``, gathered from its shards into one state dict."""
    out = run_dir / f"weights-{step}.pt"
    dcp_to_torch_save(run_dir / "checkpoints" / f"step-{step:06d}" / "learner", out)
    return dict(torch.load(out, weights_only=False)["model"])


def assert_same_run(one: Path, two: Path, *, weights_atol: float, logprob_atol: float) -> None:
    """Same trajectories, advantages, metrics (to ``logprob_atol``) and final weights."""
    ta, tb = trajectories(one), trajectories(two)
    assert len(ta) == len(tb) == 2 * 5 * 4  # every episode trained (the penalty's signal)
    for a, b in zip(ta, tb, strict=True):
        assert a["trajectory"]["tokens"] == b["trajectory"]["tokens"]
        assert a["advantages"] == b["advantages"]
        for key in ("trajectory.logprobs", "trainer_logprobs"):
            x = a["trajectory"]["logprobs"] if key.startswith("traj") else a[key]
            y = b["trajectory"]["logprobs"] if key.startswith("traj") else b[key]
            assert y is not None
            torch.testing.assert_close(torch.tensor(y), torch.tensor(x), atol=logprob_atol, rtol=0)
    ma, mb = metrics(one), metrics(two)
    # the start (cold start and evaluation), the training steps and the final evaluation (a run
    # that stopped and resumed at step 1 also logged an evaluation at its end)
    ma = ma[:1] + [m for m in ma if "rollout/reward_mean" in m] + ma[-1:]
    mb = mb[:1] + [m for m in mb if "rollout/reward_mean" in m] + mb[-1:]
    assert [m["step"] for m in ma] == [m["step"] for m in mb] == [0, 1, 2, 2]
    assert ma[0]["sft/steps"] == 10
    for a, b in zip(ma, mb, strict=True):
        assert a.keys() == b.keys()
        for k in a:
            assert a[k] == pytest.approx(b[k], abs=10 * logprob_atol), k
    wa, wb = final_weights(one), final_weights(two)
    before = final_weights(one, step=1)  # the second RL step moved the weights by ~lr
    assert max((wa[k] - before[k]).abs().max().item() for k in wa) > 5e-4
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], atol=weights_atol, rtol=0)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One process (in this one) and two ranks (torchrun) on the same config."""
    root = tmp_path_factory.mktemp("multiprocess")
    config = write_config(root / "config.yaml")
    one = root / "one"
    asyncio.run(Trainer(load_config(config, [f"--run_dir={one}"])).run())
    two = root / "two"
    t = time.perf_counter()
    proc = torchrun(config, f"--run_dir={two}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {"root": root, "config": config, "one": one, "two": two, "proc": proc,
            "two_s": time.perf_counter() - t}  # fmt: skip


def test_two_ranks_train_like_one_process(runs: dict[str, Any]) -> None:
    assert_same_run(runs["one"], runs["two"], weights_atol=1e-4, logprob_atol=2e-5)
    two = runs["two"]
    assert [m["step"] for m in metrics(two)] == [0, 1, 2, 2]  # start, steps, end
    # rank 0 alone wrote the logs and printed the summary; each rank wrote its checkpoint state
    assert runs["proc"].stdout.count("held-out success at end") == 1
    ckpt = two / "checkpoints" / "step-000002"
    assert (ckpt / "trainer_state.pt").exists() and (ckpt / "trainer_state-rank1.pt").exists()
    assert (two / "summary.json").exists() and (two / "config.yaml").exists()
    assert json.loads((two / "summary.json").read_text())["steps"] == 2


def test_resume_on_two_ranks_continues(runs: dict[str, Any], tmp_path: Path) -> None:
    part = tmp_path / "part"
    proc = torchrun(runs["config"], f"--run_dir={part}", "--train.steps=1")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (part / "checkpoints" / "latest").read_text() == "step-000001"
    proc = torchrun(runs["config"], f"--run_dir={part}", "--resume")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "from the checkpoint of step 1" in proc.stdout
    # the resumed run is the uninterrupted two-rank run: same ranks, same numerics
    assert_same_run(runs["two"], part, weights_atol=1e-6, logprob_atol=1e-6)


def test_two_ranks_with_an_endpoint_push_once(
    runs: dict[str, Any], tmp_path: Path, tiny_server_factory: Any
) -> None:
    """Both ranks roll out on `agentrl serve`; rank 0 pushes over the weight-update group."""
    server = tiny_server_factory("--device", "cpu", "--log-level", "INFO")
    run_dir = tmp_path / "remote"
    proc = torchrun(
        runs["config"], f"--run_dir={run_dir}", f'--inference.endpoints=["{server.url}"]',
        "--inference.weight_sync=distributed",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    # the server sampled with the per-request seeds: the same run as one process, in process
    assert_same_run(runs["one"], run_dir, weights_atol=1e-4, logprob_atol=2e-5)
    versions = [ln for ln in server.log if "weights updated; weight_version=" in ln]
    # one push per sync, from rank 0: the start, two cold-start checks, the cold start's end,
    # then each step
    assert [v.rsplit("=", 1)[1].strip() for v in versions] == ["0", "0", "0", "0", "1", "2"]


def _start_two(config: Path, run_dir: Path, fault: str, timeout_s: float) -> list[Any]:
    """Two ranks started by hand (no torchrun agent to end them): each must end by itself."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    procs = []
    for rank in (0, 1):
        env = {**ENV, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2"}
        env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "AGENTRL_FAULT": fault}
        cmd = [sys.executable, "-m", "agentrl.cli", "train", str(config), f"--run_dir={run_dir}"]
        cmd.append(f"--train.dist_timeout_s={timeout_s}")
        # files, not pipes: a rank blocked on a full pipe nobody reads would hang the other
        log = (run_dir.parent / f"rank{rank}.log").open("w+b")
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=log), log))
    return procs


def _wait_two(procs: list[Any], *others: list[Any]) -> list[tuple[int, str]]:
    """Each rank's exit code and output (every process of ``others`` is killed on a timeout)."""
    out = []
    for p, log in procs:
        try:
            p.wait(timeout=150)
        except subprocess.TimeoutExpired:
            for q, _ in [x for group in (procs, *others) for x in group]:
                q.kill()
            raise
        log.seek(0)
        out.append((p.returncode, log.read().decode()))
        log.close()
    return out


@pytest.fixture(scope="module")
def faults(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A rank that fails and a rank that hangs, each in a two-rank run; both runs at once."""
    root = tmp_path_factory.mktemp("faults")
    config = write_config(root / "config.yaml")
    t = time.perf_counter()
    # a timeout far beyond the test's: the others learn of the failure, they do not wait it out
    failing = _start_two(config, root / "fail" / "run", "1:2", timeout_s=600)
    # long enough that two ranks' scheduling on a loaded machine never trips it before step 2
    hanging = _start_two(config, root / "hang" / "run", "1:2:hang", timeout_s=20)
    fail = _wait_two(failing, hanging)
    fail_s = time.perf_counter() - t
    hang = _wait_two(hanging, failing)
    return {"fail": fail, "fail_s": fail_s, "fail_dir": root / "fail" / "run", "hang": hang}


def test_failing_rank_ends_every_rank_naming_it(faults: dict[str, Any]) -> None:
    results = faults["fail"]
    for rank, (code, err) in enumerate(results):
        assert code == 1, (rank, err[-3000:])
        assert "rank 1 failed at step 2: RuntimeError: injected failure" in err, (rank, err[-3000:])
    assert "rank 0 stops too" in results[0][1]
    assert faults["fail_s"] < 120
    # step 1 finished and was checkpointed; step 2 was never logged
    assert [m["step"] for m in metrics(faults["fail_dir"])] == [0, 1]


def test_hanging_rank_times_out_naming_rank_and_step(faults: dict[str, Any]) -> None:
    expected = "rank 0 failed at step 2: no answer from the other ranks within "
    expected += "train.dist_timeout_s = 20 s"
    results = faults["hang"]
    for rank, (code, err) in enumerate(results):
        assert code == 1, (rank, err[-3000:])
        assert expected in err, (rank, err[-3000:])
    assert "rank 1 stops too" in results[1][1]


def test_two_ranks_overlapped_loop(runs: dict[str, Any], tmp_path: Path) -> None:
    """max_staleness=1: each rank overlaps its own groups; every step trains the gathered batch."""
    run_dir = tmp_path / "overlapped"
    proc = torchrun(runs["config"], f"--run_dir={run_dir}", "--train.max_staleness=1",
                    "--train.steps=3")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    steps = [m for m in metrics(run_dir) if "rollout/episodes" in m]
    assert [m["step"] for m in steps] == [1, 2, 3]
    assert all(m["rollout/episodes"] == 5 * 4 for m in steps)  # tasks_per_step groups of 4
    assert max(m["staleness/max"] for m in steps) <= 1
    groups = {(r["step"], r["trajectory"]["task_id"]) for r in trajectories(run_dir)}
    assert len(groups) == 3 * 5  # 5 groups a step, none trained twice
    assert len({task for _, task in groups}) == 15


def test_multiprocess_hooks() -> None:
    fault_hook(1, 2, {})  # unset: nothing
    fault_hook(0, 2, {"AGENTRL_FAULT": "1:2"})  # another rank
    with pytest.raises(RuntimeError, match="injected failure"):
        fault_hook(1, 2, {"AGENTRL_FAULT": "1:2"})
    assert Ranks(rank=1, world_size=2).mine(5) == [1, 3]
    model, _ = build_tiny(seed=0)  # its head is tied to the embedding: one name for both
    names = set(sharded_weights(model))
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    assert len(names) == len(model.state_dict()) - 1


@pytest.mark.gpu
def test_two_cards_train_like_one(tmp_path: Path) -> None:
    """The same check with NCCL on two cards (each rank's engine and learner on its card)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    config = write_config(tmp_path / "config.yaml", device="auto")
    one = tmp_path / "one"  # a process of its own, so that this one holds no card memory
    cmd = [sys.executable, "-m", "agentrl.cli", "train", str(config), f"--run_dir={one}"]
    proc = subprocess.run(cmd, env={**ENV, "CUDA_VISIBLE_DEVICES": "0"}, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    proc = torchrun(config, f"--run_dir={tmp_path / 'two'}", timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert_same_run(one, tmp_path / "two", weights_atol=2e-4, logprob_atol=1e-4)
