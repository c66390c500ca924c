# Kettle's entry points: `make serve` starts the server with the bundled model, `make test` checks everything.
# Everything runs from .venv, created on first use with a Python >= 3.11 found on PATH (PYTHON=... picks one).
# `make serve` installs the server only, `make test` adds the test tools; both through scripts/install.sh, the
# same script the container image runs, and again only when pyproject.toml or the script changes.

PYTHON_MIN := 3.11
# Lazily expanded, and then remembered: the search runs (and says what it found) once, and only when .venv has
# to be created.
PYTHON ?= $(eval PYTHON := $(shell scripts/find-python.sh $(PYTHON_MIN)))$(PYTHON)
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
INSTALL_INPUTS := pyproject.toml scripts/install.sh
# Extra arguments for `make serve` / `make bench`, e.g. `make serve ARGS="--port 8080"`.
ARGS ?=

.PHONY: install install-test serve test lint format bench bench-peers clean

install: $(STAMP)

install-test: $(TEST_STAMP)

$(BIN)/python:
	@test -n "$(PYTHON)" || { echo "make: no Python >= $(PYTHON_MIN) (see above)" >&2; exit 1; }
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(INSTALL_INPUTS) | $(BIN)/python
	PYTHON=$(BIN)/python scripts/install.sh runtime
	touch $(STAMP)

# The test install is a superset of the runtime one, so it stamps both.
$(TEST_STAMP): $(INSTALL_INPUTS) | $(BIN)/python
	PYTHON=$(BIN)/python scripts/install.sh test
	touch $(STAMP) $(TEST_STAMP)

serve: install
	$(BIN)/kettle launch $(ARGS)

test: install-test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/pytest -q
	$(MAKE) test-avx512

# The kernel tests again on the AVX-512 paths, emulated in software where the CPU has no AVX-512 VNNI (SIMDe's
# portable intrinsics: kettle/kernels/kernels.h), so that a run on any CPU checks their bits too. About 3 minutes on
# 2 cores, a minute of it the emulated build.
AVX512_TESTS = tests/unit/test_weight_types.py tests/unit/test_gguf_blocks.py tests/unit/test_cpu_kernels.py \
	tests/unit/test_prefill_kernels.py tests/unit/test_batch_invariance.py tests/unit/test_kv_cache_dtype.py \
	tests/models/test_decoder_step.py tests/models/test_gguf_native.py tests/models/test_batch_invariance_engine.py \
	tests/models/test_lora.py
.PHONY: test-avx512
test-avx512: install-test
	@if grep -q avx512_vnni /proc/cpuinfo; then echo "test-avx512: this CPU runs the AVX-512 paths in the suite itself"; \
	else KETTLE_TUNING=emulate-avx512=on $(BIN)/pytest -q -n 2 -p no:cacheprovider $(AVX512_TESTS); fi

# Unit and model tests, no server launches: the edit-test loop (under two minutes on 2 cores). Two workers
# (pytest-xdist): many of these tests wait on a child process's start (torch's import), and two keep a 2-core machine
# busy meanwhile; more would only crowd the cores each test's torch threads use. `make test` still runs everything,
# end-to-end servers included, one test at a time (their timing checks assume the machine is theirs).
.PHONY: test-fast
test-fast: install-test
	$(BIN)/pytest -q -n 2 -m "unit or model"

lint: install-test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install-test
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# The benchmarks: `python -m bench` lists them (bench/__main__.py). `make bench`: Kettle over HTTP at 1, 4, 8 and 16
# streams against transformers `generate` on the same prompts, each with its default threads, in one run.
bench: install-test
	$(BIN)/python -m bench peers --engines transformers,kettle --streams 1,4,8,16 --threads default $(ARGS)

# The engines a user would pick instead of Kettle, benchmark-only (not in pyproject.toml): neither pulls torch.
# llama-cpp-python builds llama.cpp from source the first time (~5 min).
bench-peers: install-test
	$(BIN)/python -m pip install ctranslate2 llama-cpp-python
	$(BIN)/python -m bench peers $(ARGS)

clean:
	rm -rf $(VENV) build dist *.egg-info
