# Coverage-guided fuzzing (cargo-fuzz / libFuzzer, nightly) of every parser of untrusted input:
# request analysis, snapshot ingest, /metrics + adapters + llama.cpp /slots, SSE usage.
# The checks live in fuzz/src/lib.rs; `make test` replays the kept corpora and past crashes
# on stable (test-fuzz). See docs/reliability.md for what was run and found.
FUZZ_TARGETS ?= analyze snapshot exposition sse_usage
FUZZ_SECONDS ?= 600
FUZZ_DIR := fuzz/libfuzzer
# No AddressSanitizer (the code under test has no `unsafe`; without it a target runs ~2x
# more inputs per second); debug assertions on, so integer overflow is a crash.
FUZZ_FLAGS ?= --sanitizer none --debug-assertions
# Real inputs read in place as extra seeds (never copied: libFuzzer writes only new inputs
# into the first corpus directory).
FUZZ_SEEDS_analyze = $(KVROUTE_SHARED_DATA)/requests
FUZZ_SEEDS_exposition = $(KVROUTE_SHARED_DATA)/metrics

.PHONY: fuzz fuzz-tools fuzz-cmin test-fuzz

fuzz-tools:
	@rustup toolchain list | grep -q '^nightly' || rustup toolchain install nightly --profile minimal
	@command -v cargo-fuzz >/dev/null || $(CARGO) install cargo-fuzz --locked

fuzz: fuzz-tools ## Run each fuzz target FUZZ_SECONDS (default 600) in turn, niced; crashes land in fuzz/regressions/<target>/ (FUZZ_TARGETS, FUZZ_SECONDS)
	@for t in $(FUZZ_TARGETS); do \
	  echo "== fuzz $$t for $(FUZZ_SECONDS) s"; \
	  mkdir -p $(CURDIR)/fuzz/regressions/$$t; \
	  case $$t in analyze) seeds="$(FUZZ_SEEDS_analyze)";; exposition) seeds="$(FUZZ_SEEDS_exposition)";; *) seeds="";; esac; \
	  nice -n 10 $(CARGO) +nightly fuzz run $(FUZZ_FLAGS) --fuzz-dir $(FUZZ_DIR) $$t $(CURDIR)/fuzz/corpus/$$t $$seeds -- \
	    -max_total_time=$(FUZZ_SECONDS) -timeout=10 -print_final_stats=1 \
	    -artifact_prefix=$(CURDIR)/fuzz/regressions/$$t/ || exit 1; \
	done
	$(MAKE) fuzz-cmin

fuzz-cmin: fuzz-tools ## Minimise the kept corpora (fuzz/corpus/<target>) to the inputs that add coverage
	@for t in $(FUZZ_TARGETS); do \
	  nice -n 10 $(CARGO) +nightly fuzz cmin $(FUZZ_FLAGS) --fuzz-dir $(FUZZ_DIR) $$t $(CURDIR)/fuzz/corpus/$$t; \
	done

test-fuzz: ## Replay every kept fuzz corpus entry and past crash through the targets' checks (stable)
	$(CARGO) test -p kvroute-fuzz
