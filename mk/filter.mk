# kvroute-filter: the .wasm, the PyPI Envoy, and real-Envoy integration tests.
.PHONY: test-filter
test-filter: ## Filter unit tests + real-Envoy integration tests
	$(CARGO) test -p kvroute-filter
