#!/usr/bin/env bash
# On a GPU host: the whole loop (loop_gpu.py, Qwen3-0.6B shape, 12 timed steps, no TRL) once per
# variant wheel built by make_variants.sh, each in a process of its own; the other wheels the loop
# needs (gymnasium, pydantic, ...) must already be importable (e.g. PYTHONPATH=/tmp/site).
# Usage: benchmarks/wip/bisect_gpu.sh DIR main runs prompt records all
set -euo pipefail
dir="$1"; shift
for v in "$@"; do
  site="/tmp/site-$v"
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$dir/$v"/agentrl-*.whl
  steps=8; [[ "$v" == runs || "$v" == all ]] && steps=64  # the patch's default
  echo "== $v (decode steps $steps)"
  PYTHONPATH="$site:${PYTHONPATH:-}" python3 benchmarks/loop_gpu.py --workloads qwen3-0.6b --no-trl \
    --steps 12 --decode-steps "$steps" 2>&1 | grep '^\[progress\]' | cut -c1-400
done
