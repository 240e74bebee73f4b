#!/bin/bash
# Install what building librustnet needs on a fresh Debian/Ubuntu machine
# (idempotent; quiet when everything is there). Needs root or sudo for apt.
#   libclang-dev : bindgen generates the NCCL ABI bindings from nccl-headers/
#   libibverbs-dev, librdmacm-dev, pkg-config : verbs types at build time
#     (the built plugin does NOT link them: libibverbs is dlopen'ed at run time)
#   iproute2 : the namespace tests (link cut, IPv6 pair, bisect) need ip and tc
#   the script linter (package shellcheck): scripts/test.sh lints every shell script
set -eu
PKGS="libclang-dev clang pkg-config libibverbs-dev librdmacm-dev gcc make python3 binutils iproute2 shellcheck"
missing=""
for p in $PKGS; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
  echo "[deps] installing:$missing" >&2
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get install -y --no-install-recommends $missing >/dev/null 2>&1 \
    || { $SUDO apt-get update >/dev/null 2>&1 && $SUDO apt-get install -y --no-install-recommends $missing >/dev/null; }
fi
command -v cargo >/dev/null || { echo "[deps] cargo not found: install Rust (rustup) first" >&2; exit 1; }
