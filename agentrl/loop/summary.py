"""The end of a run: ``summary.json`` (written atomically) and the plots.

Beside the held-out success it holds the run's warning counts (``warnings``, by kind) and its
failed training episodes (``failures``: ``episodes``, ``failed``, ``by_cause``, ``first_error``),
from :class:`~agentrl.loop.health.RunHealth`.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from agentrl.loop.atomic import replace_file

log = logging.getLogger("agentrl.loop.trainer")


def summarise(
    trainer: Any, start: dict[str, float], end: dict[str, float], t_start: float, t_rl: float
) -> dict[str, Any]:
    """The run's summary from its first and last evaluations; rank 0 writes it and plots.

    Args:
        trainer: the :class:`~agentrl.loop.trainer.Trainer` that ran.
        start: the evaluation at RL start (with ``cold_start_s``).
        end: the final evaluation.
        t_start: ``time.perf_counter()`` at the run's start.
        t_rl: ``time.perf_counter()`` at the RL loop's start.
    """
    summary = {
        "success_start": start["eval/success_rate"],
        "success_end": end["eval/success_rate"],
        "steps": trainer.step,
        "wall_s": time.perf_counter() - t_start,
        "rl_wall_s": time.perf_counter() - t_rl,
        "cold_start_s": start.get("cold_start_s", 0.0),
        **{k: end[f"eval/{k}"] for k in ("turns_mean", "tool_calls_mean", "tool_use_frac")},
        "env": trainer.config.env.id,
        "loss": trainer.learner.config.loss,
        "run_dir": str(trainer.run_dir),
        "warnings": dict(trainer.health.warnings),
        "failures": trainer.health.failures(),
    }
    if not trainer.ranks.is_main:
        return summary
    replace_file(trainer.run_dir / "summary.json", json.dumps(summary, indent=2))
    try:
        from agentrl.report.plots import plot_run

        plot_run(trainer.run_dir)
    except Exception:  # a plot must never lose a finished run
        log.warning("plotting failed", exc_info=True)
    return summary
