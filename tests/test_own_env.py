"""The README's "Train your own environment", run as written: an env file, a config, --import."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def section() -> str:
    readme = (ROOT / "README.md").read_text()
    return readme.split("## Train your own environment", 1)[1].split("\n## ", 1)[0]


def block(text: str, lang: str) -> str:
    return text.split(f"```{lang}\n", 1)[1].split("```", 1)[0]


def run(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd
    )


def write_blocks(tmp_path: Path) -> str:
    text = section()
    env_code, toml = block(text, "python"), block(text, "toml")
    (tmp_path / env_code.splitlines()[0].removeprefix("# ")).write_text(env_code)
    (tmp_path / toml.splitlines()[0].removeprefix("# ")).write_text(toml)
    return block(text, "bash").strip()


def test_readme_env_trains_from_the_cli_with_import(tmp_path: Path) -> None:
    command = write_blocks(tmp_path)
    assert command == "agentrl train digits.toml --import digits_env.py"
    args = command.split()[1:]  # run as `python -m agentrl.cli`, 2 short steps
    short = [
        "--train.steps=2",
        "--train.eval_every=0",
        "--env.num_eval_tasks=8",
        "--train.tasks_per_step=4",
    ]
    out = run("-m", "agentrl.cli", *args, *short, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "held-out success at end" in out.stdout
    (run_dir,) = (tmp_path / "runs").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["env"] == "digits-v0" and summary["steps"] == 2
    recs = [json.loads(ln) for ln in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    assert recs and all(r["trajectory"]["env_id"] == "digits-v0" for r in recs)
    # without --import the error says how to find the env, in one line, and writes nothing
    (tmp_path / "runs2").mkdir()
    out = run("-m", "agentrl.cli", "train", "digits.toml", "--out_dir=runs2", cwd=tmp_path)
    assert out.returncode == 2 and "unknown env 'digits-v0'" in out.stderr
    assert "--import my_env.py" in out.stderr and "Traceback" not in out.stderr
    assert not any((tmp_path / "runs2").iterdir())


def test_rollout_and_recipes_take_import(tmp_path: Path) -> None:
    write_blocks(tmp_path)
    out = run(
        "-m",
        "agentrl.cli",
        "rollout",
        "digits-v0",
        "--import",
        "digits_env.py",
        "--num-tasks",
        "2",
        "--group-size",
        "2",
        "--max-turns",
        "2",
        "--max-new-tokens",
        "3",
        "--out",
        "out.jsonl",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = (tmp_path / "out.jsonl").read_text().splitlines()
    assert len(lines) == 4 and json.loads(lines[0])["env_id"] == "digits-v0"
    out = run(str(ROOT / "recipes" / "math_agent.py"), "--import", "nope.py", cwd=tmp_path)
    assert (
        out.returncode == 2
        and out.stderr.strip() == "agentrl: error: imports: no such file nope.py"
    )
    out = run(str(ROOT / "recipes" / "code_agent.py"), "--learner.lrr=1", cwd=tmp_path)
    assert (
        out.returncode == 2
        and "learner.lrr: Extra inputs are not permitted; did you mean 'lr'?" in out.stderr
    )


def test_rollout_flags_are_the_configs(tmp_path: Path) -> None:
    out = run("-m", "agentrl.cli", "rollout", "--help", cwd=tmp_path)
    assert out.returncode == 0
    help_text = " ".join(out.stdout.split())
    assert "--group-size INT Episodes per task (G)" in help_text
    assert "(--rollout.group_size; default 8)" in help_text  # RolloutConfig's default
    assert "(--inference.max_batch_size; default 64)" in help_text
    out = run(
        "-m",
        "agentrl.cli",
        "rollout",
        "arith-v0",
        "--group-size",
        "0",
        "--out",
        "x.jsonl",
        cwd=tmp_path,
    )
    assert out.returncode == 2 and "\n" not in out.stderr.strip()
    assert "rollout.group_size: Input should be greater than or equal to 1 (got 0)" in out.stderr
    assert not (tmp_path / "x.jsonl").exists()
