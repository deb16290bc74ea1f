#!/usr/bin/env bash
# Unpacks Gloo's C++ headers (Debian's libgloo-dev, bookworm) into .deps/gloo/include for the
# c10d shim build.rs compiles: the torch wheel ships ProcessGroupGloo.hpp but not the gloo
# headers it includes. Nothing is installed system-wide (apt-get download + dpkg -x), and the
# library itself is not used: libtorch_cpu.so carries its own Gloo.
#
# Idempotent: returns at once when the headers are there.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

dest=$TREETRAIN_DEPS/gloo
[ -f "$dest/include/gloo/algorithm.h" ] && exit 0
debs=$TREETRAIN_CACHE/debs
mkdir -p "$debs"
if ! compgen -G "$debs/libgloo-dev_*.deb" >/dev/null; then
    command -v apt-get >/dev/null 2>&1 || die "apt-get not found: treetrain's data parallelism needs Gloo's headers.
  Copy Debian bookworm's libgloo-dev .deb into $debs and rerun, or point TREETRAIN_GLOO_INCLUDE at a folder holding gloo/algorithm.h."
    note "downloading Debian's libgloo-dev (Gloo headers, ~50 kB) into $debs"
    (cd "$debs" && apt-get download libgloo-dev >/dev/null 2>&1) ||
        (cd "$debs" && apt-get update -qq >/dev/null 2>&1 && apt-get download libgloo-dev >/dev/null) ||
        die "apt-get could not download libgloo-dev (Debian's package registry unreachable?).
  Copy the .deb into $debs and rerun."
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
dpkg -x "$(compgen -G "$debs/libgloo-dev_*.deb" | tail -1)" "$tmp"
[ -f "$tmp/usr/include/gloo/algorithm.h" ] || die "the libgloo-dev package holds no gloo/algorithm.h"
rm -rf "$dest"
mkdir -p "$dest"
mv "$tmp/usr/include" "$dest/include"
note "Gloo headers ready in $dest/include"
