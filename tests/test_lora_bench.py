"""benchmarks/lora.py ``--dry-run``: full vs LoRA on the tiny model on the CPU, end to end (a
real ``agentrl serve`` takes both arms' HTTP pushes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # ~8-14 s on 2 cores: a subprocess, a server, two learners
def test_dry_run_reports_both_arms() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "lora.py"), "--dry-run"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(proc.stdout.splitlines()[-1])
    full, lora = report["full"], report["lora"]
    assert report["model"] == "tiny" and report["dtype"] == "float32"
    # rank 32 on every linear layer of a 128-wide model: fewer trainable parameters, and AdamW
    # keeps two float32 moments of each (plus a step count per tensor)
    assert 0 < lora["trainable_params"] < full["trainable_params"]
    for arm in (full, lora):
        assert 8 * arm["trainable_params"] <= arm["optimizer_state_bytes"]
        assert arm["optimizer_state_bytes"] <= 8 * arm["trainable_params"] + 8 * 1024
        assert arm["tokens_per_s"] > 0 and arm["peak_mem_gib"] > 0
        assert arm["push_in_process_s"] > 0 and arm["push_http_s"] > 0
    ratio = lora["optimizer_state_bytes"] / full["optimizer_state_bytes"]
    assert report["optimizer_state_ratio"] == ratio < 0.5
    assert report["held_out_success"] == {}  # (--steps N runs the training arms)
