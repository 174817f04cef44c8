# kvroute — top-level Makefile. Each component's targets live in mk/<component>.mk.
# `make help` lists them; `make test` is the one command CI runs (via .ci/run).

SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

CARGO ?= cargo
# Honour CARGO_TARGET_DIR so paths to built artefacts stay right.
TARGET_DIR ?= $(or $(CARGO_TARGET_DIR),$(CURDIR)/target)
# Real traces, prompts, metrics and request bodies, read in place (never copied into the repo).
KVROUTE_SHARED_DATA ?= $(abspath $(CURDIR)/../shared/data)
export KVROUTE_SHARED_DATA
# Downloads and builds kept between runs (llama-server, SmolLM2, wasm-bindgen CLI).
KVROUTE_CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/kvroute
export KVROUTE_CACHE
# Python venv holding the PyPI Envoy build (see mk/filter.mk).
VENV ?= $(CURDIR)/.venv

include $(sort $(wildcard mk/*.mk))

.PHONY: help test lint fmt
help: ## List the targets
	@if [ -t 1 ]; then c='\033[36m'; r='\033[0m'; else c=; r=; fi; \
	grep -hE '^[a-zA-Z0-9_.-]+:.*## ' $(MAKEFILE_LIST) | LC_ALL=C sort -t: -k1,1 | \
	  awk -v c="$$c" -v r="$$r" 'BEGIN{FS=":.*## "}{printf "  %s%-22s%s %s\n", c, $$1, r, $$2}'

fmt: ## Format all Rust code
	$(CARGO) fmt --all

lint: toolchain ## rustfmt check + clippy (native, and wasm32-wasip1 for core and filter, wasm32-unknown-unknown for core: its paths without 16-byte lanes), warnings denied
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	$(CARGO) clippy -p kvroute-core --all-targets --target wasm32-wasip1 -- -D warnings
	@# wasm32-unknown-unknown has no simd128: core's portable paths (no 16-byte lanes, as on aarch64).
	$(CARGO) clippy -p kvroute-core --all-targets --target wasm32-unknown-unknown -- -D warnings
	$(CARGO) clippy -p kvroute-filter --target wasm32-wasip1 -- -D warnings

test: bootstrap lint test-core test-wasm test-filter test-dynmod test-sim test-cp test-replay test-bench test-demo test-overhead test-decision-ops test-k8s test-reliability ## Everything CI runs: lint, unit, wasm, property, golden, real-Envoy, full-stack and real-model tests
	@echo "make test: all suites passed"
