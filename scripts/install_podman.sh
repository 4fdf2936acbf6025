#!/usr/bin/env bash
# Installs rootful podman (+ podman-compose, mmdebstrap) from Debian and writes the
# containers.conf settings this machine kind needs. Idempotent: apt runs only when a
# package is missing, and the config drop-in is rewritten with the same content.
#
# Why these settings (each one's absence broke runs on this machine kind):
#   runtime = "runc"   crun fails on this machine's cgroup setup.
#   default_ulimits    podman's default nofile limit is above the hard limit a
#                      container may get here, so every run fails without it.
#   netavark           unlike CNI it resolves service names on `internal` networks,
#                      which compose.mooncake.yaml keeps Mooncake's listeners on.
set -euo pipefail

packages=(podman runc catatonit mmdebstrap podman-compose iptables netavark aardvark-dns)

missing=()
for pkg in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$pkg")
  fi
done
if ((${#missing[@]})); then
  echo "install_podman: installing ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

nofile=$(ulimit -Hn)
if [[ $nofile == unlimited ]]; then nofile=1048576; fi
mkdir -p /etc/containers/containers.conf.d
conf=/etc/containers/containers.conf.d/50-kvtag.conf
want=$(cat <<CONF
# Written by kvtag scripts/install_podman.sh; safe to delete.
[containers]
default_ulimits = ["nofile=${nofile}:${nofile}", "nproc=32768:32768"]

[engine]
runtime = "runc"

[network]
network_backend = "netavark"
CONF
)
if [[ ! -f $conf ]] || [[ "$(cat "$conf")" != "$want" ]]; then
  printf '%s\n' "$want" >"$conf"
  # A machine that ran podman with CNI before keeps CNI's default bridge, whose
  # 10.88.0.0/16 route shadows netavark's identical default network and cuts
  # containers off from DNS and the registries.
  if command -v ip >/dev/null && ip link show cni-podman0 >/dev/null 2>&1; then
    ip link delete cni-podman0
  fi
fi

podman --version >&2
