#!/usr/bin/env bash
# Installs Redis 7 (Debian's redis-server) for the benchmark's reference column, if missing.
# The benchmark starts its own redis-server on 127.0.0.1; the package's service is not used.
set -euo pipefail
if command -v redis-server >/dev/null 2>&1; then
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
# policy-rc.d 101: the package must not start a system-wide redis on port 6379.
policy=/usr/sbin/policy-rc.d
restore=""
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' > "$policy"
  chmod +x "$policy"
  restore=1
fi
apt-get install -y -q --no-install-recommends redis-server
if [ -n "$restore" ]; then
  rm -f "$policy"
fi
redis-server --version
