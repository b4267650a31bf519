# syntax=docker/dockerfile:1.7
# Quadriga router: client API, replica registry, global scheduler over Redis.
# No model runs here, so no torch: the tokenizer needs only transformers/tokenizers.
#   docker build -f docker/router.Dockerfile -t quadriga/router:0.1.0 .
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

FROM ${PYTHON_IMAGE} AS deps
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml .
COPY scripts/pyproject_deps.py scripts/
# Only the router's runtime dependencies, at the versions pyproject.toml pins.
RUN python -m venv /opt/venv \
    && python scripts/pyproject_deps.py core \
       --only grpcio,grpcio-health-checking,grpcio-reflection,protobuf,redis,transformers,tokenizers,prometheus-client,uvloop,fastapi,uvicorn,httptools,jinja2 \
       > /tmp/requirements-router.txt \
    && /opt/venv/bin/pip install --no-cache-dir -r /tmp/requirements-router.txt

# Fails the build when the committed protocol stubs are stale. grpcio-tools
# lives in a throw-away venv so that it never reaches the runtime image.
FROM deps AS stubs-check
COPY protos/ protos/
COPY common/ common/
COPY scripts/gen_protos.py scripts/
RUN python -m venv --system-site-packages /opt/check \
    && python scripts/pyproject_deps.py core test --only grpcio-tools,protobuf > /tmp/requirements-check.txt \
    && /opt/check/bin/pip install --no-cache-dir -r /tmp/requirements-check.txt \
    && /opt/check/bin/python scripts/gen_protos.py --check \
    && touch /tmp/stubs-ok

FROM ${PYTHON_IMAGE}
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    HF_HOME=/tmp/hf \
    QUADRIGA_ROUTER_PORT=50051 \
    QUADRIGA_ROUTER_METRICS_PORT=9400
RUN groupadd --system --gid 10001 quadriga \
    && useradd --system --uid 10001 --gid quadriga --home-dir /home/quadriga --create-home quadriga \
    && install -d -o quadriga -g quadriga /models
COPY --from=deps /opt/venv /opt/venv
# The stage's marker makes the stub check a dependency of this image.
COPY --from=stubs-check /tmp/stubs-ok /opt/venv/.stubs-ok
WORKDIR /app
COPY common/ common/
COPY router/ router/
COPY docker/grpc_health_probe.py docker/
USER 10001:10001
EXPOSE 50051 9400 8000
# Kubernetes uses its own gRPC probe; this serves docker and compose.
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "docker/grpc_health_probe.py", "--addr", "localhost:50051"]
# Settings come from QUADRIGA_* environment variables (docs/deployment.md);
# flags after the image name are passed on to the router.
ENTRYPOINT ["python", "-m", "router"]
CMD []
