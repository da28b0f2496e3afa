# The whole set-up: `make run` (the main job) and `make test`. Each creates .venv on first use.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: run test lint demo bench clean

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
	$(BIN)/ruff check src tests benchmarks examples

bench: $(STAMP)
	$(BIN)/python benchmarks/dp_overhead.py

clean:
	rm -rf $(VENV) build src/*.egg-info runs
