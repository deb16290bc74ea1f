#!/usr/bin/env bash
# Unpacks the CUDA runtime's C headers (cuda_runtime_api.h and its neighbours) from the PyPI
# wheels nvidia-cuda-runtime (the one setup-libtorch.sh takes libcudart.so.13 from) and
# nvidia-cuda-crt (crt/host_config.h and the rest of crt/, ~130 kB), CCCL's (nv/target, which
# cuda_fp16.h includes; nvidia-cuda-cccl) and NCCL's (nccl.h, of the version torch pins, from
# nvidia-nccl-cu13) into .deps/cuda/include, for the CUDA-graph and
# NCCL libraries build.rs compiles: libtorch's own CUDA headers (ATen/cuda/CUDAGraph.h,
# c10/cuda/CUDAStream.h, ProcessGroupNCCL.hpp) include them. Nothing is installed and no CUDA
# toolkit is needed; the libraries are only loaded on GPU machines.
#
# Idempotent: returns at once when the headers are there.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

dest=$TREETRAIN_DEPS/cuda
[ -f "$dest/include/crt/host_config.h" ] && [ -f "$dest/include/nccl.h" ] && [ -f "$dest/include/nv/target" ] && exit 0
wheels=$TREETRAIN_CACHE/wheels
mkdir -p "$wheels"
wheel_of() { compgen -G "$wheels/$1-$2-*.whl" | tail -1; }
for spec in "nvidia-cuda-runtime nvidia_cuda_runtime $CUDA_RUNTIME_VERSION" "nvidia-cuda-crt nvidia_cuda_crt $CUDA_CRT_VERSION" \
    "nvidia-cuda-cccl nvidia_cuda_cccl $CUDA_CCCL_VERSION" "nvidia-nccl-cu13 nvidia_nccl_cu13 $NCCL_VERSION"; do
    read -r package file version <<<"$spec"
    [ -n "$(wheel_of "$file" "$version")" ] && continue
    note "downloading $package==$version (CUDA headers) into $wheels"
    "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: \
        --implementation cp --python-version 3.11 \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_18_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 \
        -d "$wheels" "$package==$version" ||
        die "pip could not download $package==$version (PyPI unreachable?)"
done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PYTHON" - "$tmp" "$(wheel_of nvidia_cuda_runtime "$CUDA_RUNTIME_VERSION")" "$(wheel_of nvidia_cuda_crt "$CUDA_CRT_VERSION")" \
    "$(wheel_of nvidia_cuda_cccl "$CUDA_CCCL_VERSION")" "$(wheel_of nvidia_nccl_cu13 "$NCCL_VERSION")" <<'PY'
import os, shutil, sys, zipfile
out, wheels = sys.argv[1], sys.argv[2:]
for wheel in wheels:
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            marker = "/include/"
            if marker not in name or name.endswith("/"):
                continue
            dest = os.path.join(out, "include", name.split(marker, 1)[1])
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            with z.open(name) as src, open(dest, "wb") as dst:
                shutil.copyfileobj(src, dst)
for header in ["cuda_runtime_api.h", "crt/host_config.h", "nv/target", "nccl.h"]:
    if not os.path.exists(os.path.join(out, "include", header)):
        sys.exit(f"treetrain setup: error: the CUDA wheels hold no {header}")
PY
rm -rf "$dest"
mkdir -p "$dest"
mv "$tmp/include" "$dest/include"
note "CUDA runtime and NCCL headers ready in $dest/include"
