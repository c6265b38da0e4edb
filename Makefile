# Two entry points a new user needs: `make serve` and `make test`. Both build .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch==2.13.0: this machine's disk holds its CPU build; on PyPI it is the CUDA build for Linux.
# Pinning it here stops pip from resolving a bare range to a multi-GB build it must download.
TORCH ?= torch==2.13.0

.PHONY: venv serve test unit lint typecheck bench-core clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

venv: $(VENV)/.installed

serve: venv
	$(BIN)/sdpa-service serve

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: venv
	$(BIN)/mypy

test: lint typecheck
	$(BIN)/pytest -n 2 --dist loadgroup

# The fast tests (core, service in process, client), under a minute: no real server, no
# subprocesses, no slow marks. `make test` stays the whole suite.
unit: venv
	$(BIN)/pytest -n 2 -q -m "not slow" tests/core tests/service tests/client

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
