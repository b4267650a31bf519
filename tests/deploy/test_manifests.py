"""Offline validation of the deployment files, plus the cross-checks no schema
makes: environment names each process really reads, grace periods longer than
the drain timeout, one GPU per replica pod, non-root images with pinned bases."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.deploy.deployfiles import COMPOSE, DOCKER, ROOT, compose, image_config
from tests.deploy.kustomize_lite import render

BIN = Path(sys.executable).parent
OVERLAYS = sorted(p for p in (ROOT / "k8s" / "overlays").iterdir() if p.is_dir())
# Names the deployment sets for router features still being built; the router
# ignores unknown environment variables, so they are harmless until then.
PENDING_ROUTER_ENV: set[str] = set()  # router settings named in manifests before the router reads them


def _tool(name: str) -> str:
    path = BIN / name
    if path.exists():
        return str(path)
    found = shutil.which(name)
    if not found:
        pytest.skip(f"{name} is not installed (it is in pyproject.toml's [test] extra)")
    return found


def _run(*argv) -> None:
    # check_deploy.sh finds the validators beside the Python it is given: this one.
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]


def test_check_deploy_script_passes():
    for name in ("check-jsonschema", "kubernetes-validate", "hadolint", "yamllint"):
        _tool(name)
    _run("bash", "scripts/check_deploy.sh")


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_overlay_renders_and_validates(overlay, tmp_path):
    out = tmp_path / "rendered.yaml"
    out.write_text(yaml.safe_dump_all(render(overlay)))
    _run(_tool("kubernetes-validate"), "--strict", "--quiet", str(out))


def _objects(overlay: str) -> dict[tuple[str, str], dict]:
    return {(o["kind"], o["metadata"]["name"]): o for o in render(ROOT / "k8s" / "overlays" / overlay)}


def _pod(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]


def _router_env_names() -> set[str]:
    from router.config import env_names
    return set(env_names().values())


def _worker_env_names() -> set[str]:
    from replica_worker.worker.config import env_names
    return env_names()


@pytest.mark.parametrize("overlay", [p.name for p in OVERLAYS])
def test_k8s_env_names_are_read_by_router_and_replicas(overlay):
    objs = _objects(overlay)
    config = objs[("ConfigMap", "quadriga-config")]["data"]
    known = _router_env_names() | _worker_env_names() | {"HF_HUB_OFFLINE"}
    assert not set(config) - known, f"unknown settings in the ConfigMap: {set(config) - known}"
    router_env = {e["name"] for e in _pod(objs[("Deployment", "quadriga-router")])["containers"][0]["env"]}
    assert router_env - PENDING_ROUTER_ENV <= _router_env_names()
    replica_env = {e["name"] for e in _pod(objs[("Deployment", "quadriga-replica")])["containers"][0]["env"]}
    assert replica_env <= _worker_env_names()


def test_compose_env_names_are_read_by_router_and_replicas():
    services = compose({"REPLICA_TOKEN": "t"})["services"]
    for name in ("router", "router-cpu"):
        env = set(services[name]["environment"])
        assert env - PENDING_ROUTER_ENV <= _router_env_names(), name
    for name in ("replica-cpu", "replica-gpu-0"):
        assert set(services[name]["environment"]) <= _worker_env_names(), name


def _seconds(value: str) -> float:
    m = re.fullmatch(r"(\d+)(s|m)", str(value))
    assert m, value
    return int(m.group(1)) * (60 if m.group(2) == "m" else 1)


def test_grace_periods_outlast_the_drain_timeout():
    for overlay in (p.name for p in OVERLAYS):
        objs = _objects(overlay)
        drain = float(objs[("ConfigMap", "quadriga-config")]["data"]["QUADRIGA_DRAIN_TIMEOUT_S"])
        grace = _pod(objs[("Deployment", "quadriga-replica")])["terminationGracePeriodSeconds"]
        assert grace >= drain + 15, overlay
    services = compose({"REPLICA_TOKEN": "t"})["services"]
    for name in ("replica-cpu", "replica-gpu-0", "replica-gpu-7"):
        svc = services[name]
        drain = float(svc["environment"]["QUADRIGA_DRAIN_TIMEOUT_S"])
        assert _seconds(svc["stop_grace_period"]) >= drain + 15, name


def test_gpu_overlay_gives_each_replica_pod_one_gpu():
    objs = _objects("gpu")
    replica = objs[("Deployment", "quadriga-replica")]
    resources = _pod(replica)["containers"][0]["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 1
    assert objs[("ConfigMap", "quadriga-config")]["data"]["QUADRIGA_DEVICE"] == "cuda"
    assert ("PodDisruptionBudget", "quadriga-replica") in objs


def test_compose_gpu_replicas_each_reserve_their_own_gpu():
    services = compose({"REPLICA_TOKEN": "t"})["services"]
    ids = []
    for name, svc in services.items():
        if name.startswith("replica-gpu-"):
            devices = svc["deploy"]["resources"]["reservations"]["devices"]
            assert len(devices) == 1 and devices[0]["capabilities"] == ["gpu"]
            ids += devices[0]["device_ids"]
    assert len(ids) == len(set(ids)) == 8


def test_router_probes_use_grpc_health():
    for overlay in (p.name for p in OVERLAYS):
        router = _pod(_objects(overlay)[("Deployment", "quadriga-router")])["containers"][0]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert router[probe]["grpc"]["port"] == 50051, (overlay, probe)


def test_pods_run_as_non_root_with_pinned_images():
    for overlay in (p.name for p in OVERLAYS):
        for obj in _objects(overlay).values():
            if "template" not in obj.get("spec", {}):
                continue
            pod = _pod(obj)
            assert pod["securityContext"]["runAsNonRoot"] is True, obj["metadata"]["name"]
            for c in pod.get("initContainers", []) + pod["containers"]:
                tag = c["image"].rsplit(":", 1)[-1]
                assert ":" in c["image"] and tag != "latest", c["image"]
                assert c["securityContext"]["allowPrivilegeEscalation"] is False


def test_secret_keys_used_are_documented_in_the_example():
    example = yaml.safe_load((ROOT / "k8s" / "secret.example.yaml").read_text())
    keys = set(example["stringData"])
    for overlay in (p.name for p in OVERLAYS):
        for obj in _objects(overlay).values():
            if "template" not in obj.get("spec", {}):
                continue
            for c in _pod(obj)["containers"]:
                for e in c.get("env", []):
                    ref = e.get("valueFrom", {}).get("secretKeyRef")
                    if ref:
                        assert ref["name"] == "quadriga-secrets" and ref["key"] in keys, ref


@pytest.mark.parametrize("name", ["router", "replica", "replica-cpu"])
def test_images_are_non_root_and_pinned(name):
    path = DOCKER / f"{name}.Dockerfile"
    cfg = image_config(path)
    assert cfg["user"] not in ("0", "root", "0:0") and cfg["user"].split(":")[0] != "0"
    text = path.read_text()
    for default in re.findall(r"^ARG \w+_IMAGE=(\S+)", text, flags=re.M):
        assert ":" in default and not default.endswith(":latest"), default
    assert "gen_protos.py --check" in text


def test_dockerignore_keeps_secrets_and_venv_out():
    lines = set((ROOT / ".dockerignore").read_text().split())
    assert {".venv/", ".env", "*.pem", "*.key"} <= lines


def test_compose_file_is_the_one_documented():
    doc = (ROOT / "docs" / "deployment.md").read_text()
    assert COMPOSE.name in doc
    for name in sorted(_router_env_names() | _worker_env_names()):
        if name in ("QUADRIGA_ROUTER_HOST", "QUADRIGA_REDIS_PREFIX"):
            continue
        assert name in doc, f"{name} is missing from docs/deployment.md"
