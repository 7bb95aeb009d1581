"""``loop_gpu.py``'s command line (its module docstring says what each option measures)."""

from __future__ import annotations

import argparse


def parse_args(description: str, workloads: list[str]) -> argparse.Namespace:
    """The options of ``loop_gpu.py``; several values of one option run side by side."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--workloads", nargs="+", default=workloads, choices=workloads)
    ap.add_argument("--steps", type=int, default=12, help="agentrl's timed steps")
    ap.add_argument("--trl-steps", type=int, default=3, help="TRL's timed steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--response-tokens", type=int, default=256, help="qwen3-0.6b responses")
    ap.add_argument("--no-trl", action="store_true")
    ap.add_argument("--max-staleness", type=int, default=1, help="0: generate, then update")
    ap.add_argument("--tasks", type=int, help="tasks per step (both sides; default: workload's)")
    ap.add_argument("--engine-rows", type=int, help="rows decoded together (default: all started)")
    ap.add_argument("--count-syncs", action="store_true", help="syncs by call site (agentrl)")
    ap.add_argument("--stream-gaps", action="store_true",
                    help="streams' idle time: launched late (host) or waiting (card)")  # fmt: skip
    ap.add_argument("--switch-interval-ms", type=float, nargs="+", default=[None],
                    help="train.gil_switch_interval_ms; several values: agentrl's loop once each, "
                         "side by side (the last one is the headline)")  # fmt: skip
    ap.add_argument("--interrupt-mode", nargs="+", default=["abort"],
                    choices=["abort", "retract", "in_place"],
                    help="rollout.interrupt_mode: how a push interrupts the turns in flight; "
                         "several: side by side")  # fmt: skip
    ap.add_argument("--inflight-groups", type=int, nargs="+", default=[None],
                    help="train.max_inflight_groups (default: all the staleness bound admits, "
                         "(max_staleness + 1) x tasks); several: side by side")  # fmt: skip
    ap.add_argument("--decode-steps", type=int, nargs="+", default=[None],
                    help="inference.decode_steps: the engine's decode steps between host visits "
                         "(default: the setting's); several: side by side")  # fmt: skip
    ap.add_argument("--resume-settle-ms", type=float, nargs="+", default=[None],
                    help="the in-process engine's wait for re-sent requests after a resume "
                         "(RESUME_SETTLE_MAX_S, 50 ms; 0: none); several: side by side"
                    )  # fmt: skip
    ap.add_argument("--micro-batch-tokens", type=int, nargs="+", default=[32768],
                    help="learner.micro_batch_tokens (2 micro-batches of the 0.6B step at 16,384, "
                         "1 at 32,768: half the launches); several: side by side")  # fmt: skip
    ap.add_argument(
        "--stacks",
        action="store_true",
        help="sample the threads' stacks; print where they were in the card's gaps",
    )
    ap.add_argument("--prefill-graphs", nargs="+", default=["on"], choices=["on", "off"],
                    help="the engine's prefills as CUDA graphs; several: side by side")  # fmt: skip
    ap.add_argument(
        "--gc-sites",
        action="store_true",
        help="count where young collections begin, by thread and frames ([gc])",
    )
    ap.add_argument("--deliver-at-launch", nargs="+", default=["on"], choices=["on", "off"],
                    help="the in-process engine hands a step's finished requests their results "
                         "once the next step is launched (on) or at once (off, as before); "
                         "several: side by side")  # fmt: skip
    ap.add_argument("--engine", nargs="+", default=["thread"], choices=["thread", "process"],
                    help="agentrl's engine in the trainer's process (thread) or in an 'agentrl "
                         "serve' process on the card (process); several: side by side, the last "
                         "one is the headline")  # fmt: skip
    return ap.parse_args()
