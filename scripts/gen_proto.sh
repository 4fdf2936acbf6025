#!/usr/bin/env bash
# Regenerates the Python stubs for proto/kvtag/v1/*.proto into OUT (default proto/python).
# The pinned grpcio-tools (requirements/constraints.txt) makes the output reproducible.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$here/proto/python}
py=${PYTHON:-$here/.venv/bin/python}
mkdir -p "$out"
"$py" -m grpc_tools.protoc -I "$here/proto" \
  --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  "$here"/proto/kvtag/v1/*.proto
