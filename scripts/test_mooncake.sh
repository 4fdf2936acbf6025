#!/usr/bin/env bash
# The Mooncake suite: installs what it needs (idempotent), then runs every Mooncake process
# (master, storage, kvtag replicas, test clients) inside a private network namespace where only
# loopback exists, because Mooncake's transfer engine listens on all interfaces.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
scripts/install_mooncake.sh

export GLOG_minloglevel="${GLOG_minloglevel:-2}"
# shellcheck disable=SC2016 # the inner bash expands $0 (the venv's python) and $@ (pytest's args)
exec unshare -n -- bash -c 'ip link set lo up && exec "$0" -m pytest -q -p no:cacheprovider --timeout=120 "$@" tests/mooncake' \
  "$VENV/bin/python" "$@"
