"""GSPO-token vs GRPO vs GRPO + Routing Replay on a Mixture-of-Experts model, several seeds.

    python benchmarks/moe_gspo_vs_grpo.py --seeds 0 1 2 --steps 16        # tiny MoE on CPU
    python benchmarks/moe_gspo_vs_grpo.py --model qwen3-30b-a3b-shape --layers 4 --device cuda

The GSPO paper (arXiv:2507.18071, section 5.3) says that on MoE models about a tenth of the
experts a token activates change after a GRPO update, that token-level ratios swing with them,
and that GRPO converges only with *Routing Replay* while GSPO needs none. This runs that
comparison at a size that fits here: per seed, one supervised cold start on two-digit addition
(``arith-v0``), exported, then three RL arms from the same weights with the same tasks, batch,
mini-batches and steps, through the public :class:`~agentrl.loop.Trainer` API:

* ``gspo_token``: ``learner.loss = "gspo_token"`` (eps 3e-4 / 4e-4);
* ``grpo``: ``learner.loss = "grpo"`` (eps 0.2 / 0.28);
* ``grpo_replay``: GRPO with ``learner.routing_replay = true``.

Reported per arm (means over seeds): held-out success per evaluation, the learner's routing
metrics per update (``routing/expert_volatility`` overall and per layer, ratio variances of the
update, engine vs learner agreement when the engine records routing), the clipped-token fraction,
and collapse: a seed whose last held-out success is below both its RL start and its peak by more
than ``--collapse-drop``.

Routing records: the replay arm needs the experts of the policy that sampled each token. When the
engine returns them (``Trajectory.routed_experts``) they are used; otherwise each sample's
routing is recorded with one forward of the learner's model before the update (the synchronous
loop: those are the weights that sampled; in float32 on the same weights that is what the engine
computes) and ``engine_learner_expert_agreement`` is reported as ``null``.

``--model qwen3-30b-a3b-shape --layers N`` builds the policy from
:data:`agentrl.tiny.QWEN3_30B_A3B_SHAPE` with ``N`` layers (128 experts, 8 per token; the tiny
tokenizer's vocabulary) for a GPU run; ``--set key=value`` passes any config override.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
import json
import math
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ARMS = {
    "gspo_token": {"loss": "gspo_token"},
    "grpo": {"loss": "grpo"},
    "grpo_replay": {"loss": "grpo", "routing_replay": True},
}

BASE: dict[str, Any] = {
    "env": {"id": "arith-v0", "task_kwargs": {"digits": 2}, "num_train_tasks": 4096,
            "num_eval_tasks": 64},
    "rollout": {"group_size": 8, "max_turns": 1, "max_new_tokens": 6, "max_total_tokens": 64,
                "temperature": 1.0},
    "cold_start": {"steps": 800, "lr": 2e-3, "batch_size": 64, "target_success": 0.3,
                   "check_every": 50},
    "learner": {"lr": 1e-4, "num_minibatches": 4, "micro_batch_tokens": 1024},
    "train": {"steps": 16, "tasks_per_step": 16, "eval_every": 4, "max_staleness": 0,
              "checkpoint_every": 0, "max_wall_s": None},
}  # fmt: skip


def model_section(name: str, layers: int | None) -> dict[str, Any]:
    """The ``[model]`` section for ``--model``."""
    from agentrl.tiny import QWEN3_30B_A3B_SHAPE

    if name == "tiny-moe":
        return {"path": "tiny-moe", "tiny": {"num_hidden_layers": layers or 3}}
    if name == "qwen3-30b-a3b-shape":
        shape = {k: v for k, v in QWEN3_30B_A3B_SHAPE.items() if k != "vocab_size"}
        shape["num_hidden_layers"] = layers or 4
        return {"path": "tiny-moe", "tiny": shape}
    raise SystemExit(f"--model: expected tiny-moe or qwen3-30b-a3b-shape, got {name!r}")


def with_routing(learner: Any) -> dict[str, int]:
    """Make ``learner.step`` fill missing routing records from a pre-update forward."""
    import torch

    from agentrl.routing import RoutingCapture

    counts = {"engine": 0, "learner_forward": 0}
    step = learner.step

    def recording_step(samples: Any) -> dict[str, float]:
        out = []
        for s in samples:
            if s.routed_experts is not None:
                counts["engine"] += 1
                out.append(s)
                continue
            ids = torch.tensor([s.tokens[:-1]], device=learner.device)
            with torch.no_grad(), RoutingCapture(learner.model) as cap:
                learner.model(input_ids=ids, use_cache=False)
            counts["learner_forward"] += 1
            out.append(dataclasses.replace(s, routed_experts=cap.pop().numpy()))
        return step(out)

    learner.step = recording_step
    return counts


def load(tree: dict[str, Any], sets: list[str]) -> Any:
    from agentrl.config import load_config

    return load_config(tree, sets)


def cold_start(tree: dict[str, Any], sets: list[str], out: Path) -> dict[str, float]:
    """Run the shared cold start and export the policy to ``out`` (an HF directory)."""
    from agentrl.loop.trainer import Trainer

    async def go() -> dict[str, float]:
        trainer = Trainer(load(tree, sets))
        try:
            await trainer.sync_weights()
            t0 = time.perf_counter()
            stats = await trainer.cold_start()
            start = await trainer.evaluate()
            trainer.learner.save_pretrained(out, tokenizer=trainer.tokenizer)
            return {**stats, **start, "cold_start_s": time.perf_counter() - t0}
        finally:
            await trainer.client.aclose()

    return asyncio.run(go())


def arm_run(arm: str, tree: dict[str, Any], sets: list[str]) -> dict[str, Any]:
    """One RL arm from the exported cold start; its per-step records."""
    from agentrl.loop.trainer import Trainer

    trainer = Trainer(load(tree, sets))
    counts = with_routing(trainer.learner) if trainer.config.learner.routing_replay else None
    t0 = time.perf_counter()
    summary = asyncio.run(trainer.run())
    lines = (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(x) for x in lines]
    return {
        "arm": arm,
        "summary": summary,
        "wall_s": time.perf_counter() - t0,
        "eval": {r["step"]: r["eval/success_rate"] for r in records if "eval/success_rate" in r},
        "updates": [r for r in records if "loss/policy" in r],
        "routing_source": counts,
    }


def arm_progress(run: dict[str, Any]) -> None:
    """One arm's updates as they were logged: volatility overall and per layer, clipping."""
    for u in run["updates"]:
        layers = sorted(k for k in u if k.startswith("routing/expert_volatility/layer_"))
        layers.sort(key=lambda k: int(k.rsplit("_", 1)[1]))
        per = " ".join(fmt(u[k], 6, 4) for k in layers)
        print(f"    step {u['step']}: vol {fmt(u.get('routing/expert_volatility'), 6, 4)} "
              f"per layer [{per}] clip {fmt(u.get('loss/clip_frac_tokens'), 6, 4)}",
              file=sys.stderr)  # fmt: skip
    print(f"    held-out by step: {run['eval']}", file=sys.stderr, flush=True)


def free_device() -> None:
    """Drop the finished arm's model, optimizer and engine before the next one starts."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def collapsed(evals: dict[int, float], drop: float) -> bool:
    """Success fell and did not recover: the last value is ``drop`` below start and peak."""
    values = [evals[k] for k in sorted(evals)]
    start, peak, end = values[0], max(values), values[-1]
    return end < start - drop and end < peak - drop


def mean(values: list[float]) -> float | None:
    clean = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.fmean(clean) if clean else None


def fmt(v: float | None, width: int = 8, digits: int = 3) -> str:
    return f"{'-':>{width}}" if v is None else f"{v:>{width}.{digits}f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--model", default="tiny-moe")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--collapse-drop", type=float, default=0.1)
    ap.add_argument("--set", dest="sets", action="append", default=[], help="key=value override")
    ap.add_argument("--out", default=None, help="JSON of the runs so far, rewritten per arm")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    base = copy.deepcopy(BASE)
    base["model"] = {**model_section(args.model, args.layers), "device": args.device}
    base["train"]["steps"] = args.steps
    runs: list[dict[str, Any]] = []
    starts: dict[int, dict[str, float]] = {}
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            policy = Path(tmp) / f"cold-s{seed}"
            tree = {**copy.deepcopy(base), "seed": seed, "name": f"cold-s{seed}", "out_dir": tmp}
            starts[seed] = cold_start(tree, args.sets, policy)
            print(f"seed {seed}: cold start {starts[seed]['cold_start_s']:.0f} s, held-out "
                  f"success {starts[seed]['eval/success_rate']:.3f}", file=sys.stderr)  # fmt: skip
            for arm in args.arms:
                t = copy.deepcopy(base)
                t.update(seed=seed, name=f"{arm}-s{seed}", run_dir=str(Path(tmp) / f"{arm}-{seed}"))
                t["model"]["path"] = str(policy)
                t["model"].pop("tiny")
                t["cold_start"] = {"steps": 0}
                t["learner"].update(ARMS[arm])
                run = arm_run(arm, t, [*args.sets, "cold_start.steps=0"])  # shared, done
                run["seed"] = seed
                runs.append(run)
                print(f"  {arm}: {run['wall_s']:.0f} s, success "
                      f"{run['summary']['success_start']:.3f} -> "
                      f"{run['summary']['success_end']:.3f}", file=sys.stderr)  # fmt: skip
                arm_progress(run)
                # its metrics are read: drop its end-of-run checkpoint (float32 weights and AdamW
                # states, 37 GB on the 30B-A3B shape with 4 layers) before the next arm writes one
                shutil.rmtree(t["run_dir"], ignore_errors=True)
                if args.out:  # what is measured so far survives a run cut short
                    Path(args.out).write_text(json.dumps({"starts": starts, "runs": runs}))
                free_device()
    report(args, runs, starts, time.perf_counter() - t_all)


def report(
    args: argparse.Namespace,
    runs: list[dict[str, Any]],
    starts: dict[int, dict[str, float]],
    wall_s: float,
) -> None:
    """Print the tables and the last-line JSON."""
    arms = args.arms
    eval_steps = sorted({k for r in runs for k in r["eval"]})
    print(f"held-out success (mean over seeds {args.seeds}) per step")
    print(f"{'step':>5} " + " ".join(f"{a:>12}" for a in arms))
    for st in eval_steps:
        cells = [mean([r["eval"].get(st) for r in runs if r["arm"] == a]) for a in arms]
        print(f"{st:>5} " + " ".join(fmt(c, 12) for c in cells))

    layers = sorted(
        {int(k.rsplit("_", 1)[1]) for r in runs for u in r["updates"] for k in u
         if k.startswith("routing/expert_volatility/layer_")}
    )  # fmt: skip
    by_arm: dict[str, dict[str, Any]] = {}
    for a in arms:
        mine = [r for r in runs if r["arm"] == a]
        ups = [u for r in mine for u in r["updates"]]

        def m(key: str, ups: list[dict[str, Any]] = ups) -> float | None:
            return mean([u.get(key) for u in ups])

        by_arm[a] = {
            "success_start": mean([r["summary"]["success_start"] for r in mine]),
            "success_end": mean([r["summary"]["success_end"] for r in mine]),
            "success_end_by_seed": [r["summary"]["success_end"] for r in mine],
            "collapsed_seeds": sum(collapsed(r["eval"], args.collapse_drop) for r in mine),
            "expert_volatility": m("routing/expert_volatility"),
            "expert_volatility_per_layer": [
                m(f"routing/expert_volatility/layer_{i}") for i in layers
            ],
            "clip_frac_tokens": m("loss/clip_frac_tokens"),
            "token_ratio_var": m("routing/token_ratio_var"),
            "seq_ratio_var": m("routing/seq_ratio_var"),
            "changed_token_frac": m("routing/changed_token_frac"),
            "ratio_var_changed": m("routing/ratio_var_changed"),
            "ratio_var_unchanged": m("routing/ratio_var_unchanged"),
            "engine_learner_expert_agreement": None
            if any((r["routing_source"] or {}).get("learner_forward") for r in mine)
            else m("routing/engine_learner_expert_agreement"),  # learner vs itself otherwise
        }
        steps = sorted({u["step"] for u in ups})
        print(f"\n{a}: per update (mean over seeds)")
        head = " ".join(f"{'vol L' + str(i):>8}" for i in layers)
        print(f"{'step':>5} {'vol':>8} {head} {'clip':>8} {'tok var':>9} {'seq var':>9}")
        for st in steps:
            at = [u for u in ups if u["step"] == st]
            per = " ".join(fmt(m(f"routing/expert_volatility/layer_{i}", at)) for i in layers)
            print(f"{st:>5} {fmt(m('routing/expert_volatility', at))} {per} "
                  f"{fmt(m('loss/clip_frac_tokens', at), 8, 4)} "
                  f"{fmt(m('routing/token_ratio_var', at), 9, 5)} "
                  f"{fmt(m('routing/seq_ratio_var', at), 9, 5)}")  # fmt: skip

    print("\nsummary per arm")
    print(f"{'arm':>12} {'start':>7} {'end':>7} {'collapsed':>9} {'vol':>7} {'clip':>7} "
          f"{'tok var':>9} {'seq var':>9}")  # fmt: skip
    for a in arms:
        b = by_arm[a]
        print(f"{a:>12} {fmt(b['success_start'], 7)} {fmt(b['success_end'], 7)} "
              f"{b['collapsed_seeds']:>5}/{len(args.seeds)} {fmt(b['expert_volatility'], 7)} "
              f"{fmt(b['clip_frac_tokens'], 7, 4)} {fmt(b['token_ratio_var'], 9, 5)} "
              f"{fmt(b['seq_ratio_var'], 9, 5)}")  # fmt: skip

    engine_recorded = any((r["routing_source"] or {}).get("engine") for r in runs) or any(
        "routing/engine_learner_expert_agreement" in u
        for r in runs
        if r["routing_source"] is None
        for u in r["updates"]
    )
    all_ups = [u for r in runs for u in r["updates"]]
    agreement = mean([by_arm[a]["engine_learner_expert_agreement"] for a in arms])
    out: dict[str, Any] = {
        "benchmark": "moe_gspo_vs_grpo",
        "gspo_success_end": by_arm.get("gspo_token", {}).get("success_end"),
        "grpo_success_end": by_arm.get("grpo", {}).get("success_end"),
        "grpo_replay_success_end": by_arm.get("grpo_replay", {}).get("success_end"),
        "expert_volatility": mean([u.get("routing/expert_volatility") for u in all_ups]),
        "expert_volatility_per_layer": [
            mean([u.get(f"routing/expert_volatility/layer_{i}") for u in all_ups]) for i in layers
        ],
        "engine_learner_expert_agreement": agreement if engine_recorded else None,
        "token_ratio_var": mean([u.get("routing/token_ratio_var") for u in all_ups]),
        "seq_ratio_var": mean([u.get("routing/seq_ratio_var") for u in all_ups]),
        "by_arm": by_arm,
        "cold_start_success": mean([s["eval/success_rate"] for s in starts.values()]),
        "routing_records": "engine" if engine_recorded else "learner_forward",
        "model": args.model,
        "layers": len(layers),
        "seeds": args.seeds,
        "steps": args.steps,
        "wall_s": wall_s,
        "machine": machine(args.device),
    }
    print(json.dumps(out))


def machine(device: str) -> str:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} ({platform.node()})"
    from harness import cpu_model  # (lazily: harness imports torch)

    cpu = cpu_model()
    return f"CPU {cpu}, {torch.get_num_threads()} torch threads"


if __name__ == "__main__":
    main()
