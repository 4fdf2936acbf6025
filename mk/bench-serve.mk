# make bench-serve: kvtag against vLLM's MooncakeStoreConnector and against no store, served by `vllm serve`
# and driven by `vllm bench serve` (benchmarks/bench_serve.py; docs/serving-benchmark.md).
# The whole run, Mooncake cluster and every server, is inside one private network namespace (unshare -n).
.PHONY: bench-serve bench-serve-quick
BENCH_SERVE := $(VLLM_VENV)/bin/python benchmarks/bench_serve.py

# The peer imports Mooncake in the engine's own environment; the plot needs matplotlib (pins and why: the file).
$(STAMPS)/bench-serve: $(STAMPS)/vllm requirements/bench-serve.txt
	scripts/install_mooncake.sh
	$(VLLM_VENV)/bin/pip install -q --no-deps -r requirements/bench-serve.txt
	touch $@

bench-serve: $(STAMPS)/bench-serve $(STAMPS)/dev
	$(BENCH_SERVE) --out benchmarks/results/serve.json --plot docs/serve.png

# One scenario (cross-engine) per system, a small load; writes outside the repo.
bench-serve-quick: $(STAMPS)/bench-serve $(STAMPS)/dev
	$(BENCH_SERVE) --quick --out $${TMPDIR:-/tmp}/kvtag-bench-serve-quick.json --plot $${TMPDIR:-/tmp}/kvtag-bench-serve-quick.png

# tests/e2e/test_bench_serve.py runs the quick path's plumbing, the peer included.
test-e2e: $(STAMPS)/bench-serve
