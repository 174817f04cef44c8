# kvroute-cp: control plane.
.PHONY: test-cp
test-cp: ## Control-plane tests
	$(CARGO) test -p kvroute-cp
