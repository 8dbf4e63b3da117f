# Two commands do all set-up on a fresh machine:
#   make demo   prepare, train, interrupt, resume and report on the built-in tiny recipe
#   make test   the whole test suite (what CI runs)
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo lint test test-fast test-floor bench bench-gpu gpu-check clean

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

# The model/loss/attention tests on the lowest transformers/peft/accelerate pyproject allows.
FLOOR_TESTS := tests/test_attention.py tests/test_loss.py tests/test_data_pack.py
test-floor:
	bash scripts/floor_env.sh
	.venv-floor/bin/python -m pytest -q -p no:cacheprovider $(FLOOR_TESTS)
	.venv-floor/bin/python -m pytest -q -p no:cacheprovider tests/test_train.py -k "accumulation or head_only"

# On a CUDA machine: spotune against HF Trainer + PEFT on the Llama-3.1-8B shape (docs/gpu.md).
bench-gpu: setup
	$(PY) benchmarks/gpu.py --json runs/bench-gpu.json

# On a CUDA machine, offline, < 9 min on one H100: the -m gpu tests, the exit paths, a kill-and-resume
# drill on a ~1B Llama and the 8B benchmark; writes gpu-check.md + gpu-check.json (docs/gpu.md).
# GPU extras from a wheel folder: WHEELS=dir make gpu-check. CI runs the dry path (tests/test_gpu_check.py).
GPU_CHECK_OUT ?= runs/gpu-check
gpu-check:
	EXTRAS=test,bench,gpu bash scripts/setup.sh
	$(PY) scripts/gpu_check.py --out $(GPU_CHECK_OUT)

bench: setup
	$(PY) benchmarks/packing.py
	$(PY) benchmarks/overhead.py
	$(PY) benchmarks/resume.py
	$(PY) benchmarks/scaleout.py
	$(PY) benchmarks/forecast.py

clean:
	rm -rf runs .pytest_cache
