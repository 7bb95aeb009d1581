"""Verifier throughput: math checks per second and sandboxed executions per second (2 cores).

    python benchmarks/verifiers.py

Combines ``_math_bench.py`` (math-verify checks/s on mixed cases; event-loop share during a
batch of async checks) and ``_code_bench.py`` (sandboxed runs/s for a trivial and a 1-second
program, with and without namespaces; sandbox start-up cost). Prints both tables, then one JSON
line with every figure and the machine.
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import _code_bench  # noqa: E402 - benchmarks/ is a folder of scripts, not a package
import _math_bench  # noqa: E402


def main() -> None:
    figures: dict[str, object] = {"benchmark": "verifiers",
                                  "machine": platform.processor() or platform.machine()}
    for name, module in (("math", _math_bench), ("code", _code_bench)):
        rows, fig = module.run()
        print(f"== {name} ==")
        print("\n".join(rows))
        figures.update({f"{name}_{k}": v for k, v in fig.items()})
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
