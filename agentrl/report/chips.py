"""The run's facts at the top of the report: ``summary.json`` as readable names with units.

Known keys get a name and a format (:data:`_KNOWN`, in the order shown); a key this module does
not know yet (a newer trainer's) is still shown, its name made readable from the key (``_`` as
spaces; ``_s`` a duration, ``_frac``/``_rate`` a percentage). Each chip keeps its key for the
tooltip, so the raw name can be looked up in ``summary.json``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_MAX_TEXT = 80
"""Longest value text shown in a chip (run data: anything longer is cut)."""


def duration(s: float) -> str:
    """Seconds as ``14.6 s``, ``3 min 05 s`` or ``2 h 07 min``."""
    if s < 60:
        return f"{s:.1f} s"
    whole = round(s)
    if whole < 3600:
        return f"{whole // 60} min {whole % 60:02d} s"
    return f"{whole // 3600} h {whole % 3600 // 60:02d} min"


def _percent(v: float) -> str:
    return f"{100 * v:.1f}%"


def _number(v: float) -> str:
    return str(v) if isinstance(v, int) else f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"


def _two(v: float) -> str:
    return f"{v:.2f}"


def _counts(v: dict[str, Any]) -> str:
    """``{"no_learning_signal": 28}`` as ``no learning signal 28`` (``none`` when empty)."""
    return ", ".join(f"{readable_key(str(k))} {x}" for k, x in v.items()) or "none"


def _failures(v: dict[str, Any]) -> str:
    """The trainer's failure record as ``3 of 5120 (env 2, timeout 1); first: ...``."""
    text = f"{v['failed']} of {v['episodes']}"
    if v.get("by_cause"):
        text += f" ({_counts(v['by_cause'])})"
    if v.get("first_error"):
        text += f"; first: {v['first_error']}"
    return text


_KNOWN: dict[str, tuple[str, Callable[[Any], str]]] = {
    "success_start": ("held-out success at RL start", _percent),
    "success_end": ("held-out success at end", _percent),
    "steps": ("RL steps", _number),
    "wall_s": ("wall time", duration),
    "cold_start_s": ("cold start", duration),
    "rl_wall_s": ("RL time", duration),
    "turns_mean": ("turns per episode at end", _two),
    "tool_calls_mean": ("tool calls per episode at end", _two),
    "tool_use_frac": ("episodes that used the tool", _percent),
    "env": ("env", str),
    "loss": ("loss", str),
    "failures": ("failed episodes", _failures),
    "warnings": ("warnings", _counts),
}
_SKIP = {"run_dir"}  # the page's subtitle shows it


def readable_key(key: str) -> str:
    """A summary key as words: ``failed_episodes`` -> ``failed episodes`` (units dropped)."""
    for suffix in ("_s", "_frac", "_rate"):
        if key.endswith(suffix) and len(key) > len(suffix):
            key = key.removesuffix(suffix) + ("" if suffix == "_s" else " fraction")
            break
    if key.endswith("_mean"):
        key = "mean " + key.removesuffix("_mean")
    return key.replace("_", " ").replace("/", " ").strip()


def _value(key: str, v: Any) -> str | None:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int | float):
        if key.endswith("_s"):
            return duration(float(v))
        if key.endswith(("_frac", "_rate")):
            return _percent(float(v))
        return _number(v)
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and all(isinstance(x, int | float | str) for x in v.values()):
        return ", ".join(f"{readable_key(str(k))} {_value(str(k), x)}" for k, x in v.items())
    return None  # a list or nested object: the config and summary.json have it


def summary_chips(summary: dict[str, Any] | None) -> list[dict[str, str]]:
    """``{"label", "value", "key"}`` for each fact of a run's summary worth a chip."""
    if not summary:
        return []
    chips = []
    order = [k for k in _KNOWN if k in summary] + [
        k for k in summary if k not in _KNOWN and k not in _SKIP
    ]
    for key in order:
        v = summary[key]
        label, text = readable_key(key), None
        if key in _KNOWN:
            label, fmt = _KNOWN[key]
            try:
                text = fmt(v)
            except (TypeError, ValueError, KeyError, AttributeError):  # a newer shape
                pass
        if text is None:
            text = _value(key, v)
        if not text:
            continue
        if len(text) > _MAX_TEXT:
            text = text[: _MAX_TEXT - 1] + "…"
        chips.append({"label": label, "value": text, "key": key})
    return chips
