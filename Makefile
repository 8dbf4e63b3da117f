# Two commands do all set-up on a fresh machine:
#   make demo   prepare, train, interrupt, resume and report on the built-in tiny recipe
#   make test   the whole test suite (what CI runs)
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup setup-test demo lint test test-fast test-floor bench bench-gpu gpu-check gpu-carry clean

# The runtime alone (plus the `gpu` extra where a GPU answers nvidia-smi): what `make demo` and a
# training machine need. `setup-test` adds the test and benchmark tools (docs/install.md has the sizes).
setup:
	bash scripts/setup.sh

setup-test:
	EXTRAS=test,bench bash scripts/setup.sh

demo: setup
	$(PY) scripts/demo.py

# ruff (lint + format) and mypy over the code; part of `make test`, so CI runs them.
RUFF_PATHS := trainer tests benchmarks scripts
lint: setup-test
	$(VENV)/bin/ruff check $(RUFF_PATHS)
	$(VENV)/bin/ruff format --check $(RUFF_PATHS)
	$(VENV)/bin/mypy

# ruff first (seconds); trainer/ compiled to bytecode once (where PYTHONDONTWRITEBYTECODE is set, as on the
# machines this was measured on, each `spotune` child process a test starts compiled it again: 0.35 s each);
# then mypy beside the tests at the lowest priority (scripts/idle_priority.sh: nice 19 in a session of its
# own whose autogroup is niced too, else the kernel's per-session sharing gave it a drill's share), so that
# it runs on the core time the test workers leave idle while their drills wait on child processes (a fresh
# clone's mypy has no cache: about 100 s of CPU, which at equal priority the tests lost), its report printed
# after theirs (ended with make: an interrupted run leaves no mypy behind). One pytest worker per
# core (pytest-xdist), a test module on one worker so that its fixtures are built once, the longest
# modules first (tests/conftest.py, tests/module_seconds.json);
# tests/conftest.py shares the cores' threads out among the workers (a third worker on 2 cores, to fill
# the time drills wait on their children, measured 0.95x the time twice: 1,431 s against 1,509 s, and after
# the modules were ordered 1,210 s against 1,269 s; not worth the extra load on a busy machine).
# --instafail (pytest-instafail) prints each failure, its name and short traceback, the moment it fails,
# not only in the summary at the end.
TEST_WORKERS ?= auto
test: setup-test
	$(VENV)/bin/ruff check $(RUFF_PATHS)
	$(VENV)/bin/ruff format --check $(RUFF_PATHS)
	$(PY) -m compileall -q trainer
	@mkdir -p runs; bash scripts/idle_priority.sh $(VENV)/bin/mypy > runs/mypy.log 2>&1 & mypy=$$!; \
	trap 'kill $$mypy 2>/dev/null' INT TERM; \
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --instafail --tb=short --durations=15 tests; tests=$$?; \
	wait $$mypy; typed=$$?; cat runs/mypy.log; \
	[ $$tests -eq 0 ] && [ $$typed -eq 0 ]

test-fast: setup-test
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

# On a CUDA machine with a network: every part of the GPU check (`python scripts/gpu_check.py --plan`),
# each under its cap, into runs/gpu-check/gpu-check.md + .json (docs/gpu.md). CI runs the dry path
# (tests/test_gpu_check.py). A GPU box without a network: `make gpu-carry` here, then
# `bash .gpu-carry/run.sh` there.
GPU_CHECK_OUT ?= runs/gpu-check
gpu-check:
	EXTRAS=test,gpu bash scripts/setup.sh
	$(PY) scripts/gpu_check.py --out $(GPU_CHECK_OUT)

# .gpu-carry/: the wheels a GPU image with its own torch lacks, the checks' data and run.sh;
# prints what travels (it and the repository) against its 60 MiB cap.
gpu-carry:
	$(if $(wildcard $(PY)),$(PY),python3) scripts/gpu_carry.py

bench: setup-test
	$(PY) benchmarks/packing.py
	$(PY) benchmarks/overhead.py
	$(PY) benchmarks/resume.py
	$(PY) benchmarks/scaleout.py
	$(PY) benchmarks/forecast.py
	$(PY) benchmarks/chat.py

clean:
	rm -rf runs .pytest_cache
