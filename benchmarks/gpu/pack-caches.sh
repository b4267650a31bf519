#!/usr/bin/env bash
# On the device, at the end of a run: pack the kernel caches this machine built (flashinfer's
# JIT modules, Triton's compiled kernels) into OUT, to be copied into the carry folder, where
# device-env.sh unpacks them on the next fresh machine. A file over 16 MiB does not come back
# from the device, so each is packed with xz and left out if still larger. Usage: pack-caches.sh OUT
set -uo pipefail
out=${1:?OUT}
[ -d ~/.cache/flashinfer ] && tar -cJf "$out/flashinfer-jit-cache.tar.xz" -C ~/.cache flashinfer
[ -d ~/.triton/cache ] && tar -cJf "$out/triton-cache.tar.xz" -C ~ .triton/cache
for f in "$out"/flashinfer-jit-cache.tar.xz "$out"/triton-cache.tar.xz; do
  [ -f "$f" ] && [ "$(stat -c %s "$f")" -gt $((16 << 20)) ] && { echo "too large to come back: $f"; rm -f "$f"; }
done
ls -la "$out"/*cache.tar* 2>/dev/null
# Every cache a first engine process may fill, for the hunt in NOTES.md ("first engine start").
du -sh ~/.triton/cache ~/.cache/* ~/.nv/ComputeCache /tmp/torchinductor_* 2>/dev/null
