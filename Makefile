# The README's two commands: `make demo` and `make test`. Both create .venv and install first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint install clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU machines get the CPU build of torch first; an unpinned torch would pull a CUDA build.
	if ! command -v nvidia-smi >/dev/null 2>&1; then \
		$(PY) -m pip install -q torch==2.13.0 || \
		$(PY) -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu; \
	fi
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) recipes/math_agent.py --preset cpu-tiny

test: $(STAMP)
	$(PY) -m ruff check agentrl envs verifiers recipes tests benchmarks
	$(PY) -m mypy
	$(PY) -m pytest -q -p no:cacheprovider

clean:
	rm -rf $(VENV) build *.egg-info
