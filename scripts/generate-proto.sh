#!/usr/bin/env bash
# Regenerate the gRPC door's protobuf code (service/wire/grpc/grpc_predict_v2_pb2.py and .pyi)
# from service/wire/grpc/grpc_predict_v2.proto. `make proto` calls it.
#
#   scripts/generate-proto.sh            # rewrite the committed files
#   scripts/generate-proto.sh --check    # regenerate into a temporary folder and compare: exit 1
#                                        # when the committed files differ (CI, review)
#
# The generator is pinned (grpcio-tools 1.76.0 bundles protoc with protobuf 6.31.1 gencode, which
# runs on any protobuf runtime >= 6.31.1 < 7) and installed into a throwaway venv, so the output
# depends on nothing installed in .venv and is the same byte for byte on every machine.
#
# One edit after protoc: the module builds its descriptors into a PRIVATE pool rather than
# protobuf's default one. tritonclient.grpc's own service_pb2 declares the same package
# ("inference") and message names in the default pool; two files defining inference.* there
# clash when both are imported in one process (the tests and any user of tritonclient beside
# this service do). Nothing of ours looks a message up by name in the default pool.
set -euo pipefail

GRPC_TOOLS_VERSION="1.76.0"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PROTO_DIR="$ROOT/service/wire/grpc"
PROTO="grpc_predict_v2.proto"
GENERATED=(grpc_predict_v2_pb2.py grpc_predict_v2_pb2.pyi)
PYTHON="${PYTHON:-python3}"

check=false
case "${1:-}" in
  "") ;;
  --check) check=true ;;
  *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

"$PYTHON" -m venv "$work/venv"
"$work/venv/bin/pip" install -q --disable-pip-version-check "grpcio-tools==$GRPC_TOOLS_VERSION"

mkdir -p "$work/out"
# -I the proto's own folder: the generated module names its source "grpc_predict_v2.proto".
"$work/venv/bin/python" -m grpc_tools.protoc -I "$PROTO_DIR" \
  --python_out="$work/out" --pyi_out="$work/out" "$PROTO_DIR/$PROTO"
sed -i 's/_descriptor_pool.Default().AddSerializedFile/_descriptor_pool.DescriptorPool().AddSerializedFile/' \
  "$work/out/grpc_predict_v2_pb2.py"
if ! grep -q '_descriptor_pool.DescriptorPool().AddSerializedFile' "$work/out/grpc_predict_v2_pb2.py"; then
  echo "generate-proto: the private-pool edit found nothing to replace (protoc's output changed?)" >&2
  exit 1
fi

if $check; then
  status=0
  for name in "${GENERATED[@]}"; do
    if ! cmp -s "$work/out/$name" "$PROTO_DIR/$name"; then
      echo "generate-proto: service/wire/grpc/$name differs from what $PROTO generates" >&2
      status=1
    fi
  done
  [ "$status" -eq 0 ] && echo "generate-proto: the committed files are what $PROTO generates"
  exit "$status"
fi

for name in "${GENERATED[@]}"; do
  cp "$work/out/$name" "$PROTO_DIR/$name"
done
echo "generate-proto: wrote ${GENERATED[*]/#/service/wire/grpc/}"
