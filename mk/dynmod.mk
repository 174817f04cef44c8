# kvroute-dynmod: the filter as a native Envoy dynamic module (docs/dynamic-module.md).
# The `dynmod` cargo profile is release with `panic = "unwind"`, so the module's hooks can
# catch a panic and fail open instead of aborting Envoy.
DYNMOD_DIR := $(TARGET_DIR)/dynmod
DYNMOD_SO := $(DYNMOD_DIR)/libkvroute_dynmod.so

.PHONY: dynmod test-dynmod
dynmod: toolchain ## Build the Envoy dynamic module and print the .so's full path (load it with ENVOY_DYNAMIC_MODULES_SEARCH_PATH=<its dir>)
	$(CARGO) build -p kvroute-dynmod --profile dynmod
	@ls -l "$(DYNMOD_SO)" | awk -v f="$(abspath $(DYNMOD_SO))" '{printf "%s: %d bytes\n", f, $$5}'

test-dynmod: dynmod envoy ## Dynamic-module unit tests + real-Envoy tests of the .so (ABI exports, routing, errors, metrics, bad config, panic)
	$(CARGO) test -p kvroute-dynmod
	KVROUTE_DYNMOD_DIR="$(DYNMOD_DIR)" \
	KVROUTE_ENVOY="$(ENVOY)" \
	  $(CARGO) test -p kvroute-integration --test dynmod_e2e
