# Routing-quality benchmark (issue 7): kvroute vs round robin, least request, llm-d EPP,
# SGLang cache_aware, NVIDIA Dynamo KV router and an oracle, on the Mooncake, Azure conv and
# ShareGPT multi-round traces (virtual time; see docs/bench.md).
.PHONY: bench-routing test-bench bench-crosscheck

BENCH_OUT ?= out/bench

bench-routing: ## Full routing benchmark (release): 3 traces x 4/8/16 replicas x 50/70/90/110% load x 9 routers; tables, SVG plots, JSON under $(BENCH_OUT)
	$(CARGO) run --release -p kvroute-tools --bin kvroute-bench -- sweep \
		--data $(KVROUTE_SHARED_DATA) --out $(BENCH_OUT)

test-bench: ## Routing-benchmark smoke test: 2 traces x 4 replicas x 9 routers on short slices, loaders, capacity search, report outputs, baseline unit tests, filter-vs-benchmark pick parity
	$(CARGO) test -p kvroute-tools --test bench_smoke --test routebench --test pipeline_parity
	$(CARGO) test -p kvroute-tools --lib routebench::

bench-crosscheck: ## Offline prediction for the online cross-check: Mooncake first 10 min, 4 replicas, 70% load (kvroute default fed what the filter sees and the trace ids; round robin)
	$(CARGO) run --release -p kvroute-tools --bin kvroute-bench -- crosscheck \
		--data $(KVROUTE_SHARED_DATA)
