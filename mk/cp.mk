# kvroute-cp: control plane (issue 5). Owner: cp.
.PHONY: test-cp bench-cp run-cp-example

test-cp: ## Control-plane tests: unit, golden (every shared metrics fixture), config, faults, binary (signals/reload), cp vs sim
	$(CARGO) test -p kvroute-cp
	$(CARGO) test -p kvroute-integration --test cp_sim

bench-cp: ## Control-plane benchmark: 1,000 endpoints @1 s (CPU %, RSS) and scrape-to-push p99 @64 endpoints
	$(CARGO) bench -p kvroute-cp --bench fleet

run-cp-example: ## Validate the example control-plane config
	$(CARGO) run -p kvroute-cp -- --config examples/control-plane/kvroute-cp.yaml --check
