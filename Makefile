# The README's two commands are `make demo` and `make test`; each sets up what it needs itself.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint clean compose-tool

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# torch first, pinned: on the project's machines pip resolves this to a local CPU wheel; any other
# torch requirement pulls several GB of CUDA packages. pyproject.toml keeps torch>=2.4 for GPU users.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/chunkq run examples/sample.jsonl --store chunkq-store --chunk-size 50 --max-jobs 4

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# compose.yaml is validated with Debian's docker-compose (no container engine is needed for
# `config`); installed here where apt can, otherwise its test is skipped outside CI.
compose-tool:
	@command -v docker-compose >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] \
		&& apt-get update -qq && apt-get install -y -qq docker-compose >/dev/null; } \
		|| echo "docker-compose unavailable: tests/test_compose.py will be skipped (fails under CI=true)"

test: lint compose-tool
	$(BIN)/pytest

clean:
	rm -rf $(VENV) chunkq-store
