# kvroute-replay: real-trace load generator (issue 6, part 1).
.PHONY: test-replay replay
test-replay: ## Replay tests: trace loaders on the shared traces, Mooncake text sharing, live replays against in-process kvroute-sim, failures, summary math, JSON report, SVG plots
	$(CARGO) test -p kvroute-tools --lib replay::
	$(CARGO) test -p kvroute-tools --test replay

REPLAY_ARGS ?= --help
replay: ## Run kvroute-replay with REPLAY_ARGS (e.g. REPLAY_ARGS="--url http://127.0.0.1:8000/v1/chat/completions --max-requests 100 --sim-extension --out /tmp/replay")
	$(CARGO) run -p kvroute-tools --bin kvroute-replay -- $(REPLAY_ARGS)
