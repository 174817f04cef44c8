# kvroute-sim: engine model, server, metrics dialects.
.PHONY: test-sim
test-sim: ## Simulator tests
	@true
