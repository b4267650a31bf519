#!/usr/bin/env bash
# Fill a folder (inside your checkout, ignored by git) with what the H200 machine lacks:
# flashinfer (packed as .tar.xz, JIT), apache-tvm-ffi, grpcio/protobuf/redis-py/hiredis for
# Python 3.12, and Debian's redis-server. Usage: prepare-carry.sh [DIR]  (default .carry)
# Then name DIR in the run's carry list and start the command with:
#   source benchmarks/gpu/device-env.sh DIR
set -euo pipefail
# Versions come from pyproject.toml (scripts/pyproject_deps.py); the names are what
# the H200 image lacks. Works in a checkout or a plain copy of the tree.
root=$(cd "$(dirname "$0")/../.." && pwd)
dir=${1:-.carry}; mkdir -p "$dir"; dir=$(cd "$dir" && pwd)
# .carry is in .gitignore; another folder name is excluded where git is there to ask.
if exclude=$(git rev-parse --git-path info/exclude 2>/dev/null); then
  grep -qx "/$(basename "$dir")/" "$exclude" 2>/dev/null || echo "/$(basename "$dir")/" >> "$exclude"
fi
# device-env.sh installs every wheel here: an older version left beside a new one
# would stop that install. A flashinfer JIT cache brought back stays.
rm -f "$dir"/*.whl "$dir"/*.deb "$dir"/flashinfer.tar.xz
deps() { python3 "$root/scripts/pyproject_deps.py" "$@"; }
mapfile -t wheels < <(deps core --only grpcio,grpcio-health-checking,grpcio-reflection,protobuf,redis,fastapi,uvicorn)
mapfile -t flashinfer < <(deps gpu --only flashinfer-python)
tmp=$(mktemp -d)
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64)
# hiredis is redis[hiredis]'s extra, apache-tvm-ffi flashinfer's own dependency, and
# starlette, pydantic (with theirs), opentelemetry-api and annotated-doc are what fastapi
# needs beyond the image:
# --no-deps fetches none of them by itself.
python3 -m pip download -q --no-deps "${plat[@]}" -d "$dir" "${wheels[@]}" hiredis 'apache-tvm-ffi>=0.1.11,<0.2' \
  starlette pydantic pydantic-core annotated-types typing-inspection opentelemetry-api annotated-doc
python3 -m pip download -q --no-deps -d "$tmp" "${flashinfer[@]}"
( cd "$tmp" && python3 -m zipfile -e flashinfer_python-*.whl unpacked >/dev/null \
  && cd unpacked && tar cf - flashinfer flashinfer_python-*.dist-info | xz -T0 -6 > "$dir/flashinfer.tar.xz" )
( cd "$dir" && apt-get download redis-server redis-tools liblzf1 libjemalloc2 >/dev/null 2>&1 )
rm -rf "$tmp"
du -sh "$dir"; ls "$dir"
