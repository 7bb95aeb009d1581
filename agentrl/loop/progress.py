"""The progress of ``agentrl train`` on stderr: a bar on a terminal, plain lines in a log.

On a TTY the cold start and the RL loop each draw a tqdm bar. Anywhere else (a log file, a
pipe) a carriage-return bar would be one endless line, so :class:`Progress` prints one plain
line at the first and last step and whenever ``every_frac`` of the steps or ``every_s`` seconds
passed since the last line. The RL rate and ETA count from the first RL step's start (the end
of the cold start and its evaluation), so a long cold start never inflates them; the cold start
has its own steps, rate and held-out checks.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, TextIO

from tqdm import tqdm


def duration(seconds: float) -> str:
    """``"4.2s"``, ``"42s"``, ``"3m05s"`` or ``"2h07m"``."""
    if seconds < 9.95:
        return f"{max(0.0, seconds):.1f}s"
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def rate(seconds_per_step: float) -> str:
    """``"2.31 s/step"`` for slow steps, ``"4.2 steps/s"`` for fast ones."""
    if seconds_per_step >= 1 or seconds_per_step <= 0:
        return f"{seconds_per_step:.2f} s/step"
    return f"{1 / seconds_per_step:.1f} steps/s"


def warning_text(warnings: Mapping[str, int]) -> str:
    """``"no_learning_signal x3"``: each warning kind raised so far, with its count."""
    return ", ".join(f"{kind} x{n}" for kind, n in sorted(warnings.items()) if n)


class _Phase:
    """Steps of one phase (cold start or RL): its clock, rate and when a plain line is due."""

    def __init__(self, total: int, first: int, every_s: float, every_frac: float) -> None:
        self.total, self.first = total, first
        self.t0 = self.last_t = time.perf_counter()
        self.last_step: int | None = None
        self.every_s = every_s
        self.every_steps = max(1, round(every_frac * total))

    def due(self, step: int) -> bool:
        now = time.perf_counter()
        due = (
            self.last_step is None
            or step >= self.total
            or step - self.last_step >= self.every_steps
            or now - self.last_t >= self.every_s
        )
        if due:
            self.last_step, self.last_t = step, now
        return due

    def pace(self, step: int) -> str:
        done = step - self.first
        if done <= 0:
            return ""
        per_step = (time.perf_counter() - self.t0) / done
        return f", {rate(per_step)}, ETA {duration(per_step * max(0, self.total - step))}"


class Progress:
    """The ``on_step`` of :class:`~agentrl.loop.trainer.Trainer` for the CLI (module docstring).

    Args:
        name: the run's name (the bar's label, each plain line's prefix).
        total: RL steps of the run (``train.steps``).
        stream: where progress goes (stderr).
        out: where lines of their own go (stdout: the run directory, the cold start's held-out
            checks, evaluations), above the bar on a TTY.
        tty: draw bars; ``None``: whether ``stream`` is a terminal.
        warnings: the run's warning counts so far (``RunHealth.warnings``), shown in step lines.
        every_s: a plain line at least this often (seconds) ...
        every_frac: ... and at least every this fraction of a phase's steps.
    """

    def __init__(
        self,
        name: str,
        total: int,
        *,
        stream: TextIO | None = None,
        out: TextIO | None = None,
        tty: bool | None = None,
        warnings: Callable[[], Mapping[str, int]] = dict,
        every_s: float = 30.0,
        every_frac: float = 0.1,
    ) -> None:
        self.name, self.total = name, total
        self.stream = stream if stream is not None else sys.stderr
        self.out = out if out is not None else sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self.warnings = warnings
        self.every_s, self.every_frac = every_s, every_frac
        self._bar: Any = None  # the phase's tqdm bar on a TTY
        self._cold: _Phase | None = None
        self._rl: _Phase | None = None
        self._rl_start: tuple[float, int] | None = None  # (clock, step) where RL begins
        self._unshown: Mapping[str, float] | None = None  # a phase's last step, not yet shown

    def write(self, line: str) -> None:
        """A line of its own (on ``out``), above the bar on a TTY."""
        if self._bar is not None:
            self._bar.write(line, file=self.out)
        else:
            print(line, file=self.out, flush=True)

    def _line(self, line: str) -> None:
        print(line, file=self.stream, flush=True)

    def close(self) -> None:
        """Close the bar of the phase in flight (a TTY)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _open_bar(self, desc: str, total: int, initial: int = 0) -> None:
        self.close()
        self._bar = tqdm(
            total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True,
            file=self.stream,
        )  # fmt: skip

    def __call__(self, m: Mapping[str, float]) -> None:
        """Show one record of ``metrics.jsonl`` (or a cold start step)."""
        if "rollout/reward_mean" in m:
            self._rl_step(m)
        elif "sft/step" in m:
            self._cold_step(m)
        elif "eval/success_rate" in m:
            self._flush()  # a phase that stopped early (target, budget) shows its last step
            if "cold_start_s" in m:  # the evaluation at RL start: RL's clock starts now
                self.close()
                self._rl_start = (time.perf_counter(), int(m["step"]))
                line = f"held-out success at RL start {m['eval/success_rate']:.3f}"
                if self._cold is not None:
                    line += f" (cold start {duration(m['cold_start_s'])})"
                self.write(line)
            else:  # every eval_every steps, and at the end
                self.write(f"step {int(m['step'])}: held-out success {m['eval/success_rate']:.3f}")
        elif "sft/demonstrations" in m:
            self.write(
                f"cold start on {int(m['sft/demonstrations'])} demonstrations: "
                f"{m['sft/assistant_turns_mean']:.1f} assistant turns, "
                f"{m['sft/tokens_mean']:.0f} tokens each"
            )

    def _flush(self) -> None:
        m, self._unshown = self._unshown, None
        if m is not None and not self.tty:
            phase = self._rl if "rollout/reward_mean" in m else self._cold
            if phase is not None:
                phase.last_step = None  # due
            self({k: v for k, v in m.items() if k != "sft/held_out_success"})  # said already

    def _cold_step(self, m: Mapping[str, float]) -> None:
        step, steps = int(m["sft/step"]), int(m["sft/steps"])
        if self._cold is None:
            self._cold = _Phase(steps, step, self.every_s, self.every_frac)  # paced from here
            if self.tty:
                self._open_bar("cold start", steps)
        check = m.get("sft/held_out_success")
        if check is not None:
            self.write(
                f"cold start step {step}: loss {m['sft/loss']:.3f}, held-out success {check:.3f}"
            )
        if self.tty:
            self._bar.update(step - self._bar.n)
            self._bar.set_postfix({"loss": f"{m['sft/loss']:.3f}"})
            return
        self._unshown = m
        if self._cold.due(step):
            self._unshown = None
            line = f"cold start {step}/{steps} ({step / max(1, steps):.0%}): "
            self._line(line + f"loss {m['sft/loss']:.3f}" + self._cold.pace(step))

    def _rl_step(self, m: Mapping[str, float]) -> None:
        step = int(m["step"])
        if self._rl is None:
            t0, first = self._rl_start or (time.perf_counter(), step - 1)
            self._rl = _Phase(self.total, first, self.every_s, self.every_frac)
            self._rl.t0 = t0
            if self.tty:
                self._open_bar(self.name, self.total, initial=first)
        warned = warning_text(self.warnings())
        if self.tty:
            self._bar.update(step - self._bar.n)
            post = {"reward": f"{m['rollout/reward_mean']:.3f}"}
            if "eval/success_rate" in m:
                post["held-out"] = f"{m['eval/success_rate']:.3f}"
            if warned:
                post["warnings"] = warned
            self._bar.set_postfix(post)
            return
        self._unshown = m
        if not self._rl.due(step) and "eval/success_rate" not in m:
            return
        self._unshown = None
        line = f"{self.name} step {step}/{self.total}: reward {m['rollout/reward_mean']:.3f}"
        if "eval/success_rate" in m:
            line += f", held-out success {m['eval/success_rate']:.3f}"
        if failed := m.get("rollout/failed"):
            line += f", {int(failed)} failed"
        line += self._rl.pace(step)
        if warned:
            line += f"; warnings: {warned}"
        self._line(line)
