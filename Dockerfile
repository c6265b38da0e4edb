# syntax=docker/dockerfile:1
#
# sdpa-service image: one uvicorn worker, non-root, CPU torch by default.
#
#   docker build -t sdpa-service .                                   # CPU
#   docker build -t sdpa-service:cuda --build-arg TORCH_VARIANT=cu128 .   # CUDA wheels
#   docker run --rm -p 8000:8000 sdpa-service
#   docker stop -t 40 <container>      # the grace period must exceed SDPA_DRAIN_TIMEOUT_S (30)
#
# TORCH_VARIANT picks the wheel index https://download.pytorch.org/whl/<variant> (cpu, cu126,
# cu128, ...); the CUDA wheels carry their CUDA libraries, so the slim base only needs the
# host's driver (NVIDIA Container Toolkit, `docker run --gpus all`, or the compose `gpu` profile).
#
# Shutdown: on SIGTERM the server stops admitting work (readiness 503, new requests 503), finishes
# queued and in-flight requests within SDPA_DRAIN_TIMEOUT_S, lets responses flush (<= 5 s) and
# exits 0. `docker stop`'s default 10 s would SIGKILL a long drain: pass `-t 40` (or set
# stop_grace_period, as docker-compose.yml does, or terminationGracePeriodSeconds on Kubernetes).

ARG PYTHON_VERSION=3.11

# ---- build: a virtual environment with torch, the dependencies, then the package -------------
FROM python:${PYTHON_VERSION}-slim AS build

ARG TORCH_VERSION=2.13.0
ARG TORCH_VARIANT=cpu

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PATH=/opt/venv/bin:$PATH

# torch first and alone: the largest layer, and it changes least often.
RUN python -m venv /opt/venv \
    && pip install --no-cache-dir \
        --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}" \
        "torch==${TORCH_VERSION}"

WORKDIR /src

# The remaining dependencies, read from pyproject.toml alone, so that editing the code does not
# invalidate this layer. torch is already satisfied, so pip does not fetch another build.
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install --no-cache-dir -r /tmp/requirements.txt

# The code last. --no-deps: everything it needs is installed above.
COPY README.md ./
COPY sdpa_core ./sdpa_core
COPY sdpa_client ./sdpa_client
COPY service ./service
RUN pip install --no-cache-dir --no-deps . \
    && python -c "import sdpa_core, sdpa_client, service.cli"

# ---- runtime: the virtual environment on a fresh slim base, as a non-root user -------------
FROM python:${PYTHON_VERSION}-slim AS runtime

LABEL org.opencontainers.image.title="sdpa-service" \
      org.opencontainers.image.description="Scaled dot-product attention as an HTTP service" \
      org.opencontainers.image.licenses="Apache-2.0"

RUN groupadd --system --gid 10001 sdpa \
    && useradd --system --uid 10001 --gid sdpa --no-create-home --home-dir /tmp \
        --shell /usr/sbin/nologin sdpa

COPY --from=build /opt/venv /opt/venv

# HOME=/tmp: torch and friends may cache under $HOME; /tmp is the one writable place when the
# root filesystem is read-only (Kubernetes mounts an emptyDir there).
ENV PATH=/opt/venv/bin:$PATH \
    HOME=/tmp \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    SDPA_PORT=8000 \
    SDPA_DRAIN_TIMEOUT_S=30

WORKDIR /tmp
USER 10001:10001

EXPOSE 8000
STOPSIGNAL SIGTERM
# Readiness, not liveness: "healthy" means warmed up and admitting work. The start period covers
# the warm-up (one real attention call on the device).
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD ["sdpa-service", "healthcheck"]
CMD ["sdpa-service", "serve", "--host", "0.0.0.0"]
