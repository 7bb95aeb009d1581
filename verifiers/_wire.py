"""Plain data between the checker and the candidate of the assert-test harness, and its frames.

Shared by both processes of :mod:`agentrl.verifiers._assert_harness` (the sandbox gets this file's
source followed by that one's, as one ``main.py``). Stdlib C parts only (``_json``): importing
``json`` would pull in ``re``, several milliseconds of every run.

:func:`dump` writes a value as ASCII JSON with tags for what JSON lacks (``{"t": [...]}`` a
tuple, ``{"d": [[k, v], ...]}`` a dict, ``{"h": [...]}`` a handle, ...); :func:`loads` parses it
strictly and :func:`build` rebuilds fresh built-in objects from it, so whatever the sender defined
(``__eq__``, subclasses) never crosses. Messages are length-prefixed frames, at most
``MAX_FRAME`` bytes, nested at most ``MAX_DEPTH`` levels.
"""

from __future__ import annotations

import _json
import os

if __name__ != "__main__":  # annotations only: in the sandbox, typing would cost ~7 ms a run
    from collections.abc import Callable
    from typing import Any

MAX_DEPTH = 100
MAX_FRAME = 16 << 20
"""Largest message (bytes of JSON) either side accepts."""
MAX_ITEMS = 1 << 20
CLIP = 300
_INF = float("inf")
esc: Callable[[str], str] = _json.encode_basestring_ascii


class _Ctx:  # what _json.make_scanner reads: strict JSON, no NaN/Infinity literals
    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int

    @staticmethod
    def parse_constant(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")


_scan = _json.make_scanner(_Ctx)  # type: ignore[arg-type]


def dump(x: Any, handle: Callable[[object], str], depth: int = 0) -> str:
    """``x`` as ASCII JSON, tagged so that :func:`build` rebuilds the same plain values.

    ``handle(x)`` gives the text for a value that is not plain data (or raises).
    """
    if depth > MAX_DEPTH:
        raise ValueError(f"a value nested deeper than {MAX_DEPTH} levels")
    if x is None:
        return "null"
    if isinstance(x, bool):
        return "true" if x else "false"
    if isinstance(x, int):
        v = int(x)
        return str(v) if -(1 << 63) < v < 1 << 63 else f'{{"I":"{v:x}"}}'
    if isinstance(x, float):
        f = float(x)
        return f'{{"x":"{f!r}"}}' if f != f or f in (_INF, -_INF) else repr(f)
    if isinstance(x, complex):
        return f'{{"c":[{dump(x.real, handle)},{dump(x.imag, handle)}]}}'
    if isinstance(x, str):
        return esc(str.__str__(x))
    if isinstance(x, (bytes, bytearray)):
        return f'{{"{"y" if isinstance(x, bytearray) else "b"}":"{bytes(x).hex()}"}}'
    d = depth + 1
    if isinstance(x, dict):
        pairs = ",".join(f"[{dump(k, handle, d)},{dump(v, handle, d)}]" for k, v in x.items())
        return f'{{"d":[{pairs}]}}'
    if isinstance(x, (list, tuple, set, frozenset)):
        body = ",".join(dump(v, handle, d) for v in x)
        if isinstance(x, list):
            return f"[{body}]"
        tag = "t" if isinstance(x, tuple) else "s" if isinstance(x, set) else "f"
        return f'{{"{tag}":[{body}]}}'
    if hasattr(type(x), "__next__"):  # an iterator or generator: its items
        items = []
        for v in x:
            items.append(v)
            if len(items) > MAX_ITEMS:
                raise ValueError(f"an iterator of more than {MAX_ITEMS} items")
        return f'{{"g":[{",".join(dump(v, handle, d) for v in items)}]}}'
    if callable(getattr(type(x), "tolist", None)):  # NumPy arrays and scalars
        return dump(x.tolist(), handle, d)
    return handle(x)


def build(v: Any, handle: Callable[[object], object], depth: int = 0) -> Any:
    """The plain value that :func:`dump` encoded (parsed by :func:`loads`); ValueError if malformed.

    Everything built is a fresh built-in object: nothing the sender defined comes back.
    """
    if depth > MAX_DEPTH:
        raise ValueError(f"a value nested deeper than {MAX_DEPTH} levels")
    t = type(v)
    if t is list:
        return [build(i, handle, depth + 1) for i in v]
    if t is not dict:
        return v  # None, bool, int, float, str: what JSON holds
    if len(v) != 1:
        raise ValueError("a malformed value")
    ((tag, a),) = v.items()
    if tag == "h":
        return handle(a)
    if type(a) is str:
        if tag == "x" and a in ("nan", "inf", "-inf"):
            return float(a)
        if tag == "I":
            return int(a, 16)
        if tag in ("b", "y"):
            return bytes.fromhex(a) if tag == "b" else bytearray.fromhex(a)
    elif type(a) is list:
        items: list[Any] = [build(i, handle, depth + 1) for i in a]
        if tag == "t":
            return tuple(items)
        if tag == "s":
            return set(items)
        if tag == "f":
            return frozenset(items)
        if tag == "g":
            return iter(items)
        if tag == "d" and all(type(p) is list and len(p) == 2 for p in items):
            return dict(items)
        if tag == "c" and len(items) == 2 and all(type(p) in (int, float) for p in items):
            return complex(items[0], items[1])
    raise ValueError(f"a malformed value (tag {tag!r})")


def loads(text: str) -> object:
    """Parse one JSON document (strict; no NaN or Infinity); ValueError if it is not one."""
    try:
        value, end = _scan(text, 0)
    except StopIteration:
        raise ValueError("not JSON") from None
    if end != len(text):
        raise ValueError("data after the JSON document")
    return value


class Reader:
    """Length-prefixed frames (a line of ASCII digits, then that many bytes of JSON) from a pipe."""

    def __init__(self, fd: int) -> None:
        self.fd, self.buf = fd, bytearray()

    def frame(self) -> str:
        while (nl := self.buf.find(b"\n", 0, 24)) < 0:
            if len(self.buf) >= 24:
                raise ValueError("a malformed frame header")
            self._more(1 << 16)
        head = bytes(self.buf[:nl])
        if not head.isdigit() or int(head) > MAX_FRAME:
            raise ValueError(f"a frame header of {head[:24]!r} (at most {MAX_FRAME} bytes)")
        end = nl + 1 + int(head)
        while len(self.buf) < end:
            self._more(min(1 << 20, end - len(self.buf)))
        data = bytes(self.buf[nl + 1 : end])
        del self.buf[:end]
        return data.decode("ascii")

    def _more(self, n: int) -> None:
        chunk = os.read(self.fd, n)
        if not chunk:
            raise EOFError
        self.buf += chunk


def send(fd: int, text: str) -> None:
    view = memoryview(b"%d\n" % len(text) + text.encode("ascii"))
    while view:
        view = view[os.write(fd, view) :]


def where(tb: Any, name: str, lines: list[str]) -> str:
    """`` (line N: source)`` of the innermost frame of file ``name`` in a traceback."""
    line = None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == name:
            line = tb.tb_lineno
        tb = tb.tb_next
    return f" (line {line}: {lines[line - 1].strip()})" if line and line <= len(lines) else ""


def describe(e: BaseException) -> str:
    try:
        text = str(e)
    except Exception:
        text = ""
    return (f"{type(e).__name__}: {text}" if text else type(e).__name__)[:CLIP]
