# kvtag store service image. Two targets:
#   embedded (default, last stage): the in-memory store only; smallest image.
#   mooncake: adds the Mooncake client wheel, its native libraries and the
#             mooncake_master / mooncake_client binaries, for `--backend mooncake`
#             and for running the Mooncake master and storage node of compose.mooncake.yaml.
# Build with `podman build --format docker` so the HEALTHCHECK is kept (OCI images drop it).
# BASE_IMAGE is any Debian-based image with python3 (3.11) and its venv module;
# CI passes the local base made by scripts/build_base_image.sh.
ARG BASE_IMAGE=python:3.11-slim

# ---- build: wheels of the two local distributions, installed into /opt/kvtag ----
FROM ${BASE_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
# A pinned build backend in its own venv keeps the service venv free of build tools.
RUN python3 -m venv /opt/build \
 && /opt/build/bin/pip install --quiet setuptools==84.2.1
COPY proto/ proto/
COPY store_service/ store_service/
RUN /opt/build/bin/pip wheel --quiet --no-build-isolation --no-deps --wheel-dir /wheels ./proto ./store_service
# Every runtime dependency is pinned with == in the two pyproject.toml files, so the
# resolved set is fixed; pip and setuptools are removed from the final venv.
RUN python3 -m venv /opt/kvtag \
 && /opt/kvtag/bin/pip install --quiet /wheels/*.whl \
 && /opt/kvtag/bin/python -m pip uninstall --quiet --yes pip setuptools \
 && find /opt/kvtag -name __pycache__ -prune -exec rm -rf {} +

# ---- build-mooncake: the Mooncake wheel, unpacked beside the service venv ----
FROM build AS build-mooncake
# --no-deps: the wheel's declared Python deps (aiohttp, requests, msgpack) serve only its
# HTTP metadata server and helper scripts, which kvtag never uses (P2PHANDSHAKE mode);
# the 41 MB transfer_engine_bench binary is dropped too.
RUN /opt/build/bin/pip install --quiet --no-deps --target /opt/mooncake \
      mooncake-transfer-engine-non-cuda==0.3.13.post1 \
 && rm -rf /opt/mooncake/bin /opt/mooncake/mooncake/transfer_engine_bench

# ---- runtime: what both targets share ----
FROM ${BASE_IMAGE} AS runtime
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin kvtag
COPY --from=build /opt/kvtag /opt/kvtag
# Inside the container the service listens on all interfaces of the container's own
# network namespace, so that port publishing works; publish on the host's loopback
# only (`-p 127.0.0.1:50051:50051`), see docs/deployment.md.
ENV PATH=/opt/kvtag/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    KVTAG_LISTEN=0.0.0.0:50051 \
    KVTAG_METRICS_LISTEN=0.0.0.0:9464
EXPOSE 50051 9464
# Standard grpc.health.v1 Check against the port KVTAG_LISTEN names.
HEALTHCHECK --interval=10s --timeout=5s --start-period=10s --retries=3 \
  CMD kvtag-store health --target "127.0.0.1:${KVTAG_LISTEN##*:}" || exit 1
STOPSIGNAL SIGTERM
USER kvtag
WORKDIR /tmp
ENTRYPOINT ["kvtag-store"]
CMD ["serve"]

# ---- mooncake target ----
FROM runtime AS mooncake
USER root
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
ENV KVTAG_BACKEND=mooncake
USER kvtag

# ---- embedded target (default: last stage) ----
FROM runtime AS embedded
