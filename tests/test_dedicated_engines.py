"""``inference.engine_gpus``: the run starts its own ``agentrl serve`` processes and stops them.

On the CPU: one real server process, weights pushed to it over gloo, and no process left after
the run, nor after the trainer is SIGKILLed mid-run.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from agentrl.config import load_config
from agentrl.errors import ConfigError
from agentrl.inference.api_keys import read_key
from agentrl.inference.base import SamplingParams
from agentrl.inference.client.sglang_client import SGLangClient
from agentrl.loop.engine_procs import engine_cards
from agentrl.tiny import build_tiny_model

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5  # float32 on the CPU: the served log-probs are the learner's


def run_config(run_dir: Path, steps: int = 2) -> dict[str, Any]:
    return {
        "run_dir": str(run_dir), "seed": 3,
        "model": {"device": "cpu"},
        "env": {"id": "arith-v0", "task_kwargs": {"digits": 1}, "num_train_tasks": 64,
                "num_eval_tasks": 4},
        "rollout": {"group_size": 4, "max_turns": 1, "max_new_tokens": 4, "max_total_tokens": 48},
        "cold_start": {"steps": 0},
        "learner": {"lr": 1e-4, "num_minibatches": 1},
        "advantages": {"shapers": [{"name": "format", "penalty": 0.1}]},
        "inference": {"engine_gpus": 1},
        "train": {"steps": steps, "tasks_per_step": 4, "eval_every": 0, "checkpoint_every": 0,
                  "export": False},
    }  # fmt: skip


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie that no one reaped yet does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


def wait_gone(pids: list[int], timeout_s: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def test_engine_gpus_config_is_checked_and_cards_follow_the_learners() -> None:
    cfg = load_config(None, ["--inference.engine_gpus=2"])
    assert cfg.inference.weight_sync == "distributed"  # saved so, and loads back
    assert load_config(cfg.model_dump(mode="json")).inference.engine_gpus == 2
    for bad, says in (
        (["--inference.engine_gpus=1", "--inference.endpoints=http://h:1"], "endpoints"),
        (["--inference.engine_gpus=0"], "greater than or equal to 1"),
        (["--inference.engine_gpus=1", "--inference.weight_sync=disk"], "distributed"),
    ):
        with pytest.raises(ConfigError, match=says):
            load_config(None, bad)
    assert engine_cards(1, [0], 2) == ["1"]  # one learner process on card 0
    assert engine_cards(2, [0, 1], 4) == ["2", "3"]  # torchrun --nproc-per-node 2 on 4 cards
    assert engine_cards(1, [1], 2) == ["0"]  # model.device=cuda:1
    assert engine_cards(1, [0], 2, visible="4,6") == ["6"]  # named as the parent sees them
    with pytest.raises(ConfigError, match="2 engine cards asked for, 1 left"):
        engine_cards(2, [0], 2)


@pytest.mark.slow
def test_a_run_serves_from_its_own_engine_and_stops_it(tmp_path, monkeypatch) -> None:
    """Two steps on a real server process; at step 2 it serves the learner's weights exactly."""
    from agentrl.loop.trainer import Trainer
    from agentrl.types import Message

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    seen: dict[str, Any] = {}

    def served_logprobs(url: str, key: str, prompt: list[int]) -> tuple[list[float], list[int]]:
        async def go() -> Any:
            async with SGLangClient(url, api_key=key) as client:
                info = await client.model_info()
                params = SamplingParams(max_new_tokens=6, temperature=1.0, ignore_eos=True, seed=1)
                return info, await client.generate(prompt, params)

        with ThreadPoolExecutor(1) as pool:  # the run's event loop is busy calling us
            info, out = pool.submit(asyncio.run, go()).result()
        seen["version"] = info["weight_version"]
        return out.logprobs, out.output_ids

    def on_step(rec: dict[str, float]) -> None:
        if rec["step"] != 2 or "rollout/episodes" not in rec:
            return  # step 2's weights were pushed before its line is logged
        engines = json.loads((tmp_path / "engines" / "engines.json").read_text())
        seen["pids"] = engines["pids"]
        assert all(alive(p) for p in engines["pids"])
        key = read_key(f"file:{tmp_path / 'engines' / 'api_key'}", "key")
        prompt = trainer.chat.prompt_ids([Message(role="user", content="1+2=")])
        seen["served"] = served_logprobs(engines["urls"][0], key or "", prompt)
        seen["weights"] = trainer.learner.state_dict_for_inference()
        seen["prompt"] = prompt

    trainer = Trainer(load_config(run_config(tmp_path)), on_step=on_step)
    assert asyncio.run(trainer.run())["steps"] == 2
    assert seen["version"] == "2" and seen["pids"]
    assert not wait_gone(seen["pids"])  # stopped and waited for at the run's end
    assert not (tmp_path / "engines" / "api_key").exists()
    assert not (tmp_path / "weights").exists()  # nothing went through the disk

    # the served log-probs are those of the learner's weights after step 2
    model = build_tiny_model(trainer.tokenizer, seed=0)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    (logprobs, ids), prompt = seen["served"], seen["prompt"]

    def scored(weights: dict[str, torch.Tensor]) -> list[float]:
        model.load_state_dict(weights)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
        lp = torch.log_softmax(logits.float(), -1)
        return lp.gather(1, torch.tensor(ids)[:, None])[:, 0].tolist()

    assert max(abs(a - b) for a, b in zip(logprobs, scored(seen["weights"]), strict=True)) < TOL
    assert max(abs(a - b) for a, b in zip(logprobs, scored(initial), strict=True)) > 10 * TOL
    # the overlapped loop (max_staleness 1): step 2 trained on tokens of versions 0 and 1
    records = [json.loads(ln) for ln in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    step2 = [r["trajectory"] for r in records if r["step"] == 2]
    assert step2 and all(set(t["versions"]) <= {-1, 0, 1} for t in step2)
    lines = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in lines if "perf/tokens" in m]
    assert trained and all(m["staleness/max"] <= 1 for m in trained)
    fresh = [m["mismatch/numeric_max_abs"] for m in trained if "mismatch/numeric_max_abs" in m]
    assert all(x < TOL for x in fresh)  # tokens of the learner's own version: same numbers


@pytest.mark.slow
def test_a_killed_trainer_leaves_no_engine(tmp_path) -> None:
    """SIGKILL mid-run: no handler runs, the kernel ends the server with its trainer."""
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(run_config(tmp_path / "run", steps=1000)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    trainer = subprocess.Popen(
        [sys.executable, "-m", "agentrl.cli", "train", str(config)], cwd=ROOT, env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    metrics = tmp_path / "run" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and trainer.poll() is None:
            lines = metrics.read_text().splitlines() if metrics.exists() else []
            if any('"rollout/episodes"' in ln for ln in lines):
                break  # a step is done: the run is under way
            time.sleep(0.1)
        assert trainer.poll() is None, trainer.stderr.read().decode() if trainer.stderr else ""
        pids = json.loads((tmp_path / "run" / "engines" / "engines.json").read_text())["pids"]
        assert pids and all(alive(p) for p in pids)
    finally:
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
    assert not wait_gone(pids)
