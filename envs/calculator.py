"""A restricted arithmetic evaluator for calculator tools, over Python's ``ast`` (never ``eval``).

Allowed: int and float literals, ``+ - * / // % **``, unary ``+``/``-``, parentheses, the
constants ``pi`` and ``e``, and the functions in :data:`FUNCTIONS`. Anything else (names,
attributes, comparisons, strings, keyword arguments) is rejected with a message that says what.

Every operation is bounded *before* it runs: integer size (bits), the size of a power's result,
factorial's argument and rounding digits, so no single step can take long; a deadline checked at
every node bounds the whole evaluation. ``^`` is rejected with a hint, because in Python it is XOR
while the model almost certainly means a power.
"""

from __future__ import annotations

import ast
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

Number = int | float


class CalculatorError(ValueError):
    """The expression is not allowed, is malformed, or exceeds a limit; the message says which."""


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds of one evaluation."""

    max_chars: int = 500
    """Longest expression accepted."""
    max_int_bits: int = 10_000
    """Largest integer (in bits, about 3,000 digits) any step may produce."""
    max_factorial: int = 1000
    """Largest argument of ``factorial``."""
    max_round_digits: int = 100
    """Largest ``|ndigits|`` of ``round``."""
    time_limit_s: float = 1.0
    """Wall time of the whole evaluation, parsing included."""

    def __post_init__(self) -> None:
        if not 1 <= self.max_int_bits <= 14_000:  # str() of an int stops at 4,300 digits
            raise ValueError(f"max_int_bits: expected 1 to 14000, got {self.max_int_bits}")
        if not self.time_limit_s > 0:
            raise ValueError(f"time_limit_s: expected > 0, got {self.time_limit_s}")


DEFAULT_LIMITS = Limits()


def _factorial(n: Number, limits: Limits) -> int:
    if isinstance(n, float):
        if not n.is_integer():
            raise CalculatorError(f"factorial: expected a whole number, got {n}")
        n = int(n)
    if not 0 <= n <= limits.max_factorial:
        raise CalculatorError(f"factorial: expected 0 <= n <= {limits.max_factorial}, got {n}")
    return math.factorial(n)


def _round(x: Number, limits: Limits, ndigits: Number | None = None) -> Number:
    if ndigits is None:
        return round(x)
    if not isinstance(ndigits, int) or abs(ndigits) > limits.max_round_digits:
        raise CalculatorError(
            f"round: expected whole ndigits within ±{limits.max_round_digits}, got {ndigits}"
        )
    return round(x, ndigits)


def _log(x: Number, limits: Limits, base: Number | None = None) -> float:
    return math.log(x) if base is None else math.log(x, base)


def _plain(fn: Callable[..., Number]) -> Callable[..., Number]:
    return lambda *args: fn(*args[:1], *args[2:])  # drop the Limits argument


FUNCTIONS: dict[str, tuple[Callable[..., Number], int, int]] = {
    "sqrt": (_plain(math.sqrt), 1, 1),
    "exp": (_plain(math.exp), 1, 1),
    "log": (_log, 1, 2),
    "log10": (_plain(math.log10), 1, 1),
    "log2": (_plain(math.log2), 1, 1),
    "sin": (_plain(math.sin), 1, 1),
    "cos": (_plain(math.cos), 1, 1),
    "tan": (_plain(math.tan), 1, 1),
    "abs": (_plain(abs), 1, 1),
    "floor": (_plain(math.floor), 1, 1),
    "ceil": (_plain(math.ceil), 1, 1),
    "round": (_round, 1, 2),
    "min": (lambda *a: min(a[:1] + a[2:]), 1, 64),
    "max": (lambda *a: max(a[:1] + a[2:]), 1, 64),
    "factorial": (_factorial, 1, 1),
}
"""Callable name -> (function taking ``(x, limits, *rest)``, fewest args, most args)."""

CONSTANTS: dict[str, float] = {"pi": math.pi, "e": math.e}

_OPS: dict[type[ast.operator], str] = {
    ast.Add: "+",
    ast.Sub: "-",
    ast.Mult: "*",
    ast.Div: "/",
    ast.FloorDiv: "//",
    ast.Mod: "%",
    ast.Pow: "**",
}


class _Evaluator:
    def __init__(self, limits: Limits, deadline: float) -> None:
        self.limits = limits
        self.deadline = deadline

    def check(self, value: Number) -> Number:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CalculatorError(f"result must be a real number, got {type(value).__name__}")
        if isinstance(value, float) and not math.isfinite(value):
            raise CalculatorError("result is not finite")
        if isinstance(value, int) and value.bit_length() > self.limits.max_int_bits:
            raise CalculatorError(f"integer larger than {self.limits.max_int_bits} bits")
        return value

    def eval(self, node: ast.AST) -> Number:
        if time.monotonic() > self.deadline:
            raise CalculatorError(f"time limit of {self.limits.time_limit_s:g} s exceeded")
        if isinstance(node, ast.Constant):
            if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
                raise CalculatorError(f"only numbers are allowed, got {node.value!r}")
            return self.check(node.value)
        if isinstance(node, ast.Name):
            if node.id not in CONSTANTS:
                raise CalculatorError(f"unknown name {node.id!r}; constants: pi, e")
            return CONSTANTS[node.id]
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = self.eval(node.operand)
            return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, ast.BinOp):
            return self.binop(node)
        if isinstance(node, ast.Call):
            return self.call(node)
        raise CalculatorError(f"{type(node).__name__} is not allowed in a calculator expression")

    def binop(self, node: ast.BinOp) -> Number:
        if isinstance(node.op, ast.BitXor):
            raise CalculatorError("'^' is XOR, not a power: write 2**3 for 2 cubed")
        if type(node.op) not in _OPS:
            raise CalculatorError(f"operator {type(node.op).__name__} is not allowed")
        a, b = self.eval(node.left), self.eval(node.right)
        bits = self.limits.max_int_bits
        if isinstance(node.op, ast.Mult) and isinstance(a, int) and isinstance(b, int):
            if a.bit_length() + b.bit_length() > bits + 1:
                raise CalculatorError(f"product larger than {bits} bits")
        if isinstance(node.op, ast.Pow) and isinstance(a, int) and isinstance(b, int):
            if b > 0 and abs(a) > 1 and b * math.log2(abs(a)) > bits:
                raise CalculatorError(f"power larger than {bits} bits")
        try:
            value = _apply(node.op, a, b)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError(f"{_OPS[type(node.op)]} overflows a float") from None
        if isinstance(value, complex):
            raise CalculatorError("complex result (a negative number to a fractional power)")
        return self.check(value)

    def call(self, node: ast.Call) -> Number:
        if not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS:
            name = node.func.id if isinstance(node.func, ast.Name) else ast.unparse(node.func)
            raise CalculatorError(f"unknown function {name!r}; allowed: {', '.join(FUNCTIONS)}")
        fn, lo, hi = FUNCTIONS[node.func.id]
        if node.keywords or any(isinstance(a, ast.Starred) for a in node.args):
            raise CalculatorError(f"{node.func.id}: only positional arguments are allowed")
        if not lo <= len(node.args) <= hi:
            raise CalculatorError(
                f"{node.func.id}: expected {lo}"
                + (f" to {hi}" if hi > lo else "")
                + f" argument(s), got {len(node.args)}"
            )
        args = [self.eval(a) for a in node.args]
        try:
            return self.check(fn(args[0], self.limits, *args[1:]))
        except (ValueError, OverflowError, TypeError, ZeroDivisionError) as e:
            if isinstance(e, CalculatorError):
                raise
            raise CalculatorError(f"{node.func.id}: {e}") from None


def _apply(op: ast.operator, a: Number, b: Number) -> Number | complex:
    if isinstance(op, ast.Add):
        return a + b
    if isinstance(op, ast.Sub):
        return a - b
    if isinstance(op, ast.Mult):
        return a * b
    if isinstance(op, ast.Div):
        return a / b
    if isinstance(op, ast.FloorDiv):
        return a // b
    if isinstance(op, ast.Mod):
        return a % b
    return a**b  # may be complex: the caller rejects that


def evaluate(expression: str, limits: Limits = DEFAULT_LIMITS) -> Number:
    """Evaluate an arithmetic ``expression`` within ``limits``.

    Args:
        expression: for example ``"sqrt(2) * (3 + 4)**2"``.
        limits: size and time bounds.

    Returns:
        The value, an int or a finite float.

    Raises:
        CalculatorError: the expression is malformed, uses something not allowed, or exceeds a
            limit (the message says which).
    """
    deadline = time.monotonic() + limits.time_limit_s
    if not isinstance(expression, str):
        raise CalculatorError(f"expected an expression string, got {type(expression).__name__}")
    if len(expression) > limits.max_chars:
        raise CalculatorError(f"expression longer than {limits.max_chars} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"syntax error: {e.msg}") from None
    except ValueError as e:  # e.g. an integer literal over Python's 4,300-digit limit
        raise CalculatorError(str(e)) from None
    except (RecursionError, MemoryError):
        raise CalculatorError("expression nested too deeply") from None
    try:
        return _Evaluator(limits, deadline).eval(tree.body)
    except RecursionError:
        raise CalculatorError("expression nested too deeply") from None


def format_number(value: Number) -> str:
    """Show a result the way a calculator would: whole floats without ``.0``, 15 digits."""
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return format(value, ".15g")
    return str(value)


def calculate(expression: str, limits: Limits = DEFAULT_LIMITS) -> str:
    """:func:`evaluate`, formatted by :func:`format_number` (what a calculator tool returns)."""
    return format_number(evaluate(expression, limits))
