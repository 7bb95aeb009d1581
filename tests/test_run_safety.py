"""Run safety (issue 43): logs and checkpoints that survive any kill, runs that stop well.

Real parts: real `agentrl train` subprocesses receiving real SIGINT/SIGTERM, real SIGKILLs at
seeded instants of a real log cut, real corrupted checkpoint files, a real full disk (a tiny
tmpfs in a private mount namespace, where the kernel allows one; /dev/full otherwise).
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml

from agentrl.cli import main
from agentrl.config import load_config
from agentrl.errors import ConfigError
from agentrl.loop import crash
from agentrl.loop.atomic import DiskFull, append_bytes, replace_file
from agentrl.loop.checkpoints import committed, verify
from agentrl.loop.logs import cut_logs
from agentrl.loop.ranks import Ranks
from agentrl.loop.resume import read_checkpoint, torch_save
from agentrl.loop.stop import resume_command
from agentrl.loop.trainer import Trainer

TIMING = ("time", "time/", "perf/", "cold_start_s", "rollout/generate_s")


def tiny(run_dir: Path, **train) -> dict:
    return {
        "run_dir": str(run_dir),
        "seed": 5,
        "env": {"id": "arith-v0", "task_kwargs": {"digits": 1}, "num_eval_tasks": 4},
        "rollout": {"group_size": 4, "max_turns": 1, "max_new_tokens": 4, "max_total_tokens": 48},
        "learner": {"lr": 1e-3},
        "train": {"steps": 4, "tasks_per_step": 4, "eval_every": 0, "checkpoint_every": 1,
                  "keep_checkpoints": None, "max_staleness": 0, **train},
    }  # fmt: skip


def steps_of(run_dir: Path) -> list[dict]:
    out = []
    for ln in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            rec = json.loads(ln)
        except ValueError:  # a line being written as the test polls
            continue
        if "rollout/reward_mean" in rec:
            out.append({k: v for k, v in rec.items() if not k.startswith(TIMING)})
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 4-step run with a checkpoint after every step (one thread: as the CLI's)."""
    run_dir = tmp_path_factory.mktemp("safety") / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        asyncio.run(Trainer(load_config(tiny(run_dir))).run())
    finally:
        torch.set_num_threads(threads)
    return run_dir


def copy_run(run: Path, dest: Path) -> Path:
    shutil.copytree(run, dest, ignore=shutil.ignore_patterns("*.png"))
    return dest


# ---------------------------------------------------------------- checkpoints


def test_checkpoints_are_sealed_by_a_manifest(run: Path) -> None:
    names = [p.name for p in committed(run / "checkpoints")]
    assert names == ["step-000004", "step-000003", "step-000002", "step-000001"]
    assert all(verify(p) is None for p in committed(run / "checkpoints"))
    manifest = json.loads((run / "checkpoints" / "step-000004" / "MANIFEST").read_text())
    assert manifest["format"] == "agentrl-checkpoint/1" and manifest["step"] == 4
    files = manifest["files"]
    assert "trainer_state.pt" in files and any(n.startswith("learner/") for n in files)
    assert all(len(v["sha256"]) == 64 and v["size"] > 0 for v in files.values())
    assert (run / "checkpoints" / "latest").read_text() == "step-000004"
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]


@pytest.fixture(scope="module")
def learner(run: Path):
    """One learner of the run's model, loaded again by every corruption case."""
    return Trainer(load_config(tiny(run)), resume=True).learner


@pytest.fixture(scope="module")
def step3_weights(run: Path, learner) -> dict[str, torch.Tensor]:
    learner.load_checkpoint(run / "checkpoints" / "step-000003")
    return {k: v.clone() for k, v in learner.module.state_dict().items()}


@pytest.mark.parametrize("corruption", sorted(crash.CORRUPTIONS))
def test_a_corrupt_checkpoint_falls_back_to_the_previous_one(
    run: Path, learner, step3_weights: dict, tmp_path: Path, corruption: str
) -> None:
    bad = tmp_path / "run"
    shutil.copytree(run / "checkpoints", bad / "checkpoints")
    learner.load_checkpoint(run / "checkpoints" / "step-000004")  # what a good resume loads
    crash.CORRUPTIONS[corruption](bad / "checkpoints" / "step-000004", seed=1)
    state, skipped = read_checkpoint(bad, learner, Ranks())
    assert state is not None and state["step"] == 3 and state["cursor"] == 12
    assert len(skipped) == 1 and "skipping checkpoint" in skipped[0] and "step-000004" in skipped[0]
    assert "\n" not in skipped[0]
    got = learner.module.state_dict()
    want = step3_weights
    assert all(torch.equal(got[k], want[k]) for k in want)  # step 3's weights, all of them


def test_resume_past_a_flipped_checkpoint_is_exact(run: Path, tmp_path: Path) -> None:
    bad = copy_run(run, tmp_path / "run")
    crash.flip_64_bytes(bad / "checkpoints" / "step-000004")
    trainer = Trainer(load_config(tiny(bad)), resume=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        summary = asyncio.run(trainer.run())
    finally:
        torch.set_num_threads(threads)
    assert summary["steps"] == 4 and not summary.get("already_finished")
    assert "skipping checkpoint" in (trainer.notice or "") and "step 3" in (trainer.notice or "")
    assert steps_of(bad) == steps_of(run)
    assert verify(bad / "checkpoints" / "step-000004") is None  # rewritten whole


def test_no_good_checkpoint_starts_over_keeping_the_logs(run: Path, tmp_path: Path) -> None:
    bad = copy_run(run, tmp_path / "run")
    for ckpt in committed(bad / "checkpoints"):
        crash.delete_manifest(ckpt)
    old = (bad / "metrics.jsonl").read_bytes()
    trainer = Trainer(load_config(tiny(bad)), resume=True)
    assert asyncio.run(trainer.load_checkpoint()) is False
    assert "no good checkpoint" in (trainer.notice or "")
    assert (bad / "metrics.jsonl.before-restart-1").read_bytes() == old
    assert not (bad / "metrics.jsonl").exists() and not (bad / "summary.json").exists()


def test_a_checkpoint_interrupted_before_its_rename_is_invisible(run: Path, tmp_path: Path) -> None:
    d = copy_run(run, tmp_path / "run")
    trainer = Trainer(load_config(tiny(d)), resume=True)
    asyncio.run(trainer.load_checkpoint())
    save = trainer.learner.save_checkpoint

    def dies_midway(path: Path) -> None:
        save(path)
        raise KeyboardInterrupt  # a kill between the files and the rename

    trainer.learner.save_checkpoint = dies_midway
    trainer.step = 5
    with pytest.raises(KeyboardInterrupt):
        trainer.save_checkpoint()
    assert (d / "checkpoints" / ".tmp-step-000005").is_dir()
    assert [p.name for p in committed(d / "checkpoints")][0] == "step-000004"
    assert read_checkpoint(d, trainer.learner, Ranks())[0]["step"] == 4


def test_keep_checkpoints_keeps_the_newest(run: Path, tmp_path: Path) -> None:
    d = copy_run(run, tmp_path / "run")
    cfg = load_config(tiny(d, keep_checkpoints=2))
    trainer = Trainer(cfg, resume=True)
    asyncio.run(trainer.load_checkpoint())
    trainer.step = 5
    trainer.save_checkpoint()
    assert [p.name for p in committed(d / "checkpoints")] == ["step-000005", "step-000004"]
    assert sorted(p.name for p in (d / "checkpoints").iterdir()) == [
        "latest", "step-000004", "step-000005"
    ]  # fmt: skip


# ---------------------------------------------------------------- logs


def test_log_cut_killed_at_seeded_instants_leaves_old_or_new(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    pad = "x" * 400
    (src / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "v": s}) + "\n" for s in range(40)) + '{"step": 40, "v'
    )
    (src / "trajectories.jsonl").write_text(
        "".join(json.dumps({"step": i // 100, "pad": pad}) + "\n" for i in range(4000))
    )
    want = tmp_path / "want"
    shutil.copytree(src, want)
    cut_logs(want, 15)
    new = {n: (want / n).read_bytes() for n in ("metrics.jsonl", "trajectories.jsonl")}
    old = {n: (src / n).read_bytes() for n in new}
    assert len(new["trajectories.jsonl"]) < len(old["trajectories.jsonl"]) // 2
    seen = set()
    events = crash.count_events("cut", src, step=15)
    for seed in range(5):
        d = tmp_path / f"kill{seed}"
        shutil.copytree(src, d)
        k, n = crash.kill_during("cut", d, seed, step=15, events=events)
        for name in new:
            got = (d / name).read_bytes()
            assert got in (old[name], new[name]), (name, k, n)
            seen.add((name, got == new[name]))
    assert ("metrics.jsonl", True) in seen and ("trajectories.jsonl", False) in seen


def test_a_finished_cut_is_whole_and_untorn(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"st')
    cut_logs(tmp_path, 5)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
    before = os.stat(tmp_path / "metrics.jsonl").st_ino
    cut_logs(tmp_path, 5)  # nothing to cut: not rewritten
    assert os.stat(tmp_path / "metrics.jsonl").st_ino == before
    replace_file(tmp_path / "x.json", "{}")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


# ---------------------------------------------------------------- the run directory


def test_a_run_dir_in_use_is_refused_and_overwrite_replaces_it(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = copy_run(run, tmp_path / "run")
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(tiny(d, steps=0)))
    assert main(["train", str(cfg)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"agentrl: error: run_dir {d} holds a run; pass --resume to continue it or "
        "--overwrite to replace it"
    )
    assert main(["train", str(cfg), "--overwrite"]) == 0
    assert [p.name for p in committed(d / "checkpoints")] == ["step-000000"]
    assert steps_of(d) == [] and not list(tmp_path.glob(".run.overwritten-*"))


def test_a_run_dir_that_cannot_be_made_is_one_line(tmp_path: Path, capsys) -> None:
    (tmp_path / "file").write_text("")
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(tiny(tmp_path / "file" / "run")))
    assert main(["train", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert err == f"agentrl: error: run_dir: cannot create {tmp_path}/file/run: Not a directory\n"
    with pytest.raises(ConfigError, match="pass one"):
        Trainer(load_config(tiny(tmp_path / "x")), resume=True, overwrite=True)


def test_writes_to_a_full_device_are_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(DiskFull, match="disk full while writing /dev/full: free space or"):
        append_bytes("/dev/full", b"{}\n")
    with pytest.raises(DiskFull, match="/dev/full"):
        torch_save({"step": 1}, Path("/dev/full"))  # torch.save itself says "unexpected pos"


def test_resume_command_is_exact() -> None:
    argv = ["/x/agentrl/cli.py", "train", "a b.yaml", "--overwrite", "--run_dir=old", "--x.y=1"]
    assert resume_command(Path("/r un"), argv) == shlex.join(
        [sys.executable, "-m", "agentrl.cli", "train", "a b.yaml", "--x.y=1",
         "--run_dir=/r un", "--resume"]
    )  # fmt: skip
    argv = ["recipes/math_agent.py", "--preset", "cpu-tiny", "run_dir=/a", "--resume"]
    assert resume_command(Path("/r"), argv).endswith(
        "recipes/math_agent.py --preset cpu-tiny --run_dir=/r --resume"
    )


# ---------------------------------------------------------------- real processes


def train_proc(*args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "agentrl.cli", "train", *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def signal_when(
    proc: subprocess.Popen[str], ready: Callable[[], bool], signum: int, times: int = 1
) -> str:
    """Send ``signum`` once ``ready()``; returns the last stderr line (there is no traceback)."""
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        if ready():
            for _ in range(times):
                proc.send_signal(signum)
            break
        time.sleep(0.02)
    _, err = proc.communicate(timeout=120)
    assert "Traceback" not in err, err[-3000:]
    return err.strip().splitlines()[-1]


def test_sigint_and_sigterm_stop_with_a_checkpoint_and_resume_exactly(
    run: Path, tmp_path: Path
) -> None:
    d = tmp_path / "run"
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(tiny(d, checkpoint_every=0)))  # only what a signal writes
    # Ctrl-C once step 1 is logged: the step in flight finishes and is checkpointed
    proc = train_proc(str(cfg))
    line = signal_when(proc, lambda: (d / "metrics.jsonl").exists() and steps_of(d), signal.SIGINT)
    assert proc.returncode == 130, line
    stopped = int(line.split()[3].rstrip(";"))
    assert line == f"stopped at step {stopped}; resume with " + shlex.join(
        [sys.executable, "-m", "agentrl.cli", "train", str(cfg), f"--run_dir={d}", "--resume"]
    )
    assert stopped in (1, 2), line
    assert [p.name for p in committed(d / "checkpoints")] == [f"step-{stopped:06d}"]
    # the printed command resumes; two SIGTERMs once it logged a step abandon the next step
    cmd = shlex.split(line.split("; resume with ", 1)[1])
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    more = lambda: steps_of(d)[-1]["step"] > stopped  # noqa: E731
    line = signal_when(proc, more, signal.SIGTERM, times=2)
    assert proc.returncode == 143 and line.startswith("stopped at step "), line
    again = int(line.split()[3].rstrip(";"))
    # (the step in flight is abandoned while it rolls out, else it finishes as on one signal)
    assert stopped <= again <= stopped + 2 and committed(d / "checkpoints")[0].name.endswith(
        f"{again:06d}"
    )
    final = subprocess.run(
        cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert final.returncode == 0, final.stderr[-2000:]
    assert steps_of(d) == steps_of(run)  # the steps of the uninterrupted run, bit for bit


def _private_tmpfs_works() -> bool:
    if not shutil.which("unshare"):
        return False
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt && echo ok"],
        capture_output=True, text=True,
    )  # fmt: skip
    return probe.stdout.strip() == "ok"


@pytest.mark.skipif(not _private_tmpfs_works(), reason="no private tmpfs (user namespaces)")
def test_a_full_disk_ends_the_run_with_one_line(tmp_path: Path) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(tiny(mnt / "run", steps=1)))
    train = shlex.join([sys.executable, "-m", "agentrl.cli", "train", str(cfg)])
    out = subprocess.run(
        ["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=256k tmpfs {mnt} && {train}"],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    last = out.stderr.strip().splitlines()[-1]
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert last.startswith(f"agentrl: error: disk full while writing {mnt}/run/"), last
    assert last.endswith(": free space or choose another run_dir")
