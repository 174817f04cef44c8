# kvroute-cp: control plane (issue 5). Owner: cp.
CP_TESTS := $(patsubst integration/tests/%.rs,%,$(wildcard integration/tests/cp_*.rs))

.PHONY: cp test-cp bench-cp check-cp-example

CP_BIN := $(TARGET_DIR)/release/kvroute-cp
cp: toolchain ## Build kvroute-cp (release) and print the binary's full path
	$(CARGO) build -p kvroute-cp --release
	@echo "$(abspath $(CP_BIN))"

test-cp: wasm dynmod envoy ## Control-plane tests: unit, golden (every metrics fixture), config, faults, binary (signals/reload), cp vs kvroute-sim, cp vs real Envoy + filter (Wasm and native)
	$(CARGO) test -p kvroute-cp
	KVROUTE_WASM="$(FILTER_WASM)" KVROUTE_DYNMOD_DIR="$(DYNMOD_DIR)" \
	KVROUTE_ENVOY="$(ENVOY)" \
	  $(CARGO) test -p kvroute-integration $(addprefix --test ,$(CP_TESTS))

bench-cp: ## Control-plane benchmark (optimised build): 1,000 endpoints @1 s (CPU %, RSS) and scrape-to-push p99 @64 endpoints
	$(CARGO) bench -p kvroute-cp --bench fleet

check-cp-example: ## Check the example control-plane config against each example Envoy config (kvroute-cp --check --envoy-config, the examples' placeholder token)
	@for e in examples/envoy/*.yaml examples/envoy/dynamic-module/*.yaml; do \
	  echo "== kvroute-cp --check --envoy-config $$e"; \
	  KVROUTE_INGEST_TOKEN=change-me-to-a-long-random-secret $(CARGO) run -q --release -p kvroute-cp -- \
	    --config examples/control-plane/kvroute-cp.yaml --check --envoy-config "$$e" || exit 1; \
	done
