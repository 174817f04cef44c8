# kvroute-core: unit, property and golden tests, natively and compiled to wasm32-wasip1.
# Fixtures are read in place from $(KVROUTE_SHARED_DATA) (exported by the top-level Makefile).
.PHONY: test-core test-wasm bench-core lint-core

test-core: ## kvroute-core tests (native): unit, proptest, golden, estimator accuracy vs tiktoken
	$(CARGO) test -p kvroute-core -- --nocapture

test-wasm: toolchain wasm-bindgen-runner ## kvroute-core tests on wasm32-wasip1 (Node's WASI) and wasm32-unknown-unknown (wasm-bindgen-test in Node)
	@command -v node >/dev/null || { echo "test-wasm: node (>= 20) is required"; exit 1; }
	$(CARGO) test -p kvroute-core --target wasm32-wasip1
	CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_RUNNER="$(WASM_BINDGEN_RUNNER)" \
	  $(CARGO) test -p kvroute-core --target wasm32-unknown-unknown

lint-core: ## clippy for kvroute-core, native (all targets), wasm32-wasip1 and wasm32-unknown-unknown (no simd128: the paths without 16-byte lanes), warnings denied
	$(CARGO) clippy -p kvroute-core --all-targets -- -D warnings
	$(CARGO) clippy -p kvroute-core --all-targets --target wasm32-wasip1 -- -D warnings
	$(CARGO) clippy -p kvroute-core --all-targets --target wasm32-unknown-unknown -- -D warnings

bench-core: ## criterion: decision time (8..4096 endpoints) and request analysis vs the serde analyser (1 KiB..1 MiB)
	$(CARGO) bench -p kvroute-core --bench decision -- --warm-up-time 1 --measurement-time 3
	$(CARGO) bench -p kvroute-core --bench analysis -- --warm-up-time 1 --measurement-time 3
