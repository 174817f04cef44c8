# kvroute-core: unit, property and golden tests, natively and compiled to wasm32-wasip1.
.PHONY: test-core test-wasm bench-core
test-core: ## kvroute-core tests (native)
	$(CARGO) test -p kvroute-core

test-wasm: ## kvroute-core tests compiled to wasm32-wasip1, run under Node's WASI
	$(CARGO) test -p kvroute-core --target wasm32-wasip1

bench-core: ## criterion: decision time and request analysis
	$(CARGO) bench -p kvroute-core
