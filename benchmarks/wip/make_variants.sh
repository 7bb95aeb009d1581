#!/usr/bin/env bash
# Build one agentrl wheel per variant of main + the wip patches, into $1/<variant>/ (default .whl-variants).
# Variants: main, runs (runs_end_early), prompt (prompt_cache), records (records_before_push), all.
# Then on a GPU host: benchmarks/wip/bisect_gpu.sh $1 main runs ...
set -euo pipefail
root="$(git rev-parse --show-toplevel)"
out="$(realpath -m "${1:-.whl-variants}")"
python="${PYTHON:-python3}"
declare -A parts=([main]="" [runs]="runs_end_early" [prompt]="prompt_cache"
                  [records]="records_before_push" [all]="runs_end_early prompt_cache records_before_push")
for v in main runs prompt records all; do
  wt="$(mktemp -d)"
  git -C "$root" worktree add -q --detach "$wt" HEAD
  for p in ${parts[$v]}; do git -C "$wt" apply "$root/benchmarks/wip/$p.patch"; done
  mkdir -p "$out/$v"
  "$python" -m pip wheel -q --no-deps "$wt" -w "$out/$v"
  git -C "$root" worktree remove --force "$wt"
  echo "$v: $(ls "$out/$v")"
done
