#!/usr/bin/env bash
# `make test-status`: the status page in a real headless browser (Debian's chromium, installed
# here when missing). Screenshots land in tests/artifacts/ (gitignored), kept for a person to look at.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v chromium >/dev/null; then
  echo "test_status: installing chromium" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends chromium >/dev/null
fi
chromium --version >&2
mkdir -p tests/artifacts
exec .venv/bin/pytest -q tests/status "$@"
