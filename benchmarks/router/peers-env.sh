# Source on the offline box, from the tree's root: installs what prepare-peers-carry.sh packed.
#   source benchmarks/router/peers-env.sh [DIR]     (default .carry-peers)
# Sets PYTHONPATH (the router's packages), PATH (wrk, redis-server, py-spy) and
# QUADRIGA_PEERS_SITE (the peers' own folder, for peers.py --peers-site).
_c=${1:-.carry-peers}
_site=/tmp/quadriga-site; _peers=/tmp/quadriga-peers-site; _root=/tmp/quadriga-root
mkdir -p "$_site" "$_peers" "$_root/wrapped"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$_site" "$_c"/router/*.whl
# The peers come as wheels, or (to fit a small carry) already unpacked into site/ of peers.tar.xz.
if [ -f "$_c"/peers.tar.xz ]; then
  tar -xJf "$_c"/peers.tar.xz -C "$_peers" --strip-components=1
elif compgen -G "$_c/peers/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$_peers" "$_c"/peers/*.whl
fi
for d in "$_c"/debs/*.deb; do dpkg -x "$d" "$_root"; done
# The Debian libraries only for the Debian programs: Python keeps the box's own libssl and the rest.
for b in wrk redis-server; do
  printf '#!/bin/sh\nLD_LIBRARY_PATH=%s/usr/lib/x86_64-linux-gnu exec %s/usr/bin/%s "$@"\n' \
    "$_root" "$_root" "$b" > "$_root/wrapped/$b"
  chmod +x "$_root/wrapped/$b"
done
export PYTHONPATH=$_site${PYTHONPATH:+:$PYTHONPATH}
export PATH=$_root/wrapped:$_site/bin:$PATH
export QUADRIGA_PEERS_SITE=$_peers
unset _c _site _peers _root
