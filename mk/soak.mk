# `make soak`: the control plane's memory soak (benchmarks/soak_control_plane.py), outside `make test`
# (minutes). SOAK_ARGS passes flags, e.g. SOAK_ARGS="--rpcs 30000 --abandon 5000".
SOAK_ARGS ?=
.PHONY: soak
soak: $(STAMPS)/dev
	$(VENV)/bin/python benchmarks/soak_control_plane.py $(SOAK_ARGS)
