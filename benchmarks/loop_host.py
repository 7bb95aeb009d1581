"""Host work on the training loop's event loop, per step, beside the stdlib way it replaced.

On a GPU the loop's event loop, the learner's kernel-launching threads and the embedded
engine's scheduler share one GIL (``loop_gpu.py``: the GIL held 57% of the wall time, the event
loop 20% of that). This times, for the Qwen3-0.6B loop workload's batch (16 tasks x 4 samples,
40 prompt + 256 response tokens, 4,096 train tasks), each piece of per-step host work and the
way it was done before, side by side in one process:

- ``tasks``: drawing a step's tasks, the epoch's order shuffled per drawn task (before) or once
  an epoch (``Trainer.next_tasks``);
- ``records``: a step's ``trajectories.jsonl`` lines, stdlib ``json`` of ``model_dump`` with a
  Python ``round`` per token (before) or ``write_records`` (pydantic-core, numpy);
- ``responses``: encoding a step's ``/generate`` responses on the server, stdlib ``json`` (before)
  or the server's pydantic-core encoder, which the two-process loop's engine server runs;
- ``parse``: the client parsing them, stdlib ``json`` (before) or pydantic-core.

Figures are medians of ``--repeats`` rounds (milliseconds a step); the last line is JSON.

    python benchmarks/loop_host.py [--repeats 15]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch

from agentrl.fast_json import loads
from agentrl.inference.server.engine_server import _json
from agentrl.loop.health import write_records
from agentrl.loop.trainer import Trainer
from agentrl.types import Message, Task, Trajectory, TurnSpan

TASKS, GROUP, PROMPT, RESPONSE, TRAIN_TASKS = 16, 4, 40, 256, 4096


def trajectory(i: int, rng: random.Random) -> Trajectory:
    n = PROMPT + RESPONSE
    return Trajectory(
        task_id=f"t{i // GROUP}",
        env_id="bench-hash-v0",
        group_index=i % GROUP,
        messages=[
            Message(role="user", content="q" * 120),
            Message(role="assistant", content="a" * 900),
        ],
        prompt_len=PROMPT,
        tokens=[rng.randrange(151_936) for _ in range(n)],
        loss_mask=[0] * PROMPT + [1] * RESPONSE,
        logprobs=[0.0] * PROMPT + [-3 * rng.random() for _ in range(RESPONSE)],
        versions=[-1] * PROMPT + [3] * RESPONSE,
        turns=[TurnSpan(kind="assistant", start=PROMPT, end=n, reward=1.0)],
        reward=float(i % 2),
    )


def response(rng: random.Random) -> dict:
    """A ``/generate`` response of ``RESPONSE`` tokens with log-probs, as the server builds it."""
    ids = [rng.randrange(151_936) for _ in range(RESPONSE)]
    meta = {
        "id": "rid-0",
        "finish_reason": {"type": "length", "length": RESPONSE},
        "prompt_tokens": PROMPT,
        "completion_tokens": RESPONSE,
        "cached_tokens": 0,
        "weight_version": "3",
        "weight_versions": [[0, RESPONSE, "3"]],
        "e2e_latency": 1.25,
        "input_token_logprobs": [],
        "output_token_logprobs": [[-3 * rng.random(), t, None] for t in ids],
        "output_token_logprobs_length": RESPONSE,
    }
    return {"text": "x" * 4 * RESPONSE, "output_ids": ids, "meta_info": meta}


def tasks_before(state: SimpleNamespace) -> list[Task]:
    """The task draw as it was: the epoch's order shuffled again for every task drawn."""
    n, out = len(state.train_tasks), []
    for _ in range(state.config.train.tasks_per_step):
        epoch, pos = divmod(state.cursor, n)
        order = list(range(n))
        random.Random(state.config.seed * 7919 + epoch).shuffle(order)
        out.append(state.train_tasks[order[pos]])
        state.cursor += 1
    return out


def records_before(path: Path, step: int, trained: list, trainer_lp: list) -> None:
    with path.open("a", encoding="utf-8") as f:
        for (t, a), lp in zip(trained, trainer_lp, strict=True):
            rec = {
                "step": step,
                "kind": "trained",
                "advantages": [round(x, 6) for x in a.tolist()],
                "trainer_logprobs": lp,
                "trajectory": t.model_dump(mode="json"),
            }
            f.write(json.dumps(rec) + "\n")


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    a = ap.parse_args()
    rng, torch_rng = random.Random(0), torch.Generator().manual_seed(0)
    rows = TASKS * GROUP
    trajs = [trajectory(i, rng) for i in range(rows)]
    trained = [(t, torch.randn(len(t.tokens), generator=torch_rng)) for t in trajs]
    trainer_lp = [[-3 * rng.random() for _ in range(RESPONSE)] for _ in trajs]
    responses = [response(rng) for _ in range(rows)]
    bodies = [json.dumps(r).encode() for r in responses]
    assert [loads(b) for b in bodies] == [json.loads(b) for b in bodies] == responses

    def state() -> SimpleNamespace:
        config = SimpleNamespace(seed=0, train=SimpleNamespace(tasks_per_step=TASKS))
        tasks = [Task(id=str(i), prompt="p") for i in range(TRAIN_TASKS)]
        return SimpleNamespace(config=config, train_tasks=tasks, cursor=0, _order=(-1, []))

    old, new = state(), state()
    assert tasks_before(state()) == Trainer.next_tasks(state())  # type: ignore[arg-type]
    out = Path(tempfile.mkdtemp())
    pairs = {
        "tasks": (lambda: tasks_before(old), lambda: Trainer.next_tasks(new)),  # type: ignore[arg-type]
        "records": (
            lambda: records_before(out / "before.jsonl", 1, trained, trainer_lp),
            lambda: write_records(out / "after.jsonl", 1, trained, trainer_lp, []),
        ),
        "responses": (
            lambda: [json.dumps(r).encode() for r in responses],
            lambda: [_json(r).body for r in responses],
        ),
        "parse": (lambda: [json.loads(b) for b in bodies], lambda: [loads(b) for b in bodies]),
    }
    result: dict[str, object] = {"machine": f"{platform.machine()}, {platform.python_version()}"}
    print(f"per step of {rows} x ({PROMPT} + {RESPONSE}) tokens, median of {a.repeats}:")
    print(f"{'work':10s} {'before ms':>10s} {'now ms':>8s} {'ratio':>7s}")
    total = [0.0, 0.0]
    for name, (fn_old, fn_new) in pairs.items():
        t_old, t_new = median_ms(fn_old, a.repeats), median_ms(fn_new, a.repeats)
        total[0] += t_old
        total[1] += t_new
        print(f"{name:10s} {t_old:10.2f} {t_new:8.2f} {t_old / t_new:6.1f}x")
        result[f"{name}_ms"] = {"before": round(t_old, 3), "now": round(t_new, 3)}
    print(f"{'total':10s} {total[0]:10.2f} {total[1]:8.2f} {total[0] / total[1]:6.1f}x")
    a_lines = (out / "before.jsonl").read_text().splitlines()
    b_lines = (out / "after.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in a_lines] == [json.loads(x) for x in b_lines]  # same records
    result["total_ms"] = {"before": round(total[0], 3), "now": round(total[1], 3)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
