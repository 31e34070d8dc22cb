# Shortcuts: `make setup` (the venv), `make quickstart`, `make test` (the README's test command), `make test-all`, `make lint`, `make bench`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup quickstart test test-all lint bench clean

$(BIN)/hldstudy: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(BIN)/hldstudy

setup: $(BIN)/hldstudy

quickstart: setup
	$(BIN)/hldstudy quickstart --workdir runs/quickstart

test: setup
	$(BIN)/python -m pytest -q -m "not slow and not optional" --durations=15

test-all: setup
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check hldstudy tests benchmarks

bench: setup
	$(BIN)/python benchmarks/train_step.py
	$(BIN)/python benchmarks/fused_kd.py
	$(BIN)/python benchmarks/eval_loglikelihood.py
	$(BIN)/python benchmarks/disagg.py

clean:
	rm -rf runs .pytest_cache
