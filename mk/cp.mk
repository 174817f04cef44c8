# kvroute-cp: control plane (issue 5). Owner: cp.
CP_TESTS := $(patsubst integration/tests/%.rs,%,$(wildcard integration/tests/cp_*.rs))

.PHONY: test-cp bench-cp check-cp-example

test-cp: wasm envoy ## Control-plane tests: unit, golden (every metrics fixture), config, faults, binary (signals/reload), cp vs kvroute-sim, cp vs real Envoy + filter
	$(CARGO) test -p kvroute-cp
	KVROUTE_WASM="$(FILTER_WASM)" \
	KVROUTE_ENVOY="$(ENVOY)" \
	  $(CARGO) test -p kvroute-integration $(addprefix --test ,$(CP_TESTS))

bench-cp: ## Control-plane benchmark (optimised build): 1,000 endpoints @1 s (CPU %, RSS) and scrape-to-push p99 @64 endpoints
	$(CARGO) bench -p kvroute-cp --bench fleet

check-cp-example: ## Validate the example control-plane config with the binary
	$(CARGO) run -q -p kvroute-cp -- --config examples/control-plane/kvroute-cp.yaml --check
