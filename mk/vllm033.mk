# vLLM 0.33: the connector suite against 0.33's real Scheduler, in its own environment. 0.33 ships
# only as a CUDA build; its wheel installed with --no-deps over the CPU torch of the 0.32 lock
# imports the scheduler and the connector API without a GPU (docs/vllm-versions.md says why).
VLLM033_VENV := .venv-vllm033
VLLM033_LOCK := requirements/vllm-0.33.0-cpu-lock.txt

.PHONY: test-connector-033 test-gpu

$(STAMPS)/vllm033: $(VLLM033_LOCK) client/pyproject.toml proto/pyproject.toml requirements/constraints.txt
	@mkdir -p $(STAMPS)
	test -x $(VLLM033_VENV)/bin/python || $(PY) -m venv $(VLLM033_VENV)
	$(VLLM033_VENV)/bin/pip install -q --no-deps -r $(VLLM033_LOCK)
	$(VLLM033_VENV)/bin/pip install -q --no-deps -e proto -e client
	$(VLLM033_VENV)/bin/pip install -q $(PIN) grpcio-status==1.85.3 googleapis-common-protos==1.76.0 xxhash==4.1.0 \
	  pytest==9.2.0 pytest-timeout==2.4.0 hypothesis==6.170.17 pytest-cov==7.1.0 coverage==7.17.3
	touch $@

# The same connector suite as test-connector (tests/connector, tests/client_vllm), on vLLM 0.33.
test-connector-033: $(STAMPS)/vllm033 $(STAMPS)/service
	$(VLLM033_VENV)/bin/pytest -q --cov=kvtag_client $(COV) tests/connector tests/client_vllm

EXTRA_TESTS += test-connector-033

# The GPU suite (tests/gpu): vLLM 0.33 with its CUDA requirements, as `pip install vllm` gives it,
# in .venv-gpu. Part of `make test` only where nvidia-smi lists a device; elsewhere it is one line.
GPU_VENV := .venv-gpu
HAS_GPU := $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU' && echo yes)

$(STAMPS)/gpu: client/pyproject.toml proto/pyproject.toml requirements/constraints.txt
	@mkdir -p $(STAMPS)
	test -x $(GPU_VENV)/bin/python || $(PY) -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/pip install -q vllm==0.33.0
	$(GPU_VENV)/bin/pip install -q --no-deps -e proto -e client
	$(GPU_VENV)/bin/pip install -q $(PIN) grpcio-status==1.85.3 googleapis-common-protos==1.76.0 xxhash==4.1.0 \
	  pytest==9.2.0 pytest-timeout==2.4.0
	touch $@

ifeq ($(HAS_GPU),yes)
test-gpu: $(STAMPS)/gpu $(STAMPS)/service
	$(GPU_VENV)/bin/pytest -q -s tests/gpu
EXTRA_TESTS += test-gpu
else
test-gpu:
	@echo "test-gpu: skipped, no CUDA device here (nvidia-smi lists none)"
endif
