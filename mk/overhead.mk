# Data-plane overhead (issue 13): plain Envoy vs a trivial body-buffering Wasm filter vs
# kvroute, side by side, with wrk (see docs/overhead.md).
WRK ?= $(or $(shell command -v wrk 2>/dev/null),wrk)
FLOOR_WASM := $(TARGET_DIR)/wasm32-wasip1/release/kvroute_floor_filter.wasm
OVERHEAD_ARGS ?=

.PHONY: wrk wasm-floor bench-overhead test-overhead
wrk: ## Install the wrk load generator (Debian package) when absent
	@command -v "$(WRK)" >/dev/null 2>&1 || { apt-get install -y wrk >/dev/null || { apt-get update >/dev/null && apt-get install -y wrk >/dev/null; }; }
	@command -v "$(WRK)" >/dev/null 2>&1 && echo "wrk: $$(command -v "$(WRK)")"

wasm-floor: ## Build the benchmark floor filter (bench/floor-filter) for wasm32-wasip1
	$(CARGO) build -p kvroute-floor-filter --target wasm32-wasip1 --release

bench-overhead: wasm wasm-floor envoy wrk ## Filter overhead: plain Envoy vs floor filter vs kvroute at 1 KiB..1 MiB bodies (req/s, latency, CPU/request, decision_us, Wasm memory)
	KVROUTE_WASM="$(FILTER_WASM)" KVROUTE_FLOOR_WASM="$(FLOOR_WASM)" WRK="$(WRK)" \
	KVROUTE_ENVOY="$$(ls $(VENV)/lib/python3*/site-packages/envoy/_bin/envoy | head -n1)" \
	  $(CARGO) run -q -p kvroute-tools --bin kvroute-overhead -- $(OVERHEAD_ARGS)

test-overhead: wasm wasm-floor envoy wrk ## Overhead benchmark smoke: every size and proxy runs and reports (not a timed assertion)
	KVROUTE_WASM="$(FILTER_WASM)" KVROUTE_FLOOR_WASM="$(FLOOR_WASM)" WRK="$(WRK)" \
	KVROUTE_ENVOY="$$(ls $(VENV)/lib/python3*/site-packages/envoy/_bin/envoy | head -n1)" \
	  $(CARGO) test -p kvroute-tools --test overhead_smoke
