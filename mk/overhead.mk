# Data-plane overhead (issue 13): plain Envoy vs a trivial body-buffering Wasm filter vs
# kvroute (and vs Envoy's buffer filter vs kvroute-native), side by side, with wrk
# (see docs/overhead.md).
FLOOR_WASM := $(TARGET_DIR)/wasm32-wasip1/release/kvroute_floor_filter.wasm
OVERHEAD_ARGS ?=
# kvroute as a native Envoy dynamic module (a lib<name>.so, `make dynmod`): the
# kvroute-native proxy of bench-overhead, test-overhead and bench-overhead-instructions.
# DYNMOD= (empty) skips that column.
DYNMOD ?= $(DYNMOD_SO)
# The native build's routing floor (bench/floor-dynmod, the floor-dynmod proxy): run
# whenever kvroute-native is.
FLOOR_DYNMOD_SO := $(DYNMOD_DIR)/libkvroute_floor_dynmod.so
DYNMOD_ENV = $(if $(DYNMOD),KVROUTE_DYNMOD="$(abspath $(DYNMOD))" KVROUTE_FLOOR_DYNMOD="$(abspath $(FLOOR_DYNMOD_SO))")

.PHONY: wasm-floor floor-dynmod bench-overhead test-overhead
wasm-floor: ## Build the benchmark floor filter (bench/floor-filter) for wasm32-wasip1
	$(CARGO) build -p kvroute-floor-filter --target wasm32-wasip1 --release

floor-dynmod: toolchain ## Build the native build's routing floor (bench/floor-dynmod), a dynamic module
	$(CARGO) build -p kvroute-floor-dynmod --profile dynmod

bench-overhead: wasm wasm-floor $(if $(DYNMOD),dynmod floor-dynmod) envoy wrk ## Filter overhead: plain Envoy vs floor filter vs kvroute, and (with the dynamic module) Envoy's buffer filter vs the routing floor module vs kvroute-native at 1 KiB..1 MiB bodies (req/s, latency, CPU/request, decision_us, memory)
	KVROUTE_WASM="$(FILTER_WASM)" KVROUTE_FLOOR_WASM="$(FLOOR_WASM)" WRK="$(WRK)" \
	KVROUTE_ENVOY="$(ENVOY)" $(DYNMOD_ENV) \
	  $(CARGO) run -q -p kvroute-tools --bin kvroute-overhead -- $(OVERHEAD_ARGS)

test-overhead: wasm wasm-floor $(if $(DYNMOD),dynmod floor-dynmod) envoy wrk ## Overhead benchmark smoke: every size and proxy runs and reports (not a timed assertion)
	KVROUTE_WASM="$(FILTER_WASM)" KVROUTE_FLOOR_WASM="$(FLOOR_WASM)" WRK="$(WRK)" \
	KVROUTE_ENVOY="$(ENVOY)" $(DYNMOD_ENV) \
	  $(CARGO) test -p kvroute-tools --test overhead_smoke

# 256 KiB (a request takes ~0.3 s under valgrind): CALLGRIND_ARGS="--sizes 262144 --callgrind 100 --callgrind-warmup 300"
CALLGRIND_ARGS ?= --sizes 1024,16384 --callgrind 300
.PHONY: bench-overhead-instructions
bench-overhead-instructions: wasm wasm-floor $(if $(DYNMOD),dynmod floor-dynmod) envoy ## Instructions per request inside Envoy (plain, floor, kvroute; floor-native, floor-dynmod and kvroute-native with DYNMOD) under callgrind: deterministic on a noisy machine (needs valgrind)
	@command -v valgrind >/dev/null || { echo "bench-overhead-instructions: valgrind is required (Debian/Ubuntu: apt-get install valgrind)"; exit 1; }
	KVROUTE_WASM="$(FILTER_WASM)" KVROUTE_FLOOR_WASM="$(FLOOR_WASM)" \
	KVROUTE_ENVOY="$(ENVOY)" $(DYNMOD_ENV) \
	  $(CARGO) run -q -p kvroute-tools --bin kvroute-overhead -- $(CALLGRIND_ARGS)

# The decision alone, in Wasm operations (fuel-counted under Wasmtime, deterministic): core's
# `decision_ops` example on the benchmark's bodies (docs/overhead.md, "Wasm operations per
# decision").
WASMTIME_PY_VERSION := 50.0.1
DECISION_OPS_WASM := $(TARGET_DIR)/wasm32-wasip1/release/examples/decision_ops.wasm
DECISION_OPS_DIR := $(TARGET_DIR)/decision-ops
DECISION_OPS_SIZES ?= 1024,16384,262144,1048576
.PHONY: wasmtime-py bench-decision-ops test-decision-ops
wasmtime-py: ## Install wasmtime (PyPI) into .venv (bench-decision-ops counts Wasm operations with it)
	@[ -x "$(VENV)/bin/pip" ] || python3 -m venv "$(VENV)"
	@if ! "$(VENV)/bin/pip" show wasmtime 2>/dev/null | grep -qx "Version: $(WASMTIME_PY_VERSION)"; then \
	  "$(VENV)/bin/pip" install --quiet "wasmtime==$(WASMTIME_PY_VERSION)"; \
	fi

bench-decision-ops: toolchain wasmtime-py ## Wasm operations of one routing decision (Router::route, and the analysis alone) per body size: deterministic
	$(CARGO) build -q -p kvroute-core --example decision_ops --target wasm32-wasip1 --release
	$(CARGO) run -q -p kvroute-tools --bin kvroute-overhead -- --write-bodies "$(DECISION_OPS_DIR)" --sizes "$(DECISION_OPS_SIZES)" >/dev/null
	"$(VENV)/bin/python" scripts/wasm-ops.py "$(DECISION_OPS_WASM)" \
	  $$(for s in $$(echo "$(DECISION_OPS_SIZES)" | tr ',' ' '); do echo "$(DECISION_OPS_DIR)/body-$$s.json"; done)

test-decision-ops: ## bench-decision-ops smoke at 1 and 16 KiB: both decisions route and are counted (not a threshold)
	$(MAKE) --no-print-directory bench-decision-ops DECISION_OPS_SIZES=1024,16384
