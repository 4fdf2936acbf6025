# `make soak`: the control plane's memory soak (benchmarks/soak_control_plane.py), outside `make test`
# (minutes): by default the issue's 100,000-RPC fuzz and three rounds of 20,000 abandoned namespaces (~12 min).
# SOAK_ARGS passes flags, e.g. SOAK_ARGS="--rpcs 30000 --abandon 5000".
# `make soak-arena-churn`: put throughput at full capacity (every put evicts), in process.
SOAK_ARGS ?=
.PHONY: soak soak-arena-churn
soak: $(STAMPS)/dev
	$(VENV)/bin/python benchmarks/soak_control_plane.py $(SOAK_ARGS)
soak-arena-churn: $(STAMPS)/dev
	$(VENV)/bin/python benchmarks/soak_arena_churn.py
