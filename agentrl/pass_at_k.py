"""The unbiased pass@k estimator (Chen et al. 2021, "Evaluating LLMs Trained on Code").

With ``n`` samples of a task of which ``c`` succeeded, the chance that ``k`` of them,
drawn without replacement, hold at least one success is ``1 - C(n-c, k) / C(n, k)``. The
binomials overflow floats for large ``n``, so it is computed as the product
``1 - prod_{i=n-c+1}^{n} (1 - k/i)`` (each factor in ``[0, 1]``). Averaged over tasks, it is the
pass@k that ``agentrl eval`` and held-out evaluation during training report
(:func:`eval_metrics`: the figures both report, under the same names).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from agentrl.types import Group


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k for one task: ``n`` samples, ``c`` of them correct.

    Raises:
        ValueError: not ``0 <= c <= n`` or not ``1 <= k <= n``.
    """
    if not 0 <= c <= n:
        raise ValueError(f"c: expected 0 <= c <= n={n}, got {c}")
    if not 1 <= k <= n:
        raise ValueError(f"k: expected 1 <= k <= n={n}, got {k}")
    if n - c < k:  # every draw of k holds a success
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def mean_pass_at_k(counts: Sequence[tuple[int, int]], k: int) -> float:
    """pass@k averaged over tasks, each given as ``(n, c)`` (samples, successes).

    Raises:
        ValueError: no tasks, or a task's counts do not admit ``k`` (see :func:`pass_at_k`).
    """
    if not counts:
        raise ValueError("counts: expected at least one task, got none")
    return sum(pass_at_k(n, c, k) for n, c in counts) / len(counts)


def pass_at_ks(counts: Sequence[tuple[int, int]], ks: Iterable[int]) -> dict[str, float]:
    """``{"pass@k": mean_pass_at_k(counts, k)}`` for each ``k`` of ``ks``."""
    return {f"pass@{k}": mean_pass_at_k(counts, k) for k in ks}


def eval_metrics(
    groups: Sequence[Group], *, success_threshold: float, pass_at: bool = True
) -> dict[str, float]:
    """The held-out figures of ``groups`` (one group of n samples per task).

    An episode succeeds when its reward reaches ``success_threshold``; a failed episode is a
    sample that did not. ``pass@k`` is reported for k up to the smallest group's n, with
    ``avg@n`` (the mean over tasks of each task's mean reward), when ``pass_at`` is set.
    """
    trajs = [t for g in groups for t in g.trajectories]
    if not trajs:
        raise ValueError("groups: expected at least one episode, got none")
    n = len(trajs)
    calls = [t.tool_calls for t in trajs]
    out = {
        "success_rate": sum(t.reward >= success_threshold for t in trajs) / n,
        "reward_mean": sum(t.reward for t in trajs) / n,
        "turns_mean": sum(len(t.turn_rewards) for t in trajs) / n,
        "tool_calls_mean": sum(calls) / n,
        "tool_use_frac": sum(c > 0 for c in calls) / n,
    }
    if pass_at:
        counts = [
            (len(g.trajectories), sum(t.reward >= success_threshold for t in g.trajectories))
            for g in groups
        ]
        k_max = min(len(g.trajectories) for g in groups)
        out.update(pass_at_ks(counts, range(1, k_max + 1)))
        per_task = [sum(t.reward for t in g.trajectories) / len(g.trajectories) for g in groups]
        out[f"avg@{k_max}"] = sum(per_task) / len(per_task)
    return out
