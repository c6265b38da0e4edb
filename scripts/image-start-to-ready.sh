#!/usr/bin/env bash
# image-start-to-ready.sh: seconds from starting the image's CMD to /readyz answering 200 (torch
# import, app start, warm-up on the device), then SIGTERM to exit; N runs (default 3).
#
#   sudo scripts/image-start-to-ready.sh [IMAGE] [N]      # IMAGE: localhost/sdpa-service:latest
#
# Runs under `buildah run --isolation chroot --network host` as the image's USER, on a free
# loopback port (SDPA_PORT), with the CMD's --host 0.0.0.0 swapped for 127.0.0.1 (a shared
# machine). Polls /readyz every 50 ms. BENCHMARKS.md ("The container image") quotes it.
set -euo pipefail

IMAGE="${1:-localhost/sdpa-service:latest}"
RUNS="${2:-3}"
command -v buildah >/dev/null 2>&1 || { echo "buildah is not installed" >&2; exit 2; }
command -v curl >/dev/null 2>&1 || { echo "curl is not installed" >&2; exit 2; }

ctr="$(buildah from --quiet --pull-never "$IMAGE")"
runner=""
cleanup() {
  [ -z "$runner" ] || kill "$runner" 2>/dev/null || true
  buildah rm "$ctr" >/dev/null 2>&1 || true
}
trap cleanup EXIT

# The image's own CMD, read from its config, with the bind address swapped.
mapfile -t cmd < <(buildah inspect --type image --format '{{range .Docker.Config.Cmd}}{{println .}}{{end}}' "$IMAGE" | sed '/^$/d')
for i in "${!cmd[@]}"; do
  [ "${cmd[$i]}" != "0.0.0.0" ] || cmd[i]="127.0.0.1"
done
port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"

for run in $(seq 1 "$RUNS"); do
  start=$(date +%s.%N)
  buildah run --isolation chroot --network host -e "SDPA_PORT=$port" "$ctr" -- "${cmd[@]}" \
    >/dev/null 2>&1 &
  runner=$!
  ready=""
  for _ in $(seq 1 2400); do
    if curl -sf -o /dev/null "http://127.0.0.1:$port/readyz"; then
      ready=$(date +%s.%N)
      break
    fi
    kill -0 "$runner" 2>/dev/null || break
    sleep 0.05
  done
  [ -n "$ready" ] || { echo "run $run: never ready" >&2; exit 1; }
  # SIGTERM to the serving process itself (buildah does not forward it): the uid-10001 python.
  service="$(pgrep -u 10001 -f -n -- "python .*sdpa-service serve")"
  killed=$(date +%s.%N)
  kill -TERM "$service"
  status=0
  wait "$runner" || status=$?
  stopped=$(date +%s.%N)
  runner=""
  python3 -c "import sys; s, r, k, e = map(float, sys.argv[1:5]); \
print(f'run {sys.argv[5]}: start to ready {r - s:.2f} s, SIGTERM to exit {e - k:.2f} s, exit {sys.argv[6]}')" \
    "$start" "$ready" "$killed" "$stopped" "$run" "$status"
done
