#!/usr/bin/env bash
# Builds the local Debian bookworm base image (python3 3.11 + venv + CA certificates)
# that CI passes to the Dockerfile as BASE_IMAGE, because no container registry is
# reachable here. Cached: does nothing when the image already exists.
#
# The host's CA bundle is copied in (and pip is pointed at it) so that pip and apt
# inside `podman build` trust the same TLS roots the host does.
set -euo pipefail

image=${KVTAG_BASE_IMAGE:-localhost/kvtag-base:bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
security_mirror=${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}

if podman image exists "$image"; then
  echo "build_base_image: $image exists, skipping" >&2
  exit 0
fi

echo "build_base_image: building $image with mmdebstrap" >&2
# The mmdebstrap hooks run on the host with the new root as $1; the tarball goes to
# stdout and straight into `podman import`.
# merged-usr hook: sets up the merged /usr layout without the usrmerge package (which
# would pull in perl). The path excludes drop docs, man pages and translations.
# shellcheck disable=SC2016 # mmdebstrap expands $1 (the new root) in each hook itself
mmdebstrap --quiet --variant=minbase --mode=root --format=tar \
  --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
  --dpkgopt='path-exclude=/usr/share/man/*' \
  --dpkgopt='path-exclude=/usr/share/locale/*' \
  --dpkgopt='path-include=/usr/share/locale/locale.alias' \
  --dpkgopt='path-exclude=/usr/share/doc/*' \
  --dpkgopt='path-include=/usr/share/doc/*/copyright' \
  --dpkgopt='path-exclude=/usr/share/info/*' \
  --include=python3,python3-venv,ca-certificates \
  --customize-hook='cp /etc/ssl/certs/ca-certificates.crt "$1/etc/ssl/certs/ca-certificates.crt"' \
  --customize-hook='printf "[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n" >"$1/etc/pip.conf"' \
  --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin' \
  bookworm - \
  "deb $mirror bookworm main" \
  "deb $mirror bookworm-updates main" \
  "deb $security_mirror bookworm-security main" |
  podman import \
    --change 'CMD ["/usr/bin/python3"]' \
    --change 'ENV LANG=C.UTF-8' \
    --message "kvtag local base: Debian bookworm minbase + python3 + CA certificates" \
    - "$image" >/dev/null

podman image ls "$image" >&2
