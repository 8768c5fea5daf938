#!/usr/bin/env bash
# The Debian libraries Mooncake's transfer engine loads even over TCP:
# libibverbs1, libnl-3-200, libnl-route-3-200. Installs the missing ones when
# run as root (apt-get); otherwise says which are missing and exits 1.
set -euo pipefail
missing=()
for lib in libibverbs.so.1:libibverbs1 libnl-3.so.200:libnl-3-200 libnl-route-3.so.200:libnl-route-3-200; do
  ldconfig -p | grep -q "${lib%%:*}" || missing+=("${lib##*:}")
done
[ "${#missing[@]}" -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
  echo "install_mooncake_libs.sh: missing ${missing[*]}; run as root or: sudo apt-get install -y ${missing[*]}" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -q "${missing[@]}" >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q "${missing[@]}" >/dev/null; }
echo "installed ${missing[*]}"
