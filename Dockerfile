# syntax=docker/dockerfile:1
# The image every pod of `xeontune launch --provider kubernetes` runs: xeontune and torch's CPU build
# on a slim Python, nothing else. See docs/kubernetes.md.
#
#   docker build -t registry.example.com/xeontune:0.1 . && docker push registry.example.com/xeontune:0.1
#
# Untested: no container registry or image builder is reachable from the machines this project is
# developed on. tests/cluster/test_kubernetes.py checks what it can (the base against requires-python,
# the torch pin against pyproject.toml, that the files copied build the package, the pods' `python`).
FROM python:3.11-slim-bookworm

# tcmalloc: every rank re-executes itself with it preloaded (xeontune/hardware.py), 1.2-1.4x faster steps.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libtcmalloc-minimal4 \
    && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv

# torch's CPU build first, from PyTorch's CPU index (PyPI's torch is the multi-GB CUDA build); the
# package's own `torch==` pin is then already met. Keep it equal to pyproject.toml's.
ARG TORCH_VERSION=2.13.0
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}"

COPY pyproject.toml README.md /src/
COPY xeontune /src/xeontune
RUN pip install /src && rm -rf /src

# The pods' working dir is the volume claim's mount path (--mount-path, default /workspace).
WORKDIR /workspace
CMD ["python", "-m", "xeontune.train", "--help"]
