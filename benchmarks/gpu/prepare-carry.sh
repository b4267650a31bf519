#!/usr/bin/env bash
# Fill a folder (inside your checkout, ignored by git) with what the H200 machine lacks:
# flashinfer (packed as .tar.xz, JIT), apache-tvm-ffi, grpcio/protobuf/redis-py/hiredis for
# Python 3.12, and Debian's redis-server. Usage: prepare-carry.sh [DIR]  (default .carry)
# Then name DIR in the run's carry list and start the command with:
#   source benchmarks/gpu/device-env.sh DIR
set -euo pipefail
dir=${1:-.carry}; mkdir -p "$dir"; dir=$(cd "$dir" && pwd)
grep -qx "/$(basename "$dir")/" .git/info/exclude 2>/dev/null || echo "/$(basename "$dir")/" >> .git/info/exclude
tmp=$(mktemp -d)
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps "${plat[@]}" -d "$dir" \
  'apache-tvm-ffi>=0.1.11,<0.2' grpcio==1.85.3 protobuf==7.36.2 redis hiredis \
  grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1
python3 -m pip download -q --no-deps -d "$tmp" flashinfer-python==0.7.2.post1
( cd "$tmp" && python3 -m zipfile -e flashinfer_python-*.whl unpacked >/dev/null \
  && cd unpacked && tar cf - flashinfer flashinfer_python-*.dist-info | xz -T0 -6 > "$dir/flashinfer.tar.xz" )
( cd "$dir" && apt-get download redis-server redis-tools liblzf1 libjemalloc2 >/dev/null 2>&1 )
rm -rf "$tmp"
du -sh "$dir"; ls "$dir"
