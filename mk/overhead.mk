# Data-plane overhead (issue 13): plain Envoy vs a trivial body-buffering Wasm filter vs
# kvroute, side by side, with wrk (see docs/overhead.md).
FLOOR_WASM := $(TARGET_DIR)/wasm32-wasip1/release/kvroute_floor_filter.wasm
OVERHEAD_ARGS ?=

.PHONY: wasm-floor bench-overhead test-overhead
wasm-floor: ## Build the benchmark floor filter (bench/floor-filter) for wasm32-wasip1
	$(CARGO) build -p kvroute-floor-filter --target wasm32-wasip1 --release

bench-overhead: wasm wasm-floor envoy wrk ## Filter overhead: plain Envoy vs floor filter vs kvroute at 1 KiB..1 MiB bodies (req/s, latency, CPU/request, decision_us, Wasm memory)
	KVROUTE_WASM="$(FILTER_WASM)" KVROUTE_FLOOR_WASM="$(FLOOR_WASM)" WRK="$(WRK)" \
	KVROUTE_ENVOY="$(ENVOY)" \
	  $(CARGO) run -q -p kvroute-tools --bin kvroute-overhead -- $(OVERHEAD_ARGS)

test-overhead: wasm wasm-floor envoy wrk ## Overhead benchmark smoke: every size and proxy runs and reports (not a timed assertion)
	KVROUTE_WASM="$(FILTER_WASM)" KVROUTE_FLOOR_WASM="$(FLOOR_WASM)" WRK="$(WRK)" \
	KVROUTE_ENVOY="$(ENVOY)" \
	  $(CARGO) test -p kvroute-tools --test overhead_smoke

# 256 KiB (a request takes ~0.3 s under valgrind): CALLGRIND_ARGS="--sizes 262144 --callgrind 100 --callgrind-warmup 300"
CALLGRIND_ARGS ?= --sizes 1024,16384 --callgrind 300
.PHONY: bench-overhead-instructions
bench-overhead-instructions: wasm wasm-floor envoy ## Instructions per request inside Envoy (plain, floor, kvroute) under callgrind: deterministic on a noisy machine (needs valgrind)
	@command -v valgrind >/dev/null || { echo "bench-overhead-instructions: valgrind is required (Debian/Ubuntu: apt-get install valgrind)"; exit 1; }
	KVROUTE_WASM="$(FILTER_WASM)" KVROUTE_FLOOR_WASM="$(FLOOR_WASM)" \
	KVROUTE_ENVOY="$(ENVOY)" \
	  $(CARGO) run -q -p kvroute-tools --bin kvroute-overhead -- $(CALLGRIND_ARGS)
