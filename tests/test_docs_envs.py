"""docs/envs.md's worked example, run as written: its env and check script, and its config."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def blocks(lang: str) -> list[str]:
    text = (ROOT / "docs" / "envs.md").read_text()
    return [b.split("```", 1)[0] for b in text.split(f"```{lang}\n")[1:]]


def test_envs_doc_example_checks_and_its_config_loads(tmp_path: Path) -> None:
    for code in blocks("python") + blocks("toml"):  # each starts with "# its_file_name"
        (tmp_path / code.splitlines()[0].removeprefix("# ")).write_text(code)
    out = subprocess.run(
        [sys.executable, "check_lookup.py"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    shown = blocks("text")[0]  # the output the page shows is what the script prints
    assert out.stdout == shown
    assert "demonstration: 1.0\n" in shown and "keys shared by the splits: 0\n" in shown
    # every scripted shortcut, partial credit included, scores below solving
    rewards = {k: float(v) for k, v in (ln.rsplit(": ", 1) for ln in shown.splitlines()[1:-1])}
    assert rewards.pop("demonstration") == 1.0 and max(rewards.values()) <= 0.1
    load = (
        "from agentrl.config import load_config; "
        "c = load_config('lookup.toml', imports=['lookup_env.py']); "
        "print(c.env.id, c.rollout.max_turns, c.cold_start.target_success)"
    )
    out = subprocess.run(
        [sys.executable, "-c", load], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["lookup-v0", "2", "0.3"]
    command = blocks("bash")[0].splitlines()[0]
    assert command == "agentrl train lookup.toml --import lookup_env.py"
