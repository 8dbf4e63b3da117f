# Two commands do all set-up on a fresh machine:
#   make demo   prepare, train, interrupt, resume and report on the built-in tiny recipe
#   make test   the whole test suite (what CI runs)
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test bench clean

setup:
	bash scripts/setup.sh

demo: setup
	$(PY) scripts/demo.py

test: setup
	$(PY) -m pytest -q -p no:cacheprovider --durations=15 tests

bench: setup
	$(PY) benchmarks/packing.py
	$(PY) benchmarks/overhead.py
	$(PY) benchmarks/resume.py
	$(PY) benchmarks/pilot_accuracy.py

clean:
	rm -rf runs .pytest_cache
