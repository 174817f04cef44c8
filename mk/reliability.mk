# Reliability (issue 14): fault matrix, long streams through the shipped Envoy examples, soak.
# See docs/reliability.md for what each test breaks and expects, and the figures measured.
REL_ENV = KVROUTE_WASM="$(FILTER_WASM)" \
	KVROUTE_SOAK_OUT="$(abspath $(TARGET_DIR))/soak-report.json" \
	KVROUTE_ENVOY="$(ENVOY)"
SOAK_SECONDS ?= 600
SOAK_RPS ?= 10

.PHONY: test-reliability soak

test-reliability: wasm envoy test-fuzz ## Fault matrix, a 36 s stream through examples/envoy/endpoint-mode.yaml, 1-minute soak, fuzz corpus replay
	$(REL_ENV) $(CARGO) test -p kvroute-integration --test rel_faults --test rel_long_stream
	$(REL_ENV) KVROUTE_SOAK_SECONDS=60 KVROUTE_SOAK_RPS=$(SOAK_RPS) \
	  $(CARGO) test -p kvroute-integration --test rel_soak -- --nocapture

soak: wasm envoy ## Soak: SOAK_SECONDS (600) at SOAK_RPS (10) req/s through Envoy + filter + kvroute-cp + 4 simulated replicas; report in soak-report.json in the target directory
	$(REL_ENV) KVROUTE_SOAK_SECONDS=$(SOAK_SECONDS) KVROUTE_SOAK_RPS=$(SOAK_RPS) \
	  nice -n 10 $(CARGO) test -p kvroute-integration --test rel_soak -- --nocapture
