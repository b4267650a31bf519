"""Reads the deployment files the way Docker and Compose do, so tests run the
commands exactly as written there instead of keeping a second copy."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
COMPOSE = ROOT / "docker-compose.yml"


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, buf = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        buf += stripped
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def _env_pairs(rest: str) -> dict[str, str]:
    import shlex
    return dict(item.split("=", 1) for item in shlex.split(rest))


def image_config(dockerfile: str | Path, target: str | None = None) -> dict:
    """ENTRYPOINT, CMD, ENV, USER, HEALTHCHECK and WORKDIR of a stage (default: the
    last one), following FROM <stage> inheritance as Docker does."""
    path = Path(dockerfile)
    stages: dict[str, dict] = {}
    order: list[dict] = []
    current: dict | None = None
    for word, rest in _instructions(path.read_text()):
        if word == "FROM":
            parts = rest.split()
            parent = stages.get(parts[0])
            current = json.loads(json.dumps(parent)) if parent else {
                "entrypoint": None, "cmd": None, "env": {}, "user": "0", "healthcheck": None,
                "workdir": "/"}
            current["from"] = parts[0]
            if len(parts) == 3 and parts[1].upper() == "AS":
                stages[parts[2]] = current
            order.append(current)
        elif current is None:
            continue
        elif word == "ENTRYPOINT":
            current["entrypoint"] = json.loads(rest)
            current["cmd"] = None  # Docker resets CMD when ENTRYPOINT is set
        elif word == "CMD":
            current["cmd"] = json.loads(rest)
        elif word == "ENV":
            current["env"].update(_env_pairs(rest))
        elif word == "USER":
            current["user"] = rest
        elif word == "WORKDIR":
            current["workdir"] = rest
        elif word == "HEALTHCHECK":
            current["healthcheck"] = None if rest == "NONE" else json.loads(rest.split("CMD", 1)[1])
    if target is not None:
        return stages[target]
    return order[-1]


def image_argv(dockerfile: str | Path, extra: list[str] | None = None) -> list[str]:
    cfg = image_config(dockerfile)
    return list(cfg["entrypoint"] or []) + list(extra if extra is not None else cfg["cmd"] or [])


_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose variable substitution: $$, $VAR, ${VAR}, ${VAR:-default}, ${VAR-default},
    ${VAR:?error}, ${VAR?error}."""
    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(4)
        op, arg = m.group(2), m.group(3)
        val = env.get(name)
        if op in (":-", ":?"):
            unset = not val
        else:
            unset = val is None
        if op and op.endswith("-") and unset:
            return arg
        if op and op.endswith("?") and unset:
            raise KeyError(f"{name}: {arg}")
        return val or ""
    return _VAR.sub(sub, value)


def _walk(node, env):
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [_walk(x, env) for x in node]
    if isinstance(node, dict):
        return {k: _walk(v, env) for k, v in node.items()}
    return node


def compose(env: dict[str, str]) -> dict:
    """docker-compose.yml with anchors merged and variables substituted from env."""
    return _walk(yaml.safe_load(COMPOSE.read_text()), env)


def as_argv(value) -> list[str]:
    import shlex
    if value is None:
        return []
    return shlex.split(value) if isinstance(value, str) else list(value)


def service_argv(service: dict, dockerfile: str | Path) -> list[str]:
    """The container's command line: Compose's entrypoint/command over the image's."""
    cfg = image_config(dockerfile)
    entry = as_argv(service["entrypoint"]) if "entrypoint" in service else list(cfg["entrypoint"] or [])
    if "command" in service:
        cmd = as_argv(service["command"])
    elif "entrypoint" in service:
        cmd = []  # Compose clears the image's CMD when it sets the entrypoint
    else:
        cmd = list(cfg["cmd"] or [])
    return entry + cmd


def service_env(service: dict, dockerfile: str | Path) -> dict[str, str]:
    env = {k: v for k, v in image_config(dockerfile)["env"].items() if k != "PATH"}
    raw = service.get("environment") or {}
    if isinstance(raw, list):
        raw = dict(item.split("=", 1) for item in raw)
    env.update({k: "" if v is None else str(v) for k, v in raw.items()})
    return env
