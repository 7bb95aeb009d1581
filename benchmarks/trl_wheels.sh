#!/usr/bin/env bash
# Download the wheels TRL 1.16 needs on the GPU host and that the host lacks, into $1 (default .whl).
#
# The host (CPython 3.12, manylinux x86_64) has torch 2.11, transformers 5.17, accelerate 1.15,
# pandas, pyarrow 25, numpy, psutil, xxhash, fsspec, huggingface_hub (<2.0, as transformers 5.17
# pins it), requests, httpx, jinja2, packaging, pyyaml, filelock and tqdm, but not trl, datasets,
# dill or multiprocess. Pins, from each wheel's Requires-Dist:
#   trl 1.16.0          accelerate>=1.10.1 datasets>=4.7.0 transformers>=4.56.2 pyarrow>=21 pandas>=2.1.1
#   datasets 5.0.1      huggingface-hub>=0.25,<2.0 pyarrow>=21 dill<0.4.2 multiprocess<0.70.20
#                       httpx<1 requests fsspec<=2026.6.0 (5.1+ need huggingface-hub>=1.31)
#   multiprocess 0.70.19  dill>=0.4.1
#   dill 0.4.1          (none)
# Install on the host with: pip install --no-deps --no-index DIR/*.whl
set -euo pipefail

dest="${1:-.whl}"
python="${PYTHON:-$(command -v .venv/bin/python || command -v python3)}"
mkdir -p "$dest"
"$python" -m pip download --quiet --only-binary=:all: --python-version 3.12 \
    --platform manylinux2014_x86_64 --no-deps --dest "$dest" \
    trl==1.16.0 datasets==5.0.1 multiprocess==0.70.19 dill==0.4.1
ls -l "$dest"
du -ch "$dest"/*.whl | tail -n 1
