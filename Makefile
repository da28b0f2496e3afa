# The whole set-up: `make run` (the main job) and `make test`. Each creates .venv on first use.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: run test test-busy lint smoke demo bench docs-figures fuzz conformance conformance-backend gpu-check multihost integrations clean

$(STAMP): requirements.txt pyproject.toml
	@echo "fanfold: one-time set-up: creating $(VENV) and installing torch (CPU build) and the pinned tools of requirements.txt; this takes about 1-2 minutes"
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -r requirements.txt
	$(BIN)/pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/fanfold train

demo: $(STAMP)
	$(BIN)/fanfold demo --devices 3

test: lint
	@echo "fanfold: the test suite takes about 16-30 minutes on 2 cores (README.md, Set-up)"
	$(BIN)/python -m pytest -q
	$(MAKE) --no-print-directory smoke

# The multi-process tests (tests/distributed, tests/collectives, tests/differential, tests/optim: every one of them)
# with BUSY_HOGS CPU-bound processes (plain Python busy loops) competing for the cores, as on a shared CI runner or
# a laptop running other work; the hogs are killed when it ends, passed, failed or interrupted. All four directories
# fit CI's budget: their CPU work is a small part of `make test`'s; expect 30-40 minutes on 2 cores beside the
# hogs. A step of .ci/run after `make test`. BUSY_TESTS= to run a part, e.g.
# BUSY_TESTS=tests/optim
BUSY_HOGS ?= 4
BUSY_TESTS ?= tests/distributed tests/collectives tests/differential tests/optim
test-busy: $(STAMP)
	@echo "fanfold: the multi-process tests beside $(BUSY_HOGS) CPU hogs: expect 30-40 minutes on 2 cores"
	@hogs=""; stop() { [ -z "$$hogs" ] || kill $$hogs 2>/dev/null; wait 2>/dev/null; hogs=""; }; \
	trap 'stop' EXIT; trap 'stop; exit 130' INT; trap 'stop; exit 143' TERM; \
	for i in $$(seq $(BUSY_HOGS)); do $(BIN)/python -c "while True: pass" & hogs="$$hogs $$!"; done; \
	$(BIN)/python -m pytest -q -rfE --durations=15 $(BUSY_TESTS)

# tests/smoke/smoke.py (every name in fanfold.__all__, every subcommand) in a fresh venv holding only what
# `pip install .` brings: torch, pinned to the CPU build on disk (any other torch spec pulls a multi-GB CUDA build),
# tqdm and cryptography; no numpy (torch's own warning that it found none is silenced). Then the train extra is
# added and `fanfold train` runs for real. Built from a copy of the package in a temporary directory (nothing written to the
# tree), removed afterwards. Part of `make test`.
smoke:
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && set -e && \
	mkdir $$tmp/pkg && cp -r src pyproject.toml README.md $$tmp/pkg/ && echo "torch==2.13.0" > $$tmp/constraints.txt && \
	pip="$$tmp/venv/bin/pip install -q --disable-pip-version-check --constraint $$tmp/constraints.txt" && \
	$(PY) -m venv $$tmp/venv && $$pip $$tmp/pkg && \
	(cd $$tmp && PATH=$$tmp/venv/bin:$$PATH PYTHONWARNINGS='ignore:Failed to initialize NumPy' \
	  venv/bin/python $(CURDIR)/tests/smoke/smoke.py --no-numpy) && \
	$$pip "$$tmp/pkg[train]" && \
	(cd $$tmp && PATH=$$tmp/venv/bin:$$PATH venv/bin/python $(CURDIR)/tests/smoke/smoke.py train)

# The layering (import-linter contracts in pyproject.toml) and ruff's lint; part of `make test`.
lint: $(STAMP)
	$(BIN)/lint-imports --no-cache --no-logo
	$(BIN)/ruff check src tests benchmarks examples conformance tools

# tests/integrations: Lightning, Accelerate and the transformers Trainer (pyproject.toml's pinned `integrations`
# extra), each a 2-process CPU job on gloo and on fanfold, compared bitwise; in a venv of its own (.venv-int), so
# `make test`'s is unaffected (there these tests skip). About 10 minutes on 2 cores; a step of .ci/run after `make test`.
INT_VENV  := .venv-int
INT_STAMP := $(INT_VENV)/.installed
$(INT_STAMP): requirements.txt pyproject.toml
	@echo "fanfold: one-time set-up: creating $(INT_VENV) with torch (CPU build), lightning, accelerate and transformers"
	$(PY) -m venv $(INT_VENV)
	$(INT_VENV)/bin/pip install -q --disable-pip-version-check --constraint requirements.txt -e ".[integrations]"
	touch $(INT_STAMP)

integrations: $(INT_STAMP)
	$(INT_VENV)/bin/python -m pytest -q -rs tests/integrations

bench: $(STAMP)
	$(BIN)/python benchmarks/dp_overhead.py

# Every generated block of README.md and docs/ (the only place a measured figure may stand) made again by the command
# its marker names, then the docs check (tools/docscheck; part of `make test`). Long: it includes the fuzz report.
docs-figures: $(STAMP)
	$(BIN)/python tools/docscheck --rerun-figures

# The long differential run: fanfold's DDP against torch's (and ZeRO against torch's optimizer) over 1,000 DDP and
# 120 ZeRO configurations drawn on named seeds -> docs/differential.md (`make test` runs a bounded, fixed budget of
# the same); FUZZ_ARGS= to change the budget, e.g. FUZZ_ARGS="--ddp 100 --zero 10 --no-report"
FUZZ_ARGS ?=
fuzz: $(STAMP)
	$(BIN)/python tests/differential/fuzz.py $(FUZZ_ARGS)

# torch's own DDP tests with torch's DDP and with fanfold's (CPU, gloo, 2 ranks), then the same on the CPU port
# (the suite's CUDA devices mapped to the CPU) -> docs/conformance.md, after the backend's run (its counts go into
# that page too); not in `test`
conformance: conformance-backend
	$(BIN)/python conformance/run.py
	$(BIN)/python conformance/run.py --cuda-on-cpu

# torch's own collective tests on gloo and on the fanfold backend (CPU; 2, 3 and 8 ranks) -> docs/conformance-backend.md
conformance-backend: $(STAMP)
	$(BIN)/python conformance/collectives.py --all

# on a CUDA machine: the gpu-marked tests (pytest -m gpu), then benchmarks/gpu.py -> docs/gpu.md. Where no venv can
# be built (no package index) but an interpreter already holds a CUDA torch and pytest: make gpu-check GPU_PY=python3
gpu-check:
ifdef GPU_PY
	PYTHONPATH=$(CURDIR)/src $(GPU_PY) benchmarks/gpu.py --with-tests
else
	$(MAKE) --no-print-directory $(STAMP)
	$(BIN)/python benchmarks/gpu.py --with-tests
endif

# tests/multihost: 2 and 3 ranks on simulated hosts (network, mount, UTS and PID namespaces linked by veth; see
# docs/multihost.md): collectives against gloo, DDP against one process, a killed rank, a link taken down,
# `fanfold run --nnodes 2` restarting, a relay of the job's store on another host reading nothing. Needs root (skipped with the reason otherwise) and 2-3 minutes on 2
# cores; not in `test` (CI runs it after `make test` where it runs as root).
multihost: $(STAMP)
	FANFOLD_MULTIHOST=1 $(BIN)/python -m pytest -q -rs tests/multihost

clean:
	rm -rf $(VENV) $(INT_VENV) build src/*.egg-info runs
