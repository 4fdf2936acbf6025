#!/usr/bin/env bash
# Installs what the Mooncake backend needs (idempotent): libibverbs1 and the tools for a private
# network namespace and etcd (master HA) from apt, and the pinned non-CUDA wheel into .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
VERSION=0.3.13.post1

need_apt=()
ldconfig -p | grep -q 'libibverbs\.so\.1' || need_apt+=(libibverbs1)
command -v ip >/dev/null || need_apt+=(iproute2)
command -v unshare >/dev/null || need_apt+=(util-linux)
command -v etcd >/dev/null || need_apt+=(etcd-server) # master HA (tests/mooncake/mooncake_ha.py)
if ((${#need_apt[@]})); then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}"
fi
if [[ "$("$VENV/bin/pip" show mooncake-transfer-engine-non-cuda 2>/dev/null | sed -n 's/^Version: //p')" != "$VERSION" ]]; then
  "$VENV/bin/pip" install -q -c requirements/constraints.txt "mooncake-transfer-engine-non-cuda==$VERSION"
fi
