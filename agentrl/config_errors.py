"""Config errors as one line: the file and line (or the command-line item), the field, the fix.

:func:`explain` turns pydantic's first validation error into that line, with a "did you mean"
for a misspelt key, shaper name or choice; :func:`syntax_error` does the same for a TOML or YAML
syntax error. Used by :mod:`agentrl.config`; nothing here knows the config's fields.
"""

from __future__ import annotations

import difflib
import re
import tomllib
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

__all__ = ["did_you_mean", "explain", "syntax_error"]


def did_you_mean(word: str, choices: typing.Iterable[str]) -> str:
    """``"; did you mean 'lr'?"`` when a choice is close to ``word``, else ``""``."""
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def syntax_error(e: Exception) -> tuple[int, str]:
    """The 1-based line and a short message of a TOML or YAML syntax error."""
    if isinstance(e, tomllib.TOMLDecodeError):
        m = re.search(r"\(at line (\d+), column (\d+)\)", str(e))
        msg = re.sub(r"\s*\(at line \d+, column \d+\)", "", str(e))
        return (int(m.group(1)) if m else 1), f"TOML syntax error: {msg}"
    if isinstance(e, yaml.MarkedYAMLError):
        mark = e.problem_mark or e.context_mark
        line = mark.line + 1 if mark is not None else 1
        return line, f"YAML syntax error: {e.problem or e.context}"
    return 1, f"syntax error: {e}"


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation can hold (through lists, unions, ``Annotated``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    out: list[type[BaseModel]] = []
    for arg in typing.get_args(annotation):
        out += _models_in(arg)
    return out


def _model_at(root: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The model that holds the last key of ``loc`` (a discriminated union picks by tag)."""
    candidates = [root]
    for part in loc:
        if isinstance(part, int):
            continue
        by_tag = [
            m
            for m in candidates
            if "name" in m.model_fields and m.model_fields["name"].default == part
        ]
        if by_tag:  # pydantic puts a discriminated union's tag in the location
            candidates = by_tag
            continue
        model = next((m for m in candidates if part in m.model_fields), None)
        if model is None:
            return None
        candidates = _models_in(model.model_fields[part].annotation)
        if not candidates:
            return None
    return candidates[0] if len(candidates) == 1 else None


def _field_name(loc: tuple[Any, ...], root: type[BaseModel]) -> str:
    name = ""
    holders: list[type[BaseModel]] = [root]
    for part in loc:
        if isinstance(part, int):
            name += f"[{part}]"
            continue
        tagged = any(
            "name" in m.model_fields and m.model_fields["name"].default == part for m in holders
        )
        if tagged:  # the union's tag is not a key the user wrote
            holders = [m for m in holders if m.model_fields["name"].default == part]
            continue
        name += f".{part}" if name else str(part)
        holder = next((m for m in holders if part in m.model_fields), None)
        holders = _models_in(holder.model_fields[part].annotation) if holder else []
    return name


def _hint(err: Any, root: type[BaseModel]) -> str:
    loc, kind, ctx = tuple(err["loc"]), err["type"], err.get("ctx") or {}
    if kind == "extra_forbidden":
        model = _model_at(root, loc[:-1])
        return did_you_mean(loc[-1], model.model_fields) if model else ""
    if kind == "union_tag_invalid":
        return did_you_mean(
            ctx.get("tag", ""), re.findall(r"'([^']*)'", ctx.get("expected_tags", ""))
        )
    if kind in ("literal_error", "enum"):
        return did_you_mean(err.get("input", ""), re.findall(r"'([^']*)'", ctx.get("expected", "")))
    return ""


def _line_of(text: str, keys: list[str]) -> int | None:
    """The line of the deepest of ``keys`` found in order in a TOML/YAML text (best effort)."""
    lines, found, start = text.splitlines(), None, 0
    for key in keys:
        pat = re.compile(
            rf"^\s*(-\s*)?(\[+\s*([\w.-]+\.)?{re.escape(key)}\s*\]+|[\"']?{re.escape(key)}[\"']?\s*[:=])"
        )
        hit = next((i for i in range(start, len(lines)) if pat.search(lines[i])), None)
        if hit is None:
            break
        found, start = hit + 1, hit + 1
    return found


def explain(
    e: ValidationError,
    root: type[BaseModel],
    *,
    file: str | None = None,
    overrides: list[str] | None = None,
) -> str:
    """One line for the first error of ``e``: where it came from, the field, the fix.

    Args:
        e: the validation error of ``root``.
        root: the validated model (its fields resolve "did you mean").
        file: the config file the values came from, if any.
        overrides: the command-line items applied over it; the one that set the field is named.
    """
    err = e.errors()[0]
    loc = tuple(err["loc"])
    field = _field_name(loc, root)
    msg = str(err["msg"]).removeprefix("Value error, ")
    detail = msg if not field else f"{field}: {msg}"
    if err["type"] not in ("extra_forbidden", "missing") and loc:
        detail += f" (got {err.get('input')!r})"
    detail += _hint(err, root)
    # the command line wins over the file, so an item that set (part of) the field is the origin
    for item in reversed(overrides or []):
        key = item.removeprefix("--").partition("=")[0]
        if field and (field == key or field.startswith(key + ".") or field.startswith(key + "[")):
            return f"command line {item!r}: {detail}"
    if file is not None:
        keys = [p for p in field.replace("[", ".").replace("]", "").split(".") if not p.isdigit()]
        text = Path(file).read_text(encoding="utf-8") if Path(file).is_file() else ""
        line = _line_of(text, keys) if keys else None
        return f"{file}:{line}: {detail}" if line else f"{file}: {detail}"
    return detail
