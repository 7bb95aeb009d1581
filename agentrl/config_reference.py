"""The config reference and CLI flags, generated from the pydantic models (one source of truth).

:func:`reference` lists every field of :class:`~agentrl.config.TrainConfig` (type, default,
docstring) as Markdown (``docs/config.md``) or as text (``agentrl train --help``);
``python -m agentrl.config_reference > docs/config.md`` regenerates the file, and a test checks
that it is up to date. :func:`add_flags` declares a section's fields as ``--field-name`` flags
(``agentrl rollout --group-size 4``), with the model's defaults and docstrings, that become the
same ``--section.key=value`` overrides every command takes (:func:`flag_overrides`).
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
import types
import typing
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from agentrl.config import TrainConfig
from agentrl.learner.advantages import SHAPERS

__all__ = ["add_flags", "flag_overrides", "reference"]

_DEST = "config:"  # argparse dest prefix of generated flags: "config:rollout.group_size"


def _type(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type(a) for a in args)
    if origin is typing.Annotated:
        return _type(args[0])
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(_type(a) for a in args)}]" if args else name
    if annotation is type(None):
        return "None"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        tag = annotation.model_fields.get("name")
        if tag is not None and isinstance(tag.default, str):
            return f"shaper {tag.default}"
    return getattr(annotation, "__name__", str(annotation))


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "(required)"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    return json.dumps(value)


def _doc(field: FieldInfo) -> str:
    return " ".join((field.description or "").split())


def _is_section(field: FieldInfo) -> bool:
    ann = field.annotation
    return isinstance(ann, type) and issubclass(ann, BaseModel)


def _optional_section(field: FieldInfo) -> type[BaseModel] | None:
    """The model of a ``Model | None`` field (a sub-section that is off when absent)."""
    args = typing.get_args(field.annotation)
    models = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
    return models[0] if len(models) == 1 and type(None) in args else None


def _sections() -> list[tuple[str, type[BaseModel], str, str]]:
    """(prefix, model, title, note) of the top level, sections, sub-sections, shapers.

    A sub-section is a section's optional model field (``learner.lora``).
    """
    out: list[tuple[str, type[BaseModel], str, str]] = [("", TrainConfig, "Top level", "")]
    for name, field in TrainConfig.model_fields.items():
        if _is_section(field):
            model = typing.cast(type[BaseModel], field.annotation)
            out.append((name, model, f"[{name}]", _doc(field)))
            for sub, sub_field in model.model_fields.items():
                if (inner := _optional_section(sub_field)) is not None:
                    out.append((f"{name}.{sub}", inner, f"[{name}.{sub}]", _doc(sub_field)))
    for tag, shaper in SHAPERS.items():
        out.append((f"advantages.shapers[name={tag}]", shaper, f'shaper "{tag}"', ""))
    return out


def _fields(model: type[BaseModel], top: bool) -> Iterable[tuple[str, FieldInfo]]:
    for name, field in model.model_fields.items():
        if not (top and _is_section(field)):
            yield name, field


def _summary(model: type[BaseModel]) -> str:
    return " ".join((model.__doc__ or "").split("\n\n")[0].split())


def reference(fmt: Literal["markdown", "text"] = "markdown") -> str:
    """Every config field with its type, default and docstring.

    Args:
        fmt: ``markdown`` (``docs/config.md``) or ``text`` (terminal help).
    """
    lines: list[str] = []
    if fmt == "markdown":
        lines += [
            "# Configuration reference",
            "",
            "Generated from the pydantic models by `python -m agentrl.config_reference > "
            "docs/config.md`",
            "(a test checks it is up to date). Set a field in the TOML/YAML config under its",
            "`[section]`, or on the command line of any command as `--section.key=value`",
            "(`agentrl train`, `agentrl rollout`, `recipes/*.py`). Unknown keys are errors.",
        ]
    for prefix, model, title, note in _sections():
        top = model is TrainConfig
        summary = note or _summary(model)
        if fmt == "markdown":
            lines += ["", f"## {title}", "", summary.replace("``", "`"), ""]
            lines += ["| field | type | default | description |", "| --- | --- | --- | --- |"]
        else:
            lines += ["", f"{title}  {summary}"]
        for name, field in _fields(model, top):
            if prefix.startswith("advantages.shapers"):
                key = f"{name}"
            else:
                key = f"{prefix}.{name}" if prefix else name
            typ, default, doc = _type(field.annotation), _default(field), _doc(field)
            if prefix.startswith("advantages.shapers") and name == "name":
                doc = doc or "Selects this shaper."
            if fmt == "markdown":
                cells = [f"`{key}`", f"`{typ}`", f"`{default}`", doc.replace("``", "`")]
                lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
            else:
                lines.append(f"  {key} : {typ} = {default}")
                if doc:
                    lines += textwrap.wrap(
                        doc, 96, initial_indent=" " * 6, subsequent_indent=" " * 6
                    )
    return "\n".join(lines).strip("\n") + "\n"


def add_flags(
    parser: argparse.ArgumentParser, section: str, names: Iterable[str] | None = None
) -> None:
    """Declare fields of ``TrainConfig.<section>`` as ``--field-name VALUE`` flags.

    A flag already declared on ``parser`` (by hand) is left alone. A given flag becomes the
    override ``--section.field=VALUE`` (:func:`flag_overrides`), validated with the whole config;
    an absent one keeps the model's default, which its help shows.
    """
    model = typing.cast(type[BaseModel], TrainConfig.model_fields[section].annotation)
    for name in names if names is not None else model.model_fields:
        field = model.model_fields[name]
        flag = "--" + name.replace("_", "-")
        if flag in parser._option_string_actions:
            continue
        help_text = (_doc(field) + f" (--{section}.{name}; default {_default(field)})").strip()
        parser.add_argument(
            flag,
            dest=f"{_DEST}{section}.{name}",
            default=argparse.SUPPRESS,
            metavar=_type(field.annotation).split(" ")[0].upper(),
            help=help_text.replace("%", "%%"),
        )


def flag_dest(section: str, name: str) -> str:
    """The argparse ``dest`` that makes a hand-declared flag the override of ``section.name``."""
    return f"{_DEST}{section}.{name}"


def flag_overrides(args: argparse.Namespace) -> list[str]:
    """The ``--section.key=value`` overrides of the generated flags given on a command line."""
    return [
        f"--{dest.removeprefix(_DEST)}={value}"
        for dest, value in vars(args).items()
        if dest.startswith(_DEST)
    ]


if __name__ == "__main__":
    sys.stdout.write(reference("markdown"))
