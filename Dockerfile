# phaseflip GPU image: CUDA torch from PyPI (it bundles the CUDA runtime, NCCL and Triton; the
# host needs only the NVIDIA driver and the NVIDIA container toolkit), the package, and
# `phaseflip serve` as the entrypoint.
#
#   docker build -t phaseflip .
#   docker run --gpus all --ipc=host -p 8000:8000 \
#     -v ~/.cache/huggingface:/root/.cache/huggingface phaseflip --model ORG/NAME
#
# --ipc=host: the ranks of a multi-GPU layout share host memory (/dev/shm) for HiCache pages
# and the flip's weight image. A CPU-only image for a smoke test:
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu -t phaseflip:cpu .
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
# empty: PyPI's default build for Linux (CUDA); or a PyTorch index, e.g. .../whl/cu128
ARG TORCH_INDEX=""

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/phaseflip
RUN if [ -n "$TORCH_INDEX" ]; then \
        pip install "torch==${TORCH_VERSION}" --index-url "$TORCH_INDEX"; \
    else \
        pip install "torch==${TORCH_VERSION}"; \
    fi

COPY pyproject.toml README.md LICENSE ./
COPY phaseflip ./phaseflip
COPY benchmarks ./benchmarks
# the package from this checkout (no version to pin)
# hadolint ignore=DL3013
RUN pip install ".[bench]" && phaseflip --version

EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health')"]
ENTRYPOINT ["phaseflip", "serve", "--host", "0.0.0.0", "--port", "8000"]
