#!/usr/bin/env bash
# Re-splits the wheels that ../shared/tools/device-ray-wheels.sh left in .rayA/ and .rayB/ into folders
# .ray1/ ... .rayN/, each small enough to travel in one device call beside the working tree (a call carries
# 64 MiB in all: the tracked files, about 1 KiB of overhead each, and the carried folders), and prints the calls.
# `device-ray-wheels.sh`'s own two halves (~51 and ~53 MB) fit only while the tree stays under ~10 MiB.
#
#   bash bench/device_wheel_parts.sh [RESERVE_MIB]   # RESERVE_MIB (default 4): room kept in every call for
#                                                    # what the last one also carries (.whl, .scratch)
# The calls must follow each other within the machine's idle release (30 s), or the parts already sent are lost.
set -euo pipefail
cd "$(dirname "$0")/.."
reserve_mib=${1:-4}
[ -d .rayA ] && [ -d .rayB ] || { echo "run ../shared/tools/device-ray-wheels.sh first (no .rayA/.rayB)" >&2; exit 2; }
tree=$(git ls-files -z | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1 + 1024} END {print s}')
part=$(( 64 * 1024 * 1024 - tree - reserve_mib * 1024 * 1024 ))
[ "$part" -gt $(( 4 * 1024 * 1024 )) ] || { echo "the tree ($tree bytes) leaves no room for wheel parts" >&2; exit 3; }
rm -rf .ray[0-9] .ray[0-9][0-9]
tmp=$(mktemp -d)
tar -cf - -C .rayA . -C ../.rayB . | split -b "$part" -d -a 2 - "$tmp/raypart."
i=0
for f in "$tmp"/raypart.*; do
  i=$((i + 1))
  mkdir -p ".ray$i" && mv "$f" ".ray$i/"
  grep -qsx "/.ray$i/" .git/info/exclude || echo "/.ray$i/" >> .git/info/exclude
done
rmdir "$tmp"
echo "tree $((tree / 1048576)) MiB, $i parts of at most $((part / 1048576)) MiB:"
for j in $(seq 1 $((i - 1))); do
  echo "  call $j, carry [\".ray$j\"]:  mkdir -p /tmp/rp && cp .ray$j/* /tmp/rp/"
done
echo "  call $i, carry [\".ray$i\", \".whl\"]:  cp .ray$i/* /tmp/rp/ && mkdir -p /tmp/rayparts &&" \
  "cat /tmp/rp/raypart.* | tar -xf - -C /tmp/rayparts && <install .whl into /tmp/site> && bash bench/h200_e2e.sh"
