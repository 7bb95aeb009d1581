"""Which weight files ``/update_weights_from_disk`` and ``/load_lora_adapter`` may read.

The request names a directory; the server reads only its ``*.safetensors`` files, and only when
the directory lies under an allowed one (``agentrl serve --weights-dir``, repeatable; by
default the model directory the server started from and, with ``--config``, the run's
``weights`` directory) and every file is a regular file there after symlinks are resolved: a
FIFO, a device, or a link out of the allowed tree is refused before anything is opened (a FIFO
once froze the whole server). The files together may not exceed ``max_bytes`` (a bound from the
model's own size), and the read runs in a thread of its own under a deadline, so a slow disk
never holds the engine's decode threads.
"""

from __future__ import annotations

import asyncio
import os
import stat
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors.torch import load_file

T = TypeVar("T")


class WeightPathError(ValueError):
    """A weight directory the server refuses to read (a 400 naming why)."""


def resolve_dirs(dirs: Iterable[str | Path]) -> list[Path]:
    """The allowed directories, resolved (links followed); those that do not exist are kept."""
    return [Path(d).expanduser().resolve() for d in dirs]


def _under(path: Path, roots: list[Path]) -> bool:
    return any(path == root or path.is_relative_to(root) for root in roots)


def _allowed_dir(route: str, field: str, path: str, allowed: list[Path], kind: str) -> Path:
    """``path`` resolved: absolute, a directory, under an allowed one (else one line why)."""
    if not allowed:
        raise WeightPathError(
            f"{route} is off: this server allows no weight directory "
            "(start it with --weights-dir DIR)"
        )
    folder = Path(path).expanduser()
    if not folder.is_absolute():
        raise WeightPathError(f"{field}: expected an absolute path, got {path!r}")
    real = folder.resolve()
    if not _under(real, allowed):
        listed = ", ".join(str(d) for d in allowed)
        raise WeightPathError(f"{field}: {path!r} is not under an allowed directory "
                              f"({listed}; add one with --weights-dir)")  # fmt: skip
    if not real.is_dir():
        raise WeightPathError(f"{field}: expected {kind}, got {path!r}")
    return real


def checked_files(model_path: str, allowed: list[Path], max_bytes: int) -> list[Path]:
    """The safetensors files of ``model_path`` once every check has passed.

    Raises:
        WeightPathError: outside the allowed directories, not a directory, no safetensors, a
            file that is not regular or lies outside them, or more than ``max_bytes`` in all.
    """
    real = _allowed_dir("update_weights_from_disk", "model_path", model_path, allowed,
                        "a local model directory")  # fmt: skip
    files, total = [], 0
    for entry in sorted(real.glob("*.safetensors")):
        target = entry.resolve()
        try:
            info = os.stat(target)
        except OSError as exc:
            raise WeightPathError(f"model_path: cannot stat {entry.name}: {exc.strerror}") from None
        if not stat.S_ISREG(info.st_mode) or not _under(target, allowed):
            raise WeightPathError(
                f"model_path: {entry.name} is not a regular file under an allowed directory"
            )
        files.append(target)
        total += info.st_size
    if not files:
        raise WeightPathError(f"model_path: no *.safetensors file in {model_path!r}")
    if total > max_bytes:
        raise WeightPathError(
            f"model_path: {total} bytes of safetensors, more than this model can hold "
            f"({max_bytes} bytes)"
        )
    return files


def checked_adapter_dir(lora_path: str, allowed: list[Path]) -> Path:
    """``lora_path`` resolved, once it passes the checks (the engine bounds the sizes).

    A directory under an allowed one whose peft files (``adapter_config.json``,
    ``adapter_model.safetensors``) are regular files there too.

    Raises:
        WeightPathError: refused, saying why.
    """
    real = _allowed_dir("load_lora_adapter", "lora_path", lora_path, allowed,
                        "a peft adapter directory")  # fmt: skip
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        target = (real / name).resolve()
        try:
            info = os.stat(target)
        except OSError:
            raise WeightPathError(
                f"lora_path: {lora_path!r} holds no {name} (a peft adapter directory has "
                "adapter_config.json and adapter_model.safetensors)"
            ) from None
        if not stat.S_ISREG(info.st_mode) or not _under(target, allowed):
            raise WeightPathError(
                f"lora_path: {name} is not a regular file under an allowed directory"
            )
    return real


def max_weight_bytes(model: torch.nn.Module) -> int:
    """The most bytes a checkpoint of ``model`` can take: its values as float64, plus headers."""
    return sum(t.numel() for t in model.state_dict().values()) * 8 + 16 * 2**20


async def in_thread(fn: Callable[..., T], *args: Any, name: str) -> T:
    """``fn(*args)`` in a daemon thread of its own, awaited.

    Not the loop's default executor: the engine decodes there, and a call that blocks (a group
    rendezvous with a peer that never comes, a stuck disk) must not take its threads; a daemon
    thread also never holds up the process's exit.
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(value: Any, failed: bool) -> None:
        if not done.done():
            done.set_exception(value) if failed else done.set_result(value)

    def run() -> None:
        try:
            result = fn(*args)
        except BaseException as exc:  # handed to the awaiting task
            loop.call_soon_threadsafe(settle, exc, True)
        else:
            loop.call_soon_threadsafe(settle, result, False)

    threading.Thread(target=run, name=name, daemon=True).start()
    return await done


async def read_weights(
    model_path: str, allowed: list[Path], max_bytes: int, timeout_s: float
) -> dict[str, torch.Tensor]:
    """The checked directory's state dict, read within ``timeout_s``.

    Raises:
        WeightPathError: refused (see :func:`checked_files`), unreadable, or too slow.
    """
    files = checked_files(model_path, allowed, max_bytes)

    def read() -> dict[str, torch.Tensor]:  # the checked files, not a second glob
        state: dict[str, torch.Tensor] = {}
        for file in files:
            state.update(load_file(str(file)))
        return state

    try:
        return await asyncio.wait_for(in_thread(read, name="weights-read"), timeout_s)
    except TimeoutError:
        raise WeightPathError(f"model_path: reading took longer than {timeout_s:g} s") from None
    except Exception as exc:  # corrupt or unreadable files: the caller's input
        raise WeightPathError(f"model_path: cannot read the weights: {exc}") from None
