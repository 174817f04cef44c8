# Kubernetes and Istio: images, manifests, discovery/TLS tests (issue 15). Owner: k8s.
IMAGE_REGISTRY ?= ghcr.io/kvroute
IMAGE_TAG ?= 0.1.0
CP_IMAGE := $(IMAGE_REGISTRY)/kvroute-cp:$(IMAGE_TAG)
FILTER_IMAGE := $(IMAGE_REGISTRY)/kvroute-filter:$(IMAGE_TAG)
FILTER_OCI_DIR := $(TARGET_DIR)/oci/kvroute-filter
CP_OCI_DIR := $(TARGET_DIR)/oci/kvroute-cp
# kvroute-cp for the daemonless image: static (musl), so the image needs no libc.
CP_MUSL_TARGET := x86_64-unknown-linux-musl
CP_STATIC_BIN := $(TARGET_DIR)/$(CP_MUSL_TARGET)/release/kvroute-cp
# First container builder that works (a docker CLI without a daemon does not count); empty
# when none does. Evaluated only by the `image` recipe (`=`), so other targets never run `info`.
CONTAINER_BUILDER = $(firstword $(foreach b,docker podman buildah,$(if $(shell command -v $(b) >/dev/null 2>&1 && $(b) info >/dev/null 2>&1 && echo y),$(b))))
KUBERNETES_VALIDATE_VERSION := 1.37.0
KUBERNETES_VALIDATE := $(VENV)/bin/kubernetes-validate
# CRDs kubernetes-validate has no schema for (it warns; anything else that warns fails).
K8S_CRD_KINDS := EnvoyFilter|InferencePool|ServiceMonitor|Gateway|VirtualService

.PHONY: image image-filter image-cp-layout test-k8s k8s-manifests validate-manifests kubernetes-validate

image-filter: wasm ## Filter as an OCI image layout (Wasm image spec, compat variant) in target/oci/kvroute-filter, no daemon
	$(CARGO) run -q -p kvroute-oci -- wasm --wasm "$(FILTER_WASM)" --out "$(FILTER_OCI_DIR)" --tag "$(IMAGE_TAG)"

image-cp-layout: toolchain ## kvroute-cp as an OCI image layout in target/oci/kvroute-cp, no daemon (static musl build; needs musl-gcc)
	@command -v musl-gcc >/dev/null || { echo "image-cp-layout: musl-gcc not found (ring's and mimalloc's C code): apt-get install musl-tools"; exit 1; }
	CC_x86_64_unknown_linux_musl=musl-gcc $(CARGO) build --release --locked -p kvroute-cp --target $(CP_MUSL_TARGET)
	$(CARGO) run -q -p kvroute-oci -- image --binary "$(CP_STATIC_BIN)" --out "$(CP_OCI_DIR)" --tag "$(IMAGE_TAG)"
	KVROUTE_CP_BINARY="$(CP_STATIC_BIN)" $(CARGO) test -q -p kvroute-oci --test image -- --nocapture the_real_binary_runs

image: image-filter ## kvroute-cp image (docker/podman/buildah, else the daemonless layout) and the filter's OCI layout
	@if [ -n "$(CONTAINER_BUILDER)" ]; then \
	  if [ "$(CONTAINER_BUILDER)" = buildah ]; then \
	    buildah bud -f control-plane/Dockerfile -t "$(CP_IMAGE)" .; \
	  else \
	    $(CONTAINER_BUILDER) build -f control-plane/Dockerfile -t "$(CP_IMAGE)" .; \
	  fi; \
	else \
	  echo "image: no working docker, podman or buildah: building kvroute-cp as an OCI layout instead"; \
	  $(MAKE) --no-print-directory image-cp-layout; \
	  echo "image: OCI layouts in $(CP_OCI_DIR) and $(FILTER_OCI_DIR) (push: docs/deploy.md)"; \
	fi

kubernetes-validate: ## Install kubernetes-validate (PyPI) into .venv
	@if ! "$(KUBERNETES_VALIDATE)" --version 2>/dev/null | grep -qx "$(KUBERNETES_VALIDATE_VERSION)"; then \
	  { [ -x "$(VENV)/bin/pip" ] || python3 -m venv "$(VENV)"; } && \
	  "$(VENV)/bin/pip" install --quiet "kubernetes-validate==$(KUBERNETES_VALIDATE_VERSION)"; \
	fi

k8s-manifests: ## Render deploy/kustomize into examples/kubernetes/kvroute-cp.yaml
	kubectl kustomize deploy/kustomize > examples/kubernetes/kvroute-cp.yaml

validate-manifests: kubernetes-validate ## Every Kubernetes manifest against the Kubernetes schemas (strict), kustomize render in sync
	@tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	if command -v kubectl >/dev/null; then \
	  kubectl kustomize deploy/kustomize > "$$tmp/kustomize.yaml"; \
	  kubectl kustomize deploy/monitoring > "$$tmp/monitoring.yaml"; \
	  diff -u examples/kubernetes/kvroute-cp.yaml "$$tmp/kustomize.yaml" \
	    || { echo "examples/kubernetes/kvroute-cp.yaml is stale: run make k8s-manifests"; exit 1; }; \
	  kubectl patch --local -f examples/istio/testdata/gateway-deployment.yaml --type strategic \
	    --patch-file examples/istio/gateway-patch.yaml -o yaml > "$$tmp/gateway-patched.yaml"; \
	else \
	  echo "validate-manifests: no kubectl: skipped the kustomize render check, the monitoring overlay and the gateway patch"; \
	fi; \
	files="examples/kubernetes/kvroute-cp.yaml deploy/monitoring/servicemonitor.yaml examples/istio/kvroute-envoyfilter.yaml examples/istio/routing.yaml examples/istio/networkpolicy.yaml $$(ls $$tmp/*.yaml 2>/dev/null)"; \
	"$(KUBERNETES_VALIDATE)" --strict $$files > "$$tmp/out.txt" 2>&1 || { cat "$$tmp/out.txt"; exit 1; }; \
	cat "$$tmp/out.txt"; \
	if grep -E '^WARN' "$$tmp/out.txt" | grep -vE "for kind ($(K8S_CRD_KINDS)) with"; then \
	  echo "validate-manifests: unexpected warnings above"; exit 1; fi; \
	echo "validate-manifests: $$(grep -c '^INFO.*passed' "$$tmp/out.txt") resources passed; CRD kinds without a schema: $$(grep -oE 'for kind [A-Za-z]+' "$$tmp/out.txt" | sort -u | cut -d' ' -f3 | tr '\n' ' ')"

test-k8s: wasm envoy validate-manifests ## Kubernetes discovery and TLS (fake API server), OCI layouts, Istio example under envoy --mode validate, manifests
	$(CARGO) test -p kvroute-cp --test kubernetes --test tls
	KVROUTE_WASM="$(FILTER_WASM)" $(CARGO) test -p kvroute-oci
	KVROUTE_WASM="$(FILTER_WASM)" \
	KVROUTE_ENVOY="$(ENVOY)" \
	  $(CARGO) test -p kvroute-integration --test istio_example
