# Shortcuts: `make setup` (the venv, at the versions in constraints.txt), `make quickstart`,
# `make test` (the README's test command), `make test-all`, `make lint`, `make bench`,
# `make upgrade` (newest versions, tests, then a new constraints.txt if they pass).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# `make upgrade` installs and tests here, so that a failed upgrade leaves $(VENV) as it was.
UPGRADE_VENV ?= .venv-upgrade
TEST_DEFAULT := -m pytest -q -n 2 -m "not slow and not optional and not aot"

.PHONY: setup quickstart test test-all test-aot lint bench clean constraints upgrade

# Reinstalls when the project's requirements or the tested versions change.
$(BIN)/hldstudy: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(BIN)/hldstudy

setup: $(BIN)/hldstudy

quickstart: setup
	$(BIN)/hldstudy quickstart --workdir runs/quickstart

test: setup
	$(BIN)/python $(TEST_DEFAULT) --durations=15

# The compile tier (marker aot, issue 18): the TPU and GPU compilers (libtpu, the JAX CUDA
# plugin: the aot extra) compile the study's steps on this CPU, in a venv of their own
# (the plugins stay out of the default one). Long: tens of compiles of a minute or more.
AOT_VENV ?= .venv-aot
$(AOT_VENV)/bin/python: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(AOT_VENV)
	$(AOT_VENV)/bin/pip install --quiet -c constraints.txt -e '.[dev,aot]'
	touch $(AOT_VENV)/bin/python

test-aot: $(AOT_VENV)/bin/python
	JAX_PLATFORMS=cpu $(AOT_VENV)/bin/python -m pytest -q -rP -m aot --durations=0

test-all: setup
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check hldstudy tests benchmarks experiments sweeps

bench: setup
	$(BIN)/python benchmarks/train_step.py
	$(BIN)/python benchmarks/fused_kd.py
	$(BIN)/python benchmarks/eval_loglikelihood.py
	$(BIN)/python benchmarks/disagg.py

clean:
	rm -rf runs .pytest_cache $(UPGRADE_VENV)

# constraints.txt: the versions installed in $(VENV) (pip freeze, less the project itself
# and pip/setuptools, which pip and the build backend bring). `make upgrade` calls it.
constraints:
	{ echo "# The versions hldstudy's tests pass with (pip reads it: pip install -c constraints.txt -e '.[dev]')."; \
	  echo "# Written by 'make upgrade' from a venv whose default test suite passed; not edited by hand."; \
	  $(BIN)/pip freeze --all --exclude-editable | grep -v -E '^(pip|setuptools)=='; } > constraints.txt.tmp
	mv constraints.txt.tmp constraints.txt

# The one command that upgrades the tested versions: a fresh venv with the newest
# versions pyproject.toml allows (no constraints), the default test suite in it, and only
# if that passes a new constraints.txt (then `make setup` reinstalls $(VENV) at those).
upgrade:
	rm -rf $(UPGRADE_VENV)
	$(PYTHON) -m venv $(UPGRADE_VENV)
	$(UPGRADE_VENV)/bin/pip install --quiet --upgrade pip
	$(UPGRADE_VENV)/bin/pip install --quiet --upgrade -e '.[dev]'
	$(UPGRADE_VENV)/bin/python $(TEST_DEFAULT)
	$(MAKE) constraints VENV=$(UPGRADE_VENV)
	rm -rf $(UPGRADE_VENV)
	@echo "constraints.txt upgraded (git diff constraints.txt); 'make setup' installs it"
