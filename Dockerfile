# kvtag store service image. Two targets (and etcd for compose.mooncake-ha.yaml, below):
#   embedded (default, the last stage): the in-memory store only; the smallest image.
#   mooncake (`--target mooncake`): adds the Mooncake client wheel, its native libraries
#     and the mooncake_master / mooncake_client binaries, for `--backend mooncake` and
#     for the Mooncake master and storage node of compose.mooncake.yaml.
# Build with `podman build --format docker` so the HEALTHCHECK is kept (OCI images drop it).
# BASE_IMAGE is any Debian bookworm-based image with python3 (3.11) and its venv module;
# CI passes the local base made by scripts/build_base_image.sh.
ARG BASE_IMAGE=python:3.11-slim-bookworm

# ---- build: the service venv in /opt/kvtag ----
FROM ${BASE_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
# A pinned build backend in its own venv keeps the service venv free of build tools.
RUN python3 -m venv /opt/build \
 && /opt/build/bin/pip install --quiet setuptools==84.2.1
# Third-party dependencies first, read from the two pyproject.toml files (all pinned with
# ==), so this layer is rebuilt only when they change, not on every source edit.
COPY proto/pyproject.toml proto/pyproject.toml
COPY store_service/pyproject.toml store_service/pyproject.toml
RUN python3 -c "import tomllib; print('\n'.join(d for p in ('proto', 'store_service') \
      for d in tomllib.load(open(p + '/pyproject.toml', 'rb'))['project']['dependencies'] \
      if not d.startswith('kvtag-')))" >/tmp/requirements.txt \
 && python3 -m venv /opt/kvtag \
 && /opt/kvtag/bin/pip install --quiet --requirement /tmp/requirements.txt
COPY proto/ proto/
COPY store_service/ store_service/
RUN /opt/build/bin/pip wheel --quiet --no-build-isolation --no-deps --wheel-dir /wheels ./proto ./store_service \
 && /opt/kvtag/bin/pip install --quiet --no-deps /wheels/*.whl \
 && /opt/kvtag/bin/pip check \
 && /opt/kvtag/bin/python -m pip uninstall --quiet --yes pip setuptools \
 && find /opt/kvtag -name __pycache__ -prune -exec rm -rf {} +

# ---- build-mooncake: the Mooncake wheel, unpacked for copying into site-packages ----
FROM ${BASE_IMAGE} AS build-mooncake
# --no-deps: the wheel's declared Python deps (aiohttp, requests, msgpack) serve only its
# HTTP metadata server and helper scripts, which kvtag never uses (P2PHANDSHAKE mode);
# the 41 MB transfer_engine_bench binary is dropped too.
RUN python3 -m venv /opt/build \
 && /opt/build/bin/pip install --quiet --no-cache-dir --no-deps --target /opt/mooncake \
      mooncake-transfer-engine-non-cuda==0.3.13.post1 \
 && rm -rf /opt/mooncake/bin /opt/mooncake/mooncake/transfer_engine_bench

# ---- runtime: what both targets share ----
FROM ${BASE_IMAGE} AS runtime
RUN groupadd --gid 10001 kvtag \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin kvtag \
 && install -d -m 0700 -o 10001 -g 10001 /var/lib/kvtag
# The disk tier's directory (compose.yaml mounts a named volume here): Docker copies this ownership
# into a new named volume, podman gives it to the image's user anyway.
COPY --from=build /opt/kvtag /opt/kvtag
# Inside the container the service listens on all interfaces of the container's own
# network namespace, so that port publishing works; publish on the host's loopback
# only (`-p 127.0.0.1:50051:50051`), see docs/deployment.md. The service cannot see
# how the port is published, so without TLS and tokens it would refuse 0.0.0.0:
# KVTAG_INSECURE=1 keeps the plain image working (with a logged warning). With
# KVTAG_TLS_CERT/KVTAG_TLS_KEY/KVTAG_AUTH_TOKENS set (mounted files, docs/security.md)
# the flag has no effect; set KVTAG_INSECURE=0 to make a missing one fatal.
ENV PATH=/opt/kvtag/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    KVTAG_LISTEN=0.0.0.0:50051 \
    KVTAG_METRICS_LISTEN=0.0.0.0:9464 \
    KVTAG_INSECURE=1
EXPOSE 50051 9464
# Standard grpc.health.v1 Check against the port KVTAG_LISTEN names.
HEALTHCHECK --interval=10s --timeout=5s --start-period=10s --retries=3 \
  CMD ["/bin/sh", "-c", "kvtag-store health --target \"127.0.0.1:${KVTAG_LISTEN##*:}\" || exit 1"]
STOPSIGNAL SIGTERM
USER 10001:10001
WORKDIR /tmp
ENTRYPOINT ["kvtag-store"]
CMD ["serve"]

# ---- target mooncake ----
FROM runtime AS mooncake
USER 0:0
# Runtime libraries the wheel's native modules link against (see `ldd store.so`).
# Not version-pinned: Debian security updates replace these in place, and a pin would
# break the build the day an update lands; the release (bookworm) fixes the ABI.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends libibverbs1 libnuma1 libcurl4 \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build-mooncake /opt/mooncake /opt/kvtag/lib/python3.11/site-packages/
RUN ln -s /opt/kvtag/lib/python3.11/site-packages/mooncake/mooncake_master /usr/local/bin/mooncake_master \
 && ln -s /opt/kvtag/lib/python3.11/site-packages/mooncake/mooncake_client /usr/local/bin/mooncake_client
USER 10001:10001

# ---- target etcd: Debian's etcd-server (3.4), for compose.mooncake-ha.yaml ----
# Built locally because no container registry but the package indexes is reachable where kvtag is
# tested (quay.io's etcd image is not). Not version-pinned: the release (bookworm) fixes 3.4.
# The package creates an `etcd` system user; it gets a fixed uid so USER can be numeric, and owns
# /etcd-data so a named volume mounted there is writable (etcd wants the data dir 0700).
FROM ${BASE_IMAGE} AS etcd
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends etcd-server \
 && rm -rf /var/lib/apt/lists/* \
 && groupmod --gid 10003 etcd \
 && usermod --uid 10003 --gid 10003 etcd \
 && chown -R 10003:10003 /var/lib/etcd \
 && install -d -m 0700 -o 10003 -g 10003 /etcd-data
USER 10003:10003
WORKDIR /etcd-data
EXPOSE 2379
CMD ["etcd", "--data-dir=/etcd-data", "--listen-client-urls=http://0.0.0.0:2379", \
     "--advertise-client-urls=http://127.0.0.1:2379"]

# ---- target embedded (the default: the last stage) ----
FROM runtime AS embedded
