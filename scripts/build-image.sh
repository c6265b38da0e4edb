#!/usr/bin/env bash
# build-image.sh: build the Dockerfile with whichever of docker, podman or buildah works here
# (`make image` calls it). Settings come from the environment:
#
#   IMAGE           the tag to build (default localhost/sdpa-service:latest)
#   TORCH_VARIANT   cpu (default), cu126, cu128, ...: which torch build (Dockerfile build arg)
#   TORCH_INDEX_URL a pip index serving torch (default: the PyTorch index for TORCH_VARIANT)
#   TORCH_WHEELS    a directory of wheels (at least torch's) to install torch from instead:
#                   given to the build as the `torch-wheels` build context
#   PIP_INDEX_URL   the index for everything else (default: PyPI; set it to your mirror)
#   PIP_NO_INDEX    1: no index at all, TORCH_WHEELS holds every wheel (air-gapped)
#   CONTAINER_TOOL  docker | podman | buildah (default: the first that works, in that order)
#   STAND_IN_BASE   auto (default): when the base image python:3.11-slim cannot be pulled and a
#                   Debian mirror can be reached, build on a stand-in made by
#                   scripts/make-stand-in-base.sh (said loudly); never: fail instead
#   HOST_CA_CERTS   a directory mounted at /etc/ssl/certs during the build's RUN steps (podman
#                   and buildah only), so that pip trusts what the host trusts, e.g. a
#                   TLS-intercepting proxy's CA. Default /etc/ssl/certs when the build runs on
#                   the stand-in base (Debian's pip reads that store); empty: no mount
#   BUILD_FLAGS     extra flags for the build command
#
# docker and podman need a working engine/runtime; buildah builds with --isolation chroot, which
# works where neither does (no daemon, no user namespaces, no rlimits).
#
# The build stage installs g++ from the base image's Debian mirror (apt-get) to compile the CPU
# flash kernel, which the image then carries prebuilt: an air-gapped build needs that mirror (or
# a local copy of it) as well as the wheels.
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE="${IMAGE:-localhost/sdpa-service:latest}"
TORCH_VARIANT="${TORCH_VARIANT:-cpu}"
STAND_IN_BASE="${STAND_IN_BASE:-auto}"
BASE="python:$(sed -n 's/^ARG PYTHON_VERSION=//p' Dockerfile | head -n 1)-slim"

say() { printf 'build-image: %s\n' "$*" >&2; }

works() {
  case "$1" in
    docker) command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1 ;;
    # podman answers `info` even where its runtime cannot start a container: try one.
    podman) command -v podman >/dev/null 2>&1 \
      && podman run --rm --network none "$BASE" true >/dev/null 2>&1 ;;
    buildah) command -v buildah >/dev/null 2>&1 ;;
    *) return 1 ;;
  esac
}

tool="${CONTAINER_TOOL:-}"
if [ -z "$tool" ]; then
  for candidate in docker podman buildah; do
    if works "$candidate"; then
      tool="$candidate"
      break
    fi
  done
fi
[ -n "$tool" ] || { say "none of docker, podman, buildah works here"; exit 2; }

has_image() {
  case "$tool" in
    docker) docker image inspect "$1" >/dev/null 2>&1 ;;
    *) "$tool" image exists "$1" 2>/dev/null || buildah inspect --type image "$1" >/dev/null 2>&1 ;;
  esac
}

stand_in=0
if ! has_image "$BASE" && ! "$tool" pull "$BASE" >/dev/null 2>&1; then
  if [ "$tool" = docker ] || [ "$STAND_IN_BASE" = never ]; then
    say "the base image $BASE cannot be pulled"
    exit 1
  fi
  say "the base image $BASE cannot be pulled: using a STAND-IN (scripts/make-stand-in-base.sh)"
  scripts/make-stand-in-base.sh "localhost/$BASE"
  stand_in=1
elif has_image "localhost/$BASE" && ! has_image "docker.io/library/$BASE"; then
  stand_in=1
fi
if [ "$stand_in" -eq 1 ]; then
  say "!!! building $IMAGE on the STAND-IN base localhost/$BASE, not the official $BASE !!!"
fi

args=(--build-arg "TORCH_VARIANT=$TORCH_VARIANT")
[ -z "${TORCH_INDEX_URL:-}" ] || args+=(--build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL")
[ -z "${PIP_INDEX_URL:-}" ] || args+=(--build-arg "PIP_INDEX_URL=$PIP_INDEX_URL")
[ -z "${PIP_NO_INDEX:-}" ] || args+=(--build-arg "PIP_NO_INDEX=$PIP_NO_INDEX")
if [ -n "${TORCH_WHEELS:-}" ]; then
  [ -d "$TORCH_WHEELS" ] || { say "TORCH_WHEELS=$TORCH_WHEELS is not a directory"; exit 2; }
  args+=(--build-context "torch-wheels=$(cd "$TORCH_WHEELS" && pwd)")
  # Names and sizes of the wheels: a different set rebuilds the torch layer (see the Dockerfile).
  digest="$(find "$TORCH_WHEELS" -maxdepth 1 -name '*.whl' -printf '%f %s\n' | sort | sha256sum)"
  args+=(--build-arg "TORCH_WHEELS_DIGEST=${digest:0:16}")
fi

ca_certs="${HOST_CA_CERTS-}"
if [ -z "${HOST_CA_CERTS+set}" ] && [ "$stand_in" -eq 1 ]; then
  ca_certs=/etc/ssl/certs
fi

# shellcheck disable=SC2206  # BUILD_FLAGS is a list of flags, split on purpose
extra=(${BUILD_FLAGS:-})
start=$(date +%s)
case "$tool" in
  docker)
    DOCKER_BUILDKIT=1 docker build "${args[@]}" "${extra[@]}" -t "$IMAGE" . ;;
  podman | buildah)
    [ -z "$ca_certs" ] || args+=(-v "$ca_certs:/etc/ssl/certs:ro")
    # --format docker: the OCI format has no HEALTHCHECK and would drop it.
    # --layers: reuse the torch and dependency layers from an earlier build; --force-rm: a failed
    # build leaves no working containers behind.
    if [ "$tool" = buildah ]; then
      args+=(--isolation chroot --network host)
    fi
    "$tool" build --format docker --layers --force-rm "${args[@]}" "${extra[@]}" -t "$IMAGE" . ;;
esac
say "built $IMAGE with $tool in $(( $(date +%s) - start )) s"
