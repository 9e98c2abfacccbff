# Two entry points a new user needs:
#   make run   -> set up .venv, serve the demo model (engines + OpenAI-compatible router)
#   make test  -> set up .venv with dev tools, lint, check architecture, run the tests
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
DEMO := .demo-model
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
	$(BIN)/tandem serve --demo --demo-dir $(DEMO) --engines $(ENGINES) --port $(PORT)

lint: dev
	$(BIN)/ruff check .
	$(BIN)/lint-imports

test: lint
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) $(DEMO)
