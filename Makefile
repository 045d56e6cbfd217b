# The README's two commands are `make demo` and `make test`; each sets up what it needs itself.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast test-gpu test-openvino gpu-check gpu-carry lint clean system-tools bytecode

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# torch first, pinned: on the project's machines pip resolves this to a local CPU wheel; any other
# torch requirement pulls several GB of CUDA packages. pyproject.toml keeps torch>=2.4 for GPU users.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

# The tree's bytecode, written before each command (a no-op when current). pip compiles what it
# installs, but not an editable tree, and where PYTHONDONTWRITEBYTECODE is set (these machines and CI)
# every chunkq process would compile chunkq's modules again: 0.15-0.35 s of CPU for each command, pool
# and fork server (bench/run_cpu.py: a small run 1.06x the plain script with it, 1.15x without).
bytecode: $(STAMP)
	$(BIN)/python -m compileall -q chunkq jobs queue_worker supervisor tests bench

demo: bytecode
	$(BIN)/chunkq run examples/sample.jsonl --store chunkq-store --chunk-size 50 --max-jobs 4

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# Debian tools some tests drive: docker-compose validates compose.yaml (`config` needs no container
# engine), headless Chromium opens the dashboard, slurm-wlm and munge make the one-node cluster the
# Slurm recipe runs on. Installed here where apt can; otherwise those tests are skipped outside CI
# and fail under CI=true.
system-tools:
	@missing=""; command -v docker-compose >/dev/null 2>&1 || missing="$$missing docker-compose"; \
	command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	command -v slurmctld >/dev/null 2>&1 || missing="$$missing slurm-wlm"; \
	command -v munged >/dev/null 2>&1 || missing="$$missing munge"; \
	[ -z "$$missing" ] || { command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] \
		&& apt-get update -qq && apt-get install -y -qq $$missing >/dev/null; } \
		|| echo "unavailable:$$missing; the tests that need them will be skipped (fail under CI=true)"

# Three tests at a time (pytest-xdist): most of them wait on the processes they start, so three
# keep CI's two cores busy; work-stealing keeps the long ones from ending the run alone. The
# slowest 25 are listed: CI's log is where the suite's time goal is tracked.
# pytest rewrites each test module's asserts and keeps the result beside its bytecode, which it
# writes only where bytecode may be written: under PYTHONDONTWRITEBYTECODE (set on these machines and
# in CI) every test process rewrote every module again: collecting the fast tier took 6.1 s, 3.0 s
# with the rewrites kept.
PYTEST := PYTHONDONTWRITEBYTECODE= $(BIN)/pytest

test: lint system-tools bytecode
	$(PYTEST) -n 3 --dist worksteal --durations=25

# The inner loop: everything but the slow tier (real pools and CLI runs) and the GPU tier. Two at
# a time: measured 61-73 s here against 93-96 s one at a time, and slower with three.
test-fast: bytecode
	$(PYTEST) -m "not slow and not gpu" -q -n 2

# --backend openvino's tests in an environment of their own: optimum-intel holds transformers below
# 5.6 (the main one resolves 5.24), and pulls a torchvision that must not replace the CPU torch. The
# same torch pinned; torchvision removed, since the PyPI one built for another torch breaks
# transformers' import ("operator torchvision::nms does not exist") and nothing here uses it.
OV_VENV := .venv-openvino
$(OV_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(OV_VENV)
	$(OV_VENV)/bin/pip install -q torch==2.13.0
	$(OV_VENV)/bin/pip install -q -c constraints/openvino.txt -e '.[dev,openvino]'
	$(OV_VENV)/bin/pip uninstall -q -y torchvision
	touch $@

test-openvino: $(OV_VENV)/.installed
	$(OV_VENV)/bin/pytest -q tests/jobs/test_openvino.py

# The GPU tier (tests/gpu): real faults on a real GPU, run by the host's own python with its CUDA
# build of torch (this venv holds the CPU wheel, which would skip every test). chunkq's other
# requirements and pytest, pytest-timeout must be importable there; the tree is put on the path.
test-gpu:
	PYTHONPATH="$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}" python3 -m pytest -m gpu tests/gpu

# The one GPU check that fits a device lease (docs/development.md): the GPU tier, then bench/gpu.py,
# within 8 minutes, its summary in gpu-check/gpu-check.md. On the GPU host, with its own python and
# CUDA torch; what `make gpu-carry` packed here (wheels, the model) is installed there first.
GPU_CARRY ?= gpu-carry
gpu-check:
	python3 bench/gpu_check.py --out gpu-check $(if $(wildcard $(GPU_CARRY)/wheels),--carried $(GPU_CARRY))

gpu-carry: $(STAMP)
	$(BIN)/python bench/gpu_carry.py pack $(GPU_CARRY)

clean:
	rm -rf $(VENV) chunkq-store
