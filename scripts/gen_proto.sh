#!/usr/bin/env bash
# Regenerates cosyvoice/wire/chunk_pb.py from proto/chunk.proto with betterproto's protoc plugin.
# Needs the dev extra: pip install -e '.[dev]'
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
python -m grpc_tools.protoc -I "$root/proto" --python_betterproto_out="$out" "$root/proto/chunk.proto"
cp "$out/cosyvoice.py" "$root/cosyvoice/wire/chunk_pb.py"
echo "wrote cosyvoice/wire/chunk_pb.py"
