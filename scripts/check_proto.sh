#!/usr/bin/env bash
# Fails when the committed stubs differ from what the pinned protoc generates now.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
"$here/scripts/gen_proto.sh" "$scratch"
status=0
for f in "$scratch"/kvtag/v1/*; do
  rel=${f#"$scratch"/}
  if ! diff -u "$here/proto/python/$rel" "$f"; then
    echo "proto-check: proto/python/$rel is stale; run 'make proto' and commit the result" >&2
    status=1
  fi
done
exit $status
