# syntax=docker/dockerfile:1
#
# sdpa-service image: one uvicorn worker, non-root, CPU torch by default.
#
#   docker build -t localhost/sdpa-service:latest .                    # CPU (or: make image)
#   docker build -t localhost/sdpa-service:latest-cuda --build-arg TORCH_VARIANT=cu128 .
#   docker run --rm -p 127.0.0.1:8000:8000 -p 127.0.0.1:8001:8001 --read-only --tmpfs /tmp \
#     localhost/sdpa-service                                           # HTTP :8000, gRPC :8001
#   docker stop -t 45 <container>      # the grace must exceed SDPA_DRAIN_TIMEOUT_S (30) + 9 s
#
# Where torch comes from (the build stage installs it first, alone):
# - TORCH_INDEX_URL (build arg): a pip index that serves torch. Default: the PyTorch index for
#   TORCH_VARIANT, https://download.pytorch.org/whl/<variant> (cpu, cu126, cu128, ...); point it
#   at a mirror of that index where download.pytorch.org is out of reach.
# - the build context named `torch-wheels`: a directory of wheels, for air-gapped builds and
#   machines that already hold the wheel. When it holds a torch wheel, pip installs torch from
#   it and TORCH_INDEX_URL is not used:
#     docker buildx build --build-context torch-wheels=/opt/wheels ...
#     buildah bud --build-context torch-wheels=/opt/wheels ...        (make image TORCH_WHEELS=DIR)
#   torch's own dependencies and the service's come from the directory too when it has them,
#   else from PIP_INDEX_URL (build arg, default PyPI: set it to your mirror). Fully offline:
#   fill the directory (`pip download` on a connected machine) and pass PIP_NO_INDEX=1.
# The build checks that the torch it installed is the TORCH_VARIANT build (a CPU image never
# ships a multi-GB CUDA torch by accident).
# The CUDA wheels carry their CUDA libraries, so the slim base only needs the host's driver
# (NVIDIA Container Toolkit, `docker run --gpus all`, or the compose `gpu` profile).
#
# Shutdown: on SIGTERM the server stops admitting work (readiness 503, new requests 503), finishes
# queued and in-flight requests within SDPA_DRAIN_TIMEOUT_S, lets responses flush and exits 0,
# at most SDPA_DRAIN_TIMEOUT_S + 8.85 s after the signal whatever clients do
# (service.server.worst_case_exit_s). `docker stop`'s default 10 s would SIGKILL a long drain:
# pass `-t 45` (or set stop_grace_period, as docker-compose.yml does, or
# terminationGracePeriodSeconds on Kubernetes).
#
# tests/deploy/test_container.py builds this file and runs the image (README: Operations).

ARG PYTHON_VERSION=3.11

# ---- torch-wheels: empty unless the build is given a directory of wheels (see above) --------
FROM scratch AS torch-wheels

# ---- deps: a virtual environment with torch and the dependencies, no code of ours -----------
FROM python:${PYTHON_VERSION}-slim AS deps

ARG TORCH_VERSION=2.13.0
ARG TORCH_VARIANT=cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_VARIANT}
ARG PIP_INDEX_URL=https://pypi.org/simple
ARG PIP_NO_INDEX=0
# A digest of the wheel directory's listing (make image sets it): buildah does not hash what a RUN
# mounts, so without it a build with other wheels (or none) would reuse the cached torch layer.
ARG TORCH_WHEELS_DIGEST=none

# PIP_FIND_LINKS: every pip below also looks in the wheel directory (mounted at build time only).
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_FIND_LINKS=/torch-wheels \
    PATH=/opt/venv/bin:$PATH

# torch first and alone: the largest layer, and it changes least often. Then out of the same
# layer: torch's C++ test binaries (torch/test, torch/bin/test_*): 80 MB; torch_shm_manager stays.
# torch's C++ headers (torch/include, 62 MB) move out of the venv to /opt/torch-include: the build
# stage compiles the CPU flash kernel against them, and the runtime, which copies /opt/venv
# alone, has neither them nor a compiler.
RUN --mount=type=bind,from=torch-wheels,target=/torch-wheels \
    python -m venv /opt/venv \
    && if ls /torch-wheels/torch-*.whl >/dev/null 2>&1; then \
        pip install --no-cache-dir "torch==${TORCH_VERSION}"; \
    else \
        pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"; \
    fi \
    && python -W ignore -c "import sys, torch; cpu = '${TORCH_VARIANT}' == 'cpu'; \
sys.exit(0 if (torch.version.cuda is None) == cpu else \
f'torch {torch.__version__} is not the ${TORCH_VARIANT} build')" \
    && site="$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/torch" \
    && mv "${site}/include" /opt/torch-include \
    && rm -rf "${site}/test" \
    && find "${site}/bin" -mindepth 1 -maxdepth 1 ! -name torch_shm_manager -exec rm -rf {} +

WORKDIR /src

# The remaining dependencies, read from pyproject.toml alone, so that editing the code does not
# invalidate this layer. torch is already satisfied, so pip does not fetch another build.
COPY pyproject.toml ./
RUN --mount=type=bind,from=torch-wheels,target=/torch-wheels \
    python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install --no-cache-dir -r /tmp/requirements.txt

# The venv also imports from /opt/app, where the next stage installs the code: the runtime copies
# this venv (0.85 GB) and /opt/app (< 1 MB) apart, so a change to the code rebuilds and stores only
# the small layer, and the big one is reused from the layer cache.
RUN echo /opt/app > "$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/sdpa-app.pth"

# ---- build: the package, on top of deps ------------------------------------------------------
FROM deps AS build

# A C++ compiler for the CPU flash kernel (sdpa_core/kernels/csrc), compiled below with torch's
# cpp_extension and the ninja from the venv; the runtime stage carries the built library alone:
# 0.4 MB, where a compiler at warm-up would add g++ (about 250 MB installed on Debian 12) and
# torch's headers (62 MB) to the image.
# torch's extension headers include Python.h: the official python images carry it, a base whose
# Python is Debian's (the stand-in base of scripts/make-stand-in-base.sh) needs python3-dev.
# hadolint ignore=DL3008
RUN include="$(python -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" \
    && headers="" \
    && { [ -e "${include}/Python.h" ] || headers="python3-dev"; } \
    && apt-get update \
    && apt-get install -y --no-install-recommends g++ ${headers:+"$headers"} \
    && rm -rf /var/lib/apt/lists/*

# The code last. --no-deps: everything it needs is in the venv. --target /opt/app: the package
# and its console scripts (sdpa-service, sdpa-loadtest; run by the venv's python) alone. The
# checks run the installed copy: the script from /opt/app/bin, and python -I, which leaves the
# working directory (/src, the sources) off sys.path. Then the CPU flash kernel is compiled
# into the installed package (sdpa_core/kernels/prebuilt/), where build() loads it at warm-up:
# no -march flag, so it runs on any x86-64 (its hot loops pick AVX-512, AVX2 or SSE2 at load).
COPY README.md ./
COPY sdpa_core ./sdpa_core
COPY sdpa_client ./sdpa_client
COPY service ./service
RUN pip install --no-cache-dir --no-deps --target /opt/app . \
    && PATH="/opt/app/bin:$PATH" sdpa-service --help >/dev/null \
    && python -I -c "import sdpa_core, sdpa_client, service.cli" \
    && ln -s /opt/torch-include "$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/torch/include" \
    && python -I -c "from sdpa_core.kernels import cpu_flash; print(cpu_flash.prebuild())" \
    && python -I -c "from sdpa_core.kernels import cpu_flash; import sys; ok, why = cpu_flash.build(); sys.exit(0 if ok and cpu_flash.loaded_from() == 'prebuilt' else why or 'not prebuilt')"

# ---- runtime: the virtual environment on a fresh slim base, as a non-root user -------------
FROM python:${PYTHON_VERSION}-slim AS runtime

LABEL org.opencontainers.image.title="sdpa-service" \
      org.opencontainers.image.description="Scaled dot-product attention as an HTTP service" \
      org.opencontainers.image.licenses="Apache-2.0"

RUN groupadd --system --gid 10001 sdpa \
    && useradd --system --uid 10001 --gid sdpa --no-create-home --home-dir /tmp \
        --shell /usr/sbin/nologin sdpa

COPY --from=deps /opt/venv /opt/venv
COPY --from=build /opt/app /opt/app

# HOME=/tmp: torch and friends may cache under $HOME; /tmp is the one writable place when the
# root filesystem is read-only (Kubernetes mounts an emptyDir there).
ENV PATH=/opt/app/bin:/opt/venv/bin:$PATH \
    HOME=/tmp \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    SDPA_PORT=8000 \
    SDPA_GRPC_PORT=8001 \
    SDPA_DRAIN_TIMEOUT_S=30

WORKDIR /tmp
USER 10001:10001

# HTTP (v1, v2 REST, probes, metrics) and gRPC (Open Inference Protocol; SDPA_GRPC_PORT=0: off)
EXPOSE 8000 8001
STOPSIGNAL SIGTERM
# Readiness, not liveness: "healthy" means warmed up and admitting work. The start period covers
# the warm-up (one real attention call on the device).
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD ["sdpa-service", "healthcheck"]
CMD ["sdpa-service", "serve", "--host", "0.0.0.0"]
