# The real Kubernetes control plane (etcd, kube-apiserver, kube-scheduler,
# kube-controller-manager) as one Go binary built from controlplane/ (see main.go).
#
#   make controlplane          build it unless the cache already has it; writes its path to
#                              .tools/controlplane-bin
#   make -s controlplane-path  print that path (builds nothing)
#   make controlplane-prune    delete the cached binaries of other inputs (133 MB each)
#   make test-real-k8s         tests/real_k8s against it, then the product's Kubernetes-facing tests on it
#
# The binary, the module cache and the build cache live outside the clone, under
# GPUBOOT_CACHE, so another clone on the same machine (CI) reuses them. The binary's
# folder is named by a hash of what decides its content (go.mod, go.sum, the *.go files
# and the build flags below), never by file times: a fresh clone finds it and builds
# nothing. A cold build takes minutes and a few GB of memory on 2 cores.

GPUBOOT_CACHE ?= $(HOME)/.cache/gpuboot
GO ?= $(shell command -v go 2>/dev/null || { [ -x /usr/local/go/bin/go ] && echo /usr/local/go/bin/go; } || echo go)

CONTROLPLANE_DIR := controlplane
CONTROLPLANE_INPUTS := $(CONTROLPLANE_DIR)/go.mod $(CONTROLPLANE_DIR)/go.sum $(sort $(wildcard $(CONTROLPLANE_DIR)/*.go))
# The Kubernetes release the binary reports (/version, kubectl version), read from go.mod.
CONTROLPLANE_K8S_VERSION := $(shell awk '$$1 == "k8s.io/kubernetes" { print $$2; exit }' $(CONTROLPLANE_DIR)/go.mod)
CONTROLPLANE_K8S_MINOR := $(word 2,$(subst ., ,$(CONTROLPLANE_K8S_VERSION)))
CONTROLPLANE_VERSION_LDFLAGS := $(foreach pkg,k8s.io/component-base/version k8s.io/client-go/pkg/version,\
  -X $(pkg).gitVersion=$(CONTROLPLANE_K8S_VERSION) -X $(pkg).gitMajor=1 -X $(pkg).gitMinor=$(CONTROLPLANE_K8S_MINOR) \
  -X $(pkg).gitTreeState=clean -X $(pkg).buildDate=1970-01-01T00:00:00Z)
CONTROLPLANE_GOFLAGS := -trimpath -ldflags '-s -w $(strip $(CONTROLPLANE_VERSION_LDFLAGS))'
# Content hash of the inputs (names and bytes) and of the build flags.
CONTROLPLANE_HASH := $(shell { for f in $(CONTROLPLANE_INPUTS); do echo "== $$f"; cat "$$f"; done; \
  echo "== flags $(CONTROLPLANE_GOFLAGS)"; } | sha256sum | cut -c1-16)
CONTROLPLANE_BIN := $(GPUBOOT_CACHE)/controlplane/$(CONTROLPLANE_HASH)/controlplane
CONTROLPLANE_BIN_FILE := .tools/controlplane-bin
CONTROLPLANE_GOENV := CGO_ENABLED=0 GOFLAGS=-modcacherw GOMODCACHE=$(GPUBOOT_CACHE)/go/mod GOCACHE=$(GPUBOOT_CACHE)/go/build

.PHONY: controlplane controlplane-path controlplane-prune test-real-k8s

controlplane: $(CONTROLPLANE_BIN)
	@mkdir -p $(dir $(CONTROLPLANE_BIN_FILE))
	@echo '$(CONTROLPLANE_BIN)' > $(CONTROLPLANE_BIN_FILE)
	@echo "controlplane: $(CONTROLPLANE_BIN)"

controlplane-path:
	@echo '$(CONTROLPLANE_BIN)'

# Every input change leaves its binary in the cache (another clone may still use it): this removes
# all but the current one. The module and build caches stay (go clean -cache / -modcache for those).
controlplane-prune:
	@for d in $(GPUBOOT_CACHE)/controlplane/*/; do \
	  [ "$$d" = "$(dir $(CONTROLPLANE_BIN))" ] || { echo "removing $$d"; rm -rf "$$d"; }; done

# No prerequisites on purpose: the path already names the inputs' content, so a file
# time (a fresh clone's, a touch) never triggers a build; a change of content does.
# Modules are downloaded first so that a module the proxy refuses is named with the
# proxy's error; the build goes to a temporary file renamed into place, so an
# interrupted or concurrent build never leaves a partial binary at the final path.
$(CONTROLPLANE_BIN):
	@command -v $(GO) >/dev/null 2>&1 || { echo "controlplane: the Go toolchain ('$(GO)') was not found;" \
	  "install Go >= 1.26 or run make GO=/path/to/go controlplane" >&2; exit 1; }
	@echo "controlplane: building $@ with $$($(GO) version) (cold: several minutes, up to ~3 GB of memory)"
	@cd $(CONTROLPLANE_DIR) && out=$$($(CONTROLPLANE_GOENV) $(GO) mod download -json 2>&1) || { \
	  echo "controlplane: downloading the Go modules failed (GOPROXY=$$($(GO) env GOPROXY)):" >&2; \
	  printf '%s\n' "$$out" | awk '/"Path":/ { path = $$2 } /"Version":/ { version = $$2 } \
	    /"Error":/ { print "  module " path " " version " " substr($$0, index($$0, $$2)); n++ } \
	    /^go: / { print "  " $$0; n++ } END { exit n == 0 }' >&2 || printf '%s\n' "$$out" >&2; exit 1; }
	@mkdir -p $(@D)
	cd $(CONTROLPLANE_DIR) && $(CONTROLPLANE_GOENV) $(GO) build $(CONTROLPLANE_GOFLAGS) -o $@.tmp.$$$$ . \
	  && mv -f $@.tmp.$$$$ $@ || { rm -f $@.tmp.$$$$; echo "controlplane: go build failed (above)" >&2; exit 1; }

# The launcher's tests (tests/real_k8s), then the product's Kubernetes-facing tests with the local cloud on
# the real control plane (--kube=real: SimCloud starts etcd, kube-apiserver, kube-scheduler and
# kube-controller-manager instead of simcloud's own API server; tests marked simcloud_only skip).
# Picked to stay within ~15 minutes on 2 cores (each test starts its own control plane, ~10 s; measured
# 11 min on a shared 2-core machine: 14 launcher tests, then 66 product tests); what is
# left out, and why, is in REAL_K8S_LEFT_OUT.
RESILIENCE := tests/integration/test_resilience.py
TRIGGER := tests/integration/test_trigger.py
SCALEDOWN := tests/integration/test_scaledown.py
# simcloud's own conformance tests marked both_backends: the same assertions against kube-apiserver itself.
REAL_K8S_CONFORMANCE := tests/conformance/test_k8s_api.py tests/conformance/test_k8s_auth.py \
  tests/conformance/test_k8s_kubectl.py tests/conformance/test_k8s_validation.py
REAL_K8S_TESTS := $(REAL_K8S_CONFORMANCE) tests/e2e/test_gpu_job.py tests/e2e/test_gang.py::test_a_gang_boots_both_nodes_and_its_ranks_rendezvous \
  tests/integration/test_rbac.py tests/integration/test_ledger.py tests/integration/test_preemption.py tests/integration/test_preemption_before_launch.py tests/integration/test_job_queue_backfill.py $(RESILIENCE) \
  tests/integration/test_cluster_view.py::test_a_restarted_placer_takes_the_lease_over_and_answers_from_its_view \
  tests/integration/test_cluster_view.py::test_a_view_whose_identity_may_list_pods_but_not_watch_them_says_which_right_is_missing \
  $(TRIGGER)::test_trigger_waits_through_stale_and_zero_and_fires_on_the_fast_path \
  $(TRIGGER)::test_a_node_stopped_longer_than_the_watch_history_is_still_watched_through_its_reset \
  $(TRIGGER)::test_a_watch_relisted_in_the_middle_of_the_boot_never_fires_early \
  $(TRIGGER)::test_weakened_rule_fires_on_the_stale_count_and_the_pod_fails_admission \
  $(TRIGGER)::test_trigger_times_out_with_what_it_last_saw \
  $(TRIGGER)::test_triggers_waiting_on_one_node_share_its_watch_and_each_fires_on_the_reset \
  $(SCALEDOWN)::test_idle_managed_node_is_stopped_the_others_are_kept \
  $(SCALEDOWN)::test_a_placement_that_read_before_the_cordon_cannot_commit_after_the_stop \
  $(SCALEDOWN)::test_a_failure_inside_the_cordon_window_leaves_the_node_running_and_schedulable
REAL_K8S_LEFT_OUT := the gang's failed-rank retry (seen once, under heavy load, to wait out its boot timeout for a \
  GPU reset the HTTP kubelet had not written: to be understood; it passes alone), the other cases of test_trigger and test_scaledown (they pass on the real \
  backend too: pytest --kube=real FILE), the rest of tests/integration and tests/e2e (same adapters and DAGs \
  through the same calls), the conformance tests not marked both_backends (they reach into simcloud's store, \
  faults or kubelets), stress, distributed, chaos, bench
test-real-k8s: install controlplane
	GPUBOOT_REAL_K8S=1 GPUBOOT_CONTROLPLANE_BIN=$(CONTROLPLANE_BIN) $(PY) -m pytest tests/real_k8s
	@echo "test-real-k8s: product tests on the real control plane; left out: $(REAL_K8S_LEFT_OUT)"
	GPUBOOT_CONTROLPLANE_BIN=$(CONTROLPLANE_BIN) $(PY) -m pytest --kube=real --durations=15 $(REAL_K8S_TESTS)
	@echo "test-real-k8s: the demo and the gang demo (make demo, make demo-gang), cancel and external stop in the demo's stack, on the real control plane"
	GPUBOOT_TEST_DEMO=1 GPUBOOT_CONTROLPLANE_BIN=$(CONTROLPLANE_BIN) $(PY) -m pytest --kube=real $(DEMO_STACK_TESTS)
