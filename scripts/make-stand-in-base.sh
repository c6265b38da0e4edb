#!/usr/bin/env bash
# make-stand-in-base.sh: a STAND-IN for the Dockerfile's base image python:3.11-slim, for machines
# that cannot pull it (no registry access) but can reach a Debian mirror.
#
#   sudo scripts/make-stand-in-base.sh [--force] [IMAGE]     # IMAGE: localhost/python:3.11-slim
#
# It is NOT the official image: Debian bookworm's own python3 (3.11, in /usr/bin) with
# python3-venv and ca-certificates, built with debootstrap from the machine's configured Debian
# mirror (DEBIAN_MIRROR overrides), a `python` link beside python3, committed with buildah.
# The Dockerfile only needs what both have in common: `python -m venv`, groupadd/useradd, and
# a Python 3.11 ABI so that cp311 wheels (torch) install. Images built on it are for testing
# on such machines; publish images built on the real base. They inherit the label
# io.github.sdpa-service.stand-in-base, so that such an image says what it was built on.
#
# The root filesystem is kept as a tarball in $SDPA_CACHE_DIR (default ~/.cache/sdpa-service),
# so that a fresh buildah store (a new CI runner with a warm cache) imports it in seconds
# instead of running debootstrap again (minutes).
#
# Needs root, buildah and debootstrap (Debian: apt-get install buildah debootstrap).
set -euo pipefail

force=0
if [ "${1:-}" = "--force" ]; then
  force=1
  shift
fi
IMAGE="${1:-localhost/python:3.11-slim}"
SUITE="${DEBIAN_SUITE:-bookworm}"
CACHE_DIR="${SDPA_CACHE_DIR:-${HOME:-/root}/.cache/sdpa-service}"
TARBALL="$CACHE_DIR/stand-in-base-$SUITE.tar"

say() { printf '%s\n' "$*" >&2; }

work=""
ctr=""
cleanup() {
  [ -z "$ctr" ] || buildah rm "$ctr" >/dev/null 2>&1 || true
  [ -z "$work" ] || rm -rf "$work"
}
trap cleanup EXIT

loud() {
  say "================================================================================"
  say "  STAND-IN BASE IMAGE: $IMAGE"
  say "  This is NOT the official python:3.11-slim. It is Debian $SUITE's python3 made"
  say "  with debootstrap, for building and testing where the real base cannot be pulled."
  say "  Do not publish images built on it; build release images on the real base."
  say "================================================================================"
}

[ "$(id -u)" -eq 0 ] || { say "make-stand-in-base: needs root (debootstrap, buildah's store)"; exit 2; }
for tool in buildah debootstrap tar; do
  command -v "$tool" >/dev/null 2>&1 || { say "make-stand-in-base: $tool is not installed"; exit 2; }
done

if [ "$force" -eq 0 ] && buildah inspect --type image "$IMAGE" >/dev/null 2>&1; then
  say "make-stand-in-base: $IMAGE already exists (stand-in); --force rebuilds it"
  exit 0
fi

loud

# The machine's own Debian mirror (apt's configuration), so that this works behind a mirror.
mirror="${DEBIAN_MIRROR:-}"
if [ -z "$mirror" ]; then
  mirror="$(grep -h -E '^[[:space:]]*(URIs:|deb[[:space:]])' /etc/apt/sources.list \
      /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list 2>/dev/null \
    | grep -o -E '(https?|file)://[^[:space:]]+' | grep -v -E 'security' \
    | grep -E '/debian/?$' | head -n 1 || true)"
fi
mirror="${mirror:-http://deb.debian.org/debian}"

if [ "$force" -eq 1 ] || [ ! -s "$TARBALL" ]; then
  say "make-stand-in-base: debootstrap $SUITE from $mirror (a few minutes)"
  work="$(mktemp -d)"
  root="$work/root"
  # minbase: dpkg, apt, coreutils and passwd (groupadd/useradd) without the rest of a system.
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    "$SUITE" "$root" "$mirror" >"$work/debootstrap.log" 2>&1 \
    || { tail -n 30 "$work/debootstrap.log" >&2; exit 1; }
  # The official image has `python`; the Dockerfile calls it.
  ln -sf python3 "$root/usr/bin/python"
  # What the slim image does not carry either: package lists, caches, docs.
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb \
    "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/locale/*
  mkdir -p "$CACHE_DIR"
  tar --numeric-owner -C "$root" -cf "$TARBALL.part" .
  mv "$TARBALL.part" "$TARBALL"
else
  say "make-stand-in-base: reusing the cached root filesystem $TARBALL"
fi

ctr="$(buildah from --quiet scratch)"
buildah add --quiet "$ctr" "$TARBALL" / >/dev/null
buildah config \
  --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  --env LANG=C.UTF-8 \
  --cmd python3 \
  --label org.opencontainers.image.title="STAND-IN for python:3.11-slim (Debian $SUITE python3)" \
  --label "io.github.sdpa-service.stand-in-base=debootstrap $SUITE" \
  "$ctr"
buildah commit --quiet --rm "$ctr" "$IMAGE" >/dev/null
ctr=""
loud
check="$(buildah from --quiet "$IMAGE")"
version="$(buildah run --isolation chroot "$check" python --version 2>&1 || true)"
buildah rm "$check" >/dev/null
say "make-stand-in-base: $IMAGE is ready ($version)"
