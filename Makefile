# The whole set-up: `make run` (the main job) and `make test`. Each creates .venv on first use.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: run test lint demo bench fuzz conformance conformance-backend gpu-check clean

$(STAMP): requirements.txt pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -r requirements.txt
	$(BIN)/pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/fanfold train

demo: $(STAMP)
	$(BIN)/fanfold demo --devices 3

test: lint
	$(BIN)/python -m pytest -q

# The layering (import-linter contracts in pyproject.toml) and ruff's lint; part of `make test`.
lint: $(STAMP)
	$(BIN)/lint-imports --no-cache
	$(BIN)/ruff check src tests benchmarks examples conformance

bench: $(STAMP)
	$(BIN)/python benchmarks/dp_overhead.py

# The long differential run: fanfold's DDP against torch's (and ZeRO against torch's optimizer) over thousands of
# drawn configurations on named seeds -> docs/differential.md (`make test` runs a bounded, fixed budget of the same)
fuzz: $(STAMP)
	$(BIN)/python tests/differential/fuzz.py

# torch's own DDP tests with torch's DDP and with fanfold's (CPU, gloo, 2 ranks) -> docs/conformance.md, after the
# backend's run (its counts go into that page too); not in `test`
conformance: conformance-backend
	$(BIN)/python conformance/run.py

# torch's own collective tests on gloo and on the fanfold backend (CPU; 2, 3 and 8 ranks) -> docs/conformance-backend.md
conformance-backend: $(STAMP)
	$(BIN)/python conformance/collectives.py --all

# on a CUDA machine: the gpu-marked tests (pytest -m gpu), then benchmarks/gpu.py -> docs/gpu.md
gpu-check: $(STAMP)
	$(BIN)/python benchmarks/gpu.py --with-tests

clean:
	rm -rf $(VENV) build src/*.egg-info runs
