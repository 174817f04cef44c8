# kvroute-sim (sim/): engine model, server, metrics dialects.
.PHONY: test-sim bench-sim-replay bench-sim-load
test-sim: ## Simulator tests: engine model, HTTP/SSE, metrics dialects, golden timings, step-time calibration, accept back-off
	$(CARGO) test -p kvroute-sim --lib
	$(CARGO) test -p kvroute-sim --test sim_engine --test sim_server --test sim_perf_calibration --test sim_accept

bench-sim-replay: ## Mooncake 1 h trace through the engine model alone (release build); prints wall time
	$(CARGO) run --release -p kvroute-sim --bin kvroute-sim-replay -- \
		--trace $(KVROUTE_SHARED_DATA)/traces/mooncake_conversation_trace.jsonl --replicas 16

bench-sim-load: ## 16 replicas in one process under a short-request load generator (release build)
	$(CARGO) run --release -p kvroute-sim --bin kvroute-sim-load -- --replicas 16 --seconds 10

.PHONY: bench-route
bench-route: ## One routing-benchmark cell: every router on the first 1,750 Mooncake rows x2, 8 replicas (release, virtual time; full sweep: make bench-routing)
	$(CARGO) run --release -p kvroute-tools --bin kvroute-bench -- single \
		--data $(KVROUTE_SHARED_DATA) --trace mooncake --rows 1750 --replicas 8 --compress 2 --seed 1
