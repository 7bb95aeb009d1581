# The README's two commands: `make demo` and `make test`. Both create .venv and install first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-load lint install clean

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
	$(PY) recipes/math_agent.py --preset cpu-tiny-tool

# SGLang's own JSON contract (one file of its wheel) for the conformance tests; fetched once.
$(VENV)/sglang_api_types.py: $(STAMP)
	-$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
		--platform manylinux_2_34_x86_64 sglang==0.5.23 -d $(VENV)/sglang-wheel && \
	$(PY) -c "import glob, zipfile; w = glob.glob('$(VENV)/sglang-wheel/sglang-0.5.23-*.whl')[0]; \
		open('$@', 'wb').write(zipfile.ZipFile(w).read('sglang/api/v1/api_types.py'))"
	rm -rf $(VENV)/sglang-wheel

# Two pytest workers: on 2 cores the suite takes ~5.3 min instead of ~8 (much of it waits on
# servers and subprocesses). TEST_WORKERS=0 runs it in one process. --dist loadfile: a file's
# tests go to one worker, so a module fixture (a training run, a server) is built once, not on
# both; in collection order, where tests/conftest.py puts the files with slow tests first.
# (loadgroup's xdist_group marks do nothing under pytest 9: xdist 3.8 tags the old node id.)
TEST_WORKERS ?= 2

test: $(STAMP) $(VENV)/sglang_api_types.py
	$(PY) -m ruff check agentrl envs verifiers recipes tests benchmarks
	$(PY) -m mypy
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The slow tests again with two busy processes competing for the CPU (a loaded 2-core CI box):
# nothing may be timing-flaky. The hogs are killed by pid whatever the outcome.
test-load: $(STAMP)
	$(PY) -c "while True: pass" & h1=$$!; $(PY) -c "while True: pass" & h2=$$!; \
	$(PY) -m pytest -q -p no:cacheprovider -m slow && \
	$(PY) -m pytest -q -p no:cacheprovider tests/test_sandbox.py tests/test_faults.py \
		tests/test_server_input.py; rc=$$?; kill $$h1 $$h2; exit $$rc

clean:
	rm -rf $(VENV) build *.egg-info
