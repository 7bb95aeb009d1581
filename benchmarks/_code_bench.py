"""Code sandbox: start-up cost and sandboxed executions per second, with and without namespaces.

For each isolation level (``namespaces`` through bwrap when it works here, ``rlimits`` always):

1. Start-up: the median wall time of one trivial run (``pass``) done alone, and the same for a
   bare ``python -I -S -c pass`` subprocess; the sandbox's own cost is the difference. Also the
   CPU time per run (this process plus children), which a loaded machine inflates less.
2. Throughput on all cores (``max_concurrency`` = CPU count, runs issued through
   ``execute_async``): trivial programs per second, and 1-second programs (a CPU-bound loop that
   runs 1 s) per second; the ideal for the latter is one per core.
3. Scoring: the median wall time of one ``score()`` of a small function against 5 assert tests
   and of a stdin/stdout program against 3 cases, done alone; and the time to score all 164
   HumanEval canonical solutions on all cores (``validate_solutions``), per program.

Also :func:`forged_rewards`: the programs in ``FORGERIES`` each try to earn a reward for ``add``
without solving it (print or write the harness's result lines anywhere, exit early, kill or
trace the checker, patch builtins, ``__eq__`` objects, protocol junk, ...); it counts those
that scored above 0 (the target is 0), after checking that an honest program scores 1.

    python benchmarks/_code_bench.py     # table, then one JSON line
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import resource
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import Literal

from agentrl.errors import VerifierError
from agentrl.verifiers.code import AssertTest, CodeResult, IOTest, score, score_async
from agentrl.verifiers.code_tasks import load_humaneval, validate_solutions
from agentrl.verifiers.sandbox import Isolation, Sandbox

TRIVIAL = "pass\n"
ONE_SECOND = (
    "import time\nt = time.perf_counter()\nwhile time.perf_counter() - t < 1.0:\n    pass\n"
)


def _cost_ms(fn: Callable[[], object], n: int) -> tuple[float, float]:
    """Median wall ms of ``fn`` run alone, and the CPU ms it used (this process and children)."""

    def cpu() -> float:
        me, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
        return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime

    times, cpu0 = [], cpu()
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times), 1000 * (cpu() - cpu0) / n


def _rate(box: Sandbox, code: str, n: int, timeout_s: float) -> float:
    async def go() -> float:
        start = time.perf_counter()
        results = await asyncio.gather(
            *(box.execute_async(code, timeout_s=timeout_s) for _ in range(n))
        )
        bad = [r.status for r in results if r.status != "ok"]
        if bad:
            raise RuntimeError(f"benchmark runs failed: {bad[:3]}")
        return n / (time.perf_counter() - start)

    return asyncio.run(go())


ADD = "def add(a, b):\n    return a + b\n"
ADD_TESTS = [AssertTest(f"assert add({i}, 2) == {i + 2}") for i in range(5)]
DOUBLE = "print(2 * int(input()))\n"
DOUBLE_TESTS = [IOTest(str(i), str(2 * i)) for i in range(3)]


# A forged program must score 0 on these (its ``add`` is wrong); the honest one scores 1.
FORGERY_TESTS = [
    AssertTest("assert add(1, 2) == 3"),
    AssertTest("assert add(5, 5) == 10"),
    AssertTest(
        "def check(candidate):\n    assert candidate(2, 3) == 5\n"
        "    assert all(candidate(i, i) == 2 * i for i in range(3))\ncheck(add)\n"
    ),
    AssertTest("assert all(map(lambda i: add(i, 1) == i + 1, range(3)))"),
]
_LINES = (  # result lines in the pre-fix format and in today's, for every test
    "\n".join(f"{i}[{i}, 'passed', '', 0.0]\n[{i},\"passed\",\"\",0.0]" for i in range(4))
    + '\n["out","",""]\n'
)
_WRONG = f"LINES = {_LINES!r}\ndef add(a, b):\n    return 0\n"
_STACK = (  # 16-character strings in the frames above the program
    "import os, sys\nf, found = sys._getframe(), set()\nwhile f:\n"
    "    found |= {v for v in f.f_locals.values() if isinstance(v, str) and len(v) == 16}\n"
    "    f = f.f_back\n"
)
FORGERIES: dict[str, str] = {
    "print result lines": _WRONG + "print(LINES)\nimport sys\nsys.stderr.write(LINES)\n"
    "def add(a, b):\n    print(LINES, flush=True)\n    return 0\n",
    "write every fd": _WRONG + "import os\nfor fd in range(256):\n    try:\n"
    "        os.write(fd, LINES.encode())\n    except OSError:\n        pass\n",
    "the checker's fds in /proc": _WRONG + "import os\nfor pid in {1, os.getppid()}:\n"
    "    for fd in range(16):\n        try:\n"
    "            with open(f'/proc/{pid}/fd/{fd}', 'w') as f:\n                f.write(LINES)\n"
    "        except OSError:\n            pass\n",
    "read secrets, print them": _WRONG + "import os, sys, gc\nfound = [repr(dict(os.environ))]\n"
    "for path in ['/tmp/main.py', 'main.py', f'/proc/{os.getppid()}/environ',"
    " f'/proc/{os.getppid()}/cmdline', f'/proc/{os.getppid()}/mem', '/proc/1/environ']:\n"
    "    try:\n        found.append(open(path, 'rb').read(1 << 16).decode('latin-1'))\n"
    "    except OSError as e:\n        found.append(str(e))\n"
    "found += [o for o in gc.get_objects() if isinstance(o, str) and len(o) == 16][:50]\n"
    "print('\\n'.join(found) + LINES)\n",
    "ptrace the checker": _WRONG + "import ctypes, os\nlibc = ctypes.CDLL(None)\n"
    "for pid in {1, os.getppid()}:\n    if libc.ptrace(16, pid, 0, 0) == 0:\n"
    "        print('attached', pid)\n",
    "sys.exit(0) at load": _WRONG + "print(LINES)\nimport sys\nsys.exit(0)\n",
    "os._exit(0) at load": _WRONG + "print(LINES, flush=True)\nimport os\nos._exit(0)\n",
    "os._exit(0) in the call": "import os\ndef add(a, b):\n    os._exit(0)\n",
    "SystemExit in the call": "def add(a, b):\n    raise SystemExit(0)\n",
    "StopIteration in the call": "def add(a, b):\n    raise StopIteration\n",
    "kill the checker": _WRONG + "import os, signal\nfor pid in {1, os.getppid()}:\n"
    "    for sig in (signal.SIGKILL, signal.SIGTERM):\n        try:\n"
    "            os.kill(pid, sig)\n        except OSError:\n            pass\n",
    "SIGALRM the checker": "import os, signal\ndef add(a, b):\n"
    "    os.kill(os.getppid(), signal.SIGALRM)\n    return 0\n",
    "shadow builtins": _WRONG + "import builtins\ndef all(x):\n    return True\n"
    "def map(*a):\n    return [True]\nbuiltins.all = all\n"
    "builtins.AssertionError = type('AssertionError', (Exception,), {})\n",
    "__eq__ always true": "class Yes:\n    def __eq__(self, other):\n        return True\n"
    "    __ne__ = lambda self, other: False\n    __bool__ = lambda self: True\n"
    "    __hash__ = lambda self: 0\ndef add(a, b):\n    return Yes()\n",
    "int subclass __eq__": "class I(int):\n    def __eq__(self, other):\n        return True\n"
    "    __hash__ = int.__hash__\ndef add(a, b):\n    return I(0)\n",
    "protocol junk": _WRONG + "import os\nos.write(4, b'13\\n[\"ok\",3,[]]' * 8)\n"
    "def add(a, b):\n    os.write(4, b'99999999999\\n[\"ok\"' + b'[' * 5000)\n    return 0\n",
    "too deep a reply": "def add(a, b):\n    x = []\n    for _ in range(10000):\n"
    "        x = [x]\n    return x\n",
    "the harness's own functions": _WRONG + "import sys\nm = sys.modules['__main__']\n"
    "for name in ('_emit', 'send'):\n    f = getattr(m, name, None)\n    if f:\n"
    "        try:\n            f(LINES) if name == '_emit' else f(4, '[\"ok\",3,[]]')\n"
    "        except Exception:\n            pass\n",
    # the pre-fix harness's nonce sat in its frames: find it, print its lines, end before the tests
    "nonce from the stack": _WRONG + _STACK + "for nonce in found:\n"
    "    lines = [f'\\n{nonce}[{i}, \"passed\", \"\", 0.0]\\n' for i in range(4)]\n"
    "    os.write(1, ''.join(lines).encode())\nif found:\n    os._exit(0)\n",
    "malformed nonce line": _WRONG + _STACK + "for nonce in found:\n"
    "    os.write(1, f'\\n{nonce}[0, (\\n'.encode())\n",
    "a child left behind": _WRONG + "import os, time\nif os.fork() == 0:\n"
    "    end = time.monotonic() + 0.3\n    while time.monotonic() < end:\n"
    "        for fd in (1, 2, 4):\n            try:\n                os.write(fd, LINES.encode())\n"
    "            except OSError:\n                pass\n    os._exit(0)\n",
}
HONEST = "def add(a, b):\n    return a + b\n"


def forged_rewards(isolation: Isolation | Literal["auto"] = "auto") -> dict[str, object]:
    """Score every forgery (1 s per test); ``forged_rewards`` counts those above 0 (target 0).

    Raises:
        RuntimeError: the honest program did not score 1 (then a 0 would prove nothing).
    """
    box = Sandbox(isolation=isolation, max_concurrency=os.cpu_count() or 1)
    try:
        honest = score(HONEST, FORGERY_TESTS, timeout_s=1.0, sandbox=box)
        if honest.score != 1.0:
            raise RuntimeError(f"the honest program scored {honest.score}: {honest.tests}")

        async def all_scores() -> list[CodeResult]:
            programs = FORGERIES.values()
            runs = [score_async(p, FORGERY_TESTS, timeout_s=1.0, sandbox=box) for p in programs]
            return await asyncio.gather(*runs)

        results = dict(zip(FORGERIES, asyncio.run(all_scores()), strict=True))
    finally:
        box.close()
    paid = {name: r.score for name, r in results.items() if r.score > 0}
    return {"forged_rewards": len(paid), "forgeries": len(FORGERIES), "paid": paid,
            "isolation": honest.isolation}


def _scoring(box: Sandbox) -> dict[str, float]:
    """Per-program scoring: assert tests and IO tests alone (median ms), HumanEval on all cores."""
    for code, tests in ((ADD, ADD_TESTS), (DOUBLE, DOUBLE_TESTS)):
        if score(code, tests, sandbox=box).score != 1.0:
            raise RuntimeError(f"benchmark program failed its tests: {code!r}")
    asserts_ms, _ = _cost_ms(lambda: score(ADD, ADD_TESTS, sandbox=box), 20)
    io_ms, _ = _cost_ms(lambda: score(DOUBLE, DOUBLE_TESTS, sandbox=box), 20)
    tasks = load_humaneval(validate=False)
    start = time.perf_counter()
    report = validate_solutions(tasks, sandbox=box)
    took = time.perf_counter() - start
    if report.failed:
        raise RuntimeError(f"HumanEval canonical solutions failed: {report.failed[:5]}")
    return {"score_asserts_ms": asserts_ms, "score_io_ms": io_ms,
            "humaneval_ms_per_program": 1000 * took / len(tasks)}


def _level(level: Isolation, cores: int) -> dict[str, float] | None:
    box = Sandbox(isolation=level, max_concurrency=cores)
    try:
        _ = box.isolation
    except VerifierError:
        return None
    box.execute(TRIVIAL)  # warm the page cache
    wall_ms, cpu_ms = _cost_ms(lambda: box.execute(TRIVIAL), 30)
    out = {
        "startup_ms": wall_ms,
        "startup_cpu_ms": cpu_ms,
        "trivial_per_s": _rate(box, TRIVIAL, 60, 10.0),
        "one_second_per_s": _rate(box, ONE_SECOND, 2 * cores, 10.0),
        **_scoring(box),
    }
    box.close()
    return out


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run() -> tuple[list[str], dict]:
    """Measure; return table rows and the headline figures."""
    cores = os.cpu_count() or 1
    python = Sandbox().python
    bare = [python, "-I", "-S", "-c", "pass"]
    bare_ms, bare_cpu = _cost_ms(lambda: subprocess.run(bare, check=True), 30)
    levels: dict[Isolation, dict[str, float] | None] = {
        "namespaces": _level("namespaces", cores),
        "rlimits": _level("rlimits", cores),
    }
    head = f"{f'code sandbox, {cores} cores':<24}{'start ms':>10}{'CPU ms':>9}{'extra ms':>10}"
    rows = [head + f"{'trivial/s':>11}{'1-s prog/s':>11}"]
    rows.append(f"  {'bare python -I -S':<22}{bare_ms:>10.1f}{bare_cpu:>9.1f}{0.0:>10.1f}")
    figures: dict = {"code_bare_python_ms": round(bare_ms, 1), "code_cores": cores}
    for name, m in levels.items():
        if m is None:
            rows.append(f"  {name:<22}{'unavailable':>10}")
            continue
        extra = m["startup_ms"] - bare_ms
        rows.append(
            f"  {name:<22}{m['startup_ms']:>10.1f}{m['startup_cpu_ms']:>9.1f}{extra:>10.1f}"
            f"{m['trivial_per_s']:>11.1f}{m['one_second_per_s']:>11.2f}"
        )
        figures[f"code_startup_ms_{name}"] = round(m["startup_ms"], 1)
        figures[f"code_startup_cpu_ms_{name}"] = round(m["startup_cpu_ms"], 1)
        figures[f"code_overhead_ms_{name}"] = round(extra, 1)
        figures[f"code_trivial_per_s_{name}"] = round(m["trivial_per_s"], 1)
        figures[f"code_one_second_per_s_{name}"] = round(m["one_second_per_s"], 2)
        for key in ("score_asserts_ms", "score_io_ms", "humaneval_ms_per_program"):
            figures[f"code_{key}_{name}"] = round(m[key], 1)
    head = f"  {'score() ms, alone':<22}{'5 asserts':>11}{'3 IO cases':>11}{'HumanEval/prog':>15}"
    rows.append(head)
    for name, m in levels.items():
        if m is not None:
            rows.append(f"  {name:<22}{m['score_asserts_ms']:>11.1f}{m['score_io_ms']:>11.1f}"
                        f"{m['humaneval_ms_per_program']:>15.1f}")
    return rows, figures


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.ERROR)
    table, heads = run()
    print("\n".join(table))
    # the machine's load is part of the result: these figures are wall-clock rates
    machine = {"cpu": _cpu_name(), "cores": os.cpu_count(), "gpu": None}
    print(json.dumps({**heads, "machine": {**machine, "load_avg_1m": os.getloadavg()[0]}}))
