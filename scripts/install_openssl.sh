#!/usr/bin/env bash
# The TLS tests make real certificates with Debian's openssl; install it if this machine lacks it.
set -euo pipefail
if ! command -v openssl >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends openssl >/dev/null
fi
