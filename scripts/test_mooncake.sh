#!/usr/bin/env bash
# The Mooncake suite: installs what it needs (idempotent), then runs every Mooncake process
# (master, storage, kvtag replicas, test clients) inside a private network namespace where only
# loopback exists, because Mooncake's transfer engine listens on all interfaces.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
WHEEL=mooncake-transfer-engine-non-cuda==0.3.13.post1

need_apt=()
ldconfig -p | grep -q 'libibverbs\.so\.1' || need_apt+=(libibverbs1)
command -v ip >/dev/null || need_apt+=(iproute2)
command -v unshare >/dev/null || need_apt+=(util-linux)
if ((${#need_apt[@]})); then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}"
fi
if ! "$VENV/bin/pip" show -q mooncake-transfer-engine-non-cuda 2>/dev/null \
   || [[ "$("$VENV/bin/pip" show mooncake-transfer-engine-non-cuda | sed -n 's/^Version: //p')" != 0.3.13.post1 ]]; then
  "$VENV/bin/pip" install -q "$WHEEL"
fi

export GLOG_minloglevel="${GLOG_minloglevel:-2}"
exec unshare -n -- bash -c 'ip link set lo up && exec "$0" -m pytest -q -p no:cacheprovider --import-mode=importlib --timeout=120 "$@" tests/mooncake' \
  "$VENV/bin/python" "$@"
