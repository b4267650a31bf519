"""Renders a kustomization offline, for validation only (no kustomize or kubectl here).

    python tests/deploy/kustomize_lite.py k8s/overlays/gpu > rendered.yaml

Covers what k8s/ uses: resources (files and folders), components, namespace,
images, replicas, and strategic-merge patches given by path that name their
target by kind and metadata.name. Lists of objects with a `name` key merge
by name (containers, env, volumes, volumeMounts, ports); other lists are
replaced; a null value deletes the key. Anything else in a kustomization is
an error, so this never silently renders something kustomize would not.
Deploy with the real thing: `kubectl apply -k DIR`.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import yaml

KNOWN_KEYS = {"apiVersion", "kind", "resources", "components", "namespace", "images", "replicas",
              "patches"}
CLUSTER_SCOPED = {"Namespace", "PersistentVolume", "ClusterRole", "ClusterRoleBinding",
                  "StorageClass", "PriorityClass"}
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "Job"}


class KustomizeError(ValueError):
    pass


def _load_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _kustomization(folder: Path) -> dict:
    path = folder / "kustomization.yaml"
    if not path.exists():
        raise KustomizeError(f"{folder}: no kustomization.yaml")
    k = yaml.safe_load(path.read_text()) or {}
    unknown = set(k) - KNOWN_KEYS
    if unknown:
        raise KustomizeError(f"{path}: unsupported keys {sorted(unknown)}")
    return k


def merge(base, patch):
    """Strategic merge as used by kubectl for the fields k8s/ patches."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = merge(out[key], value)
            else:
                out[key] = copy.deepcopy(value)
        return out
    if (isinstance(base, list) and isinstance(patch, list) and base and patch
            and all(isinstance(x, dict) and "name" in x for x in base + patch)):
        out = [copy.deepcopy(x) for x in base]
        index = {x["name"]: i for i, x in enumerate(out)}
        for item in patch:
            if item["name"] in index:
                out[index[item["name"]]] = merge(out[index[item["name"]]], item)
            else:
                out.append(copy.deepcopy(item))
        return out
    return copy.deepcopy(patch)


def _apply_patches(folder: Path, k: dict, objects: list[dict]) -> None:
    for entry in k.get("patches", []):
        if set(entry) != {"path"}:
            raise KustomizeError(f"{folder}: only `patches: - path:` is supported, got {entry}")
        for patch in _load_docs(folder / entry["path"]):
            key = (patch["kind"], patch["metadata"]["name"])
            hits = [i for i, o in enumerate(objects) if (o["kind"], o["metadata"]["name"]) == key]
            if len(hits) != 1:
                raise KustomizeError(f"{folder / entry['path']}: patch target {key} matched {len(hits)}")
            objects[hits[0]] = merge(objects[hits[0]], patch)


def _containers(obj: dict):
    spec = obj.get("spec", {}).get("template", {}).get("spec", {})
    for key in ("initContainers", "containers"):
        yield from spec.get(key, [])


def _set_image(container: dict, rule: dict) -> None:
    image = container["image"].split("@")[0]
    name, tag = image, ""
    if ":" in image.rsplit("/", 1)[-1]:
        name, tag = image.rsplit(":", 1)
    if name != rule["name"]:
        return
    new_name = rule.get("newName", name)
    new_tag = rule.get("newTag", tag)
    container["image"] = f"{new_name}:{new_tag}" if new_tag else new_name


def render(folder: str | Path, _component: bool = False) -> list[dict]:
    folder = Path(folder)
    k = _kustomization(folder)
    expected = "Component" if _component else "Kustomization"
    if k.get("kind", "Kustomization") != expected:
        raise KustomizeError(f"{folder}: kind {k.get('kind')!r}, expected {expected}")
    objects: list[dict] = []
    for res in k.get("resources", []):
        path = folder / res
        objects.extend(render(path) if path.is_dir() else _load_docs(path))
    for comp in k.get("components", []):
        ck = _kustomization(folder / comp)
        for res in ck.get("resources", []):
            objects.extend(_load_docs(folder / comp / res))
        _apply_patches(folder / comp, ck, objects)
    _apply_patches(folder, k, objects)
    for rule in k.get("images", []):
        for obj in objects:
            for c in _containers(obj):
                _set_image(c, rule)
    for rule in k.get("replicas", []):
        hits = [o for o in objects if o["kind"] in WORKLOADS and o["metadata"]["name"] == rule["name"]]
        if not hits:
            raise KustomizeError(f"{folder}: replicas for unknown workload {rule['name']}")
        for o in hits:
            o["spec"]["replicas"] = int(rule["count"])
    if "namespace" in k:
        for o in objects:
            if o["kind"] not in CLUSTER_SCOPED:
                o["metadata"]["namespace"] = k["namespace"]
    return objects


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        objects = render(argv[0])
    except (KustomizeError, OSError, KeyError, yaml.YAMLError) as exc:
        print(f"kustomize_lite: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(yaml.safe_dump_all(objects, sort_keys=False))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
