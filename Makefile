# Two commands do all set-up on a fresh machine:
#   make demo   prepare, train, interrupt, resume and report on the built-in tiny recipe
#   make test   the whole test suite (what CI runs)
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo lint test test-fast bench clean

setup:
	bash scripts/setup.sh

demo: setup
	$(PY) scripts/demo.py

# ruff (lint + format) and mypy over the code; part of `make test`, so CI runs them.
lint: setup
	$(VENV)/bin/ruff check trainer tests benchmarks scripts
	$(VENV)/bin/ruff format --check trainer tests benchmarks scripts
	$(VENV)/bin/mypy

test: lint
	$(PY) -m pytest -q -p no:cacheprovider --durations=15 tests

test-fast: setup
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow" tests

bench: setup
	$(PY) benchmarks/packing.py
	$(PY) benchmarks/overhead.py
	$(PY) benchmarks/resume.py
	$(PY) benchmarks/pilot_accuracy.py

clean:
	rm -rf runs .pytest_cache
