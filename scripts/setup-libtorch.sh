#!/usr/bin/env bash
# Lays out libtorch 2.11.0 (CPU libraries) from the PyPI torch wheel, for tch 0.24.0.
#
# Idempotent: a second run checks the marker and returns in milliseconds.
# Why not tch's download-libtorch: its host is unreachable here; PyPI is.
# Why only the CPU libraries: torch-sys links libtorch_cuda whenever it sees it in the lib
# folder, which would drag cuDNN/cuBLAS (gigabytes) onto CPU machines. On a GPU machine
# the same binary loads a full torch lib folder at run time (src/guide/cuda.md).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
# Gloo's headers for the c10d shim (independent of the libtorch layout below).
bash "$TREETRAIN_ROOT/scripts/setup-gloo.sh"
# The CUDA runtime's headers for the CUDA-graph library (likewise independent).
bash "$TREETRAIN_ROOT/scripts/setup-cuda-headers.sh"

marker=$LIBTORCH_DIR/.treetrain-layout
if [ -f "$marker" ] && [ "$(cat "$LIBTORCH_DIR/build-version" 2>/dev/null)" = "$TORCH_VERSION" ]; then
    exit 0
fi
if [ -e "$LIBTORCH_DIR" ] && [ ! -f "$marker" ]; then
    found=$(cat "$LIBTORCH_DIR/build-version" 2>/dev/null || echo unknown)
    die "$LIBTORCH_DIR exists but was not laid out by this script (libtorch version: $found; need $TORCH_VERSION).
  Remove it (rm -rf '$LIBTORCH_DIR') or point TREETRAIN_LIBTORCH at an empty folder, then rerun."
fi
if [ -f "$marker" ]; then
    note "libtorch in $LIBTORCH_DIR is version $(cat "$LIBTORCH_DIR/build-version" 2>/dev/null || echo unknown), need $TORCH_VERSION: rebuilding"
    rm -rf "$LIBTORCH_DIR"
fi

command -v "$PYTHON" >/dev/null 2>&1 || die "'$PYTHON' not found. Install Python 3 with pip (Debian: apt-get install python3 python3-pip), or set PYTHON=/path/to/python3."
"$PYTHON" -m pip --version >/dev/null 2>&1 || die "'$PYTHON -m pip' does not work. Install pip (Debian: apt-get install python3-pip), or set PYTHON to a Python that has it."

wheels=$TREETRAIN_CACHE/wheels
mkdir -p "$wheels"
start=$(date +%s)
have_wheels() {
    compgen -G "$wheels/torch-$TORCH_VERSION-*.whl" >/dev/null &&
        compgen -G "$wheels/nvidia_cuda_runtime-$CUDA_RUNTIME_VERSION-*.whl" >/dev/null &&
        compgen -G "$wheels/nvidia_cuda_cupti-$CUDA_CUPTI_VERSION-*.whl" >/dev/null
}
if have_wheels; then
    note "using cached wheels in $wheels"
else
    note "downloading torch==$TORCH_VERSION and two CUDA runtime wheels into $wheels (about 545 MB, cached)"
    "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: \
        --implementation cp --python-version 3.11 \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_25_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$wheels" \
        "torch==$TORCH_VERSION" \
        "nvidia-cuda-runtime==$CUDA_RUNTIME_VERSION" \
        "nvidia-cuda-cupti==$CUDA_CUPTI_VERSION" ||
        die "pip could not download the torch $TORCH_VERSION wheel. treetrain needs PyPI (or a mirror
  configured for pip: PIP_INDEX_URL) to provision libtorch; or copy the wheels torch-$TORCH_VERSION
  (cp311 manylinux_2_28_x86_64), nvidia_cuda_runtime-$CUDA_RUNTIME_VERSION and
  nvidia_cuda_cupti-$CUDA_CUPTI_VERSION into $wheels and rerun."
fi

tmp=$(mktemp -d "${LIBTORCH_DIR%/*}/.libtorch-tmp.XXXXXX" 2>/dev/null || { mkdir -p "${LIBTORCH_DIR%/*}"; mktemp -d "${LIBTORCH_DIR%/*}/.libtorch-tmp.XXXXXX"; })
trap 'rm -rf "$tmp"' EXIT
"$PYTHON" - "$wheels" "$tmp" "$TORCH_VERSION" <<'PY'
import glob, os, shutil, sys, zipfile
wheels, out, version = sys.argv[1:4]
lib = os.path.join(out, "lib")
os.makedirs(lib)

def only(pattern):
    found = sorted(glob.glob(os.path.join(wheels, pattern)))
    if not found:
        sys.exit(f"treetrain setup: error: no wheel matching {pattern} in {wheels}")
    return found[-1]

# Copies, not links: the wheel's libraries find their neighbours relative to their own folder.
cpu_libs = {"libtorch_cpu.so", "libc10.so", "libgomp.so.1"}
with zipfile.ZipFile(only(f"torch-{version}-*.whl")) as z:
    for name in z.namelist():
        if name.endswith("/"):
            continue
        if name.startswith("torch/include/"):
            dest = os.path.join(out, "include", name[len("torch/include/"):])
        elif name.startswith("torch/lib/") and os.path.basename(name) in cpu_libs:
            dest = os.path.join(lib, os.path.basename(name))
        else:
            continue
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        with z.open(name) as src, open(dest, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
for pattern, soname in [("nvidia_cuda_runtime-*.whl", "libcudart.so.13"),
                        ("nvidia_cuda_cupti-*.whl", "libcupti.so.13")]:
    with zipfile.ZipFile(only(pattern)) as z:
        member = next(n for n in z.namelist() if n.endswith("/" + soname))
        with z.open(member) as src, open(os.path.join(lib, soname), "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
missing = [l for l in cpu_libs if not os.path.exists(os.path.join(lib, l))]
if missing:
    sys.exit(f"treetrain setup: error: the torch wheel lacks {missing}")
PY
# tch's link line names -ltorch; the wheel's libtorch.so needs libtorch_cuda.so. An empty
# stand-in satisfies the linker; at run time a real libtorch.so earlier on the library path
# (a full CUDA torch lib folder) wins, which is how CUDA gets enabled.
command -v cc >/dev/null 2>&1 || die "no C compiler (cc) found; install gcc (Debian: apt-get install gcc)"
echo 'int treetrain_libtorch_stub;' | cc -shared -fPIC -Wl,-soname,libtorch.so -x c - -o "$tmp/lib/libtorch.so"
echo "$TORCH_VERSION" >"$tmp/build-version"
echo "torch==$TORCH_VERSION cpu libraries; made by scripts/setup-libtorch.sh" >"$tmp/.treetrain-layout"
mkdir -p "$(dirname "$LIBTORCH_DIR")"
mv "$tmp" "$LIBTORCH_DIR"
trap - EXIT
note "libtorch $TORCH_VERSION ready in $LIBTORCH_DIR ($(du -sh "$LIBTORCH_DIR" | cut -f1), $(( $(date +%s) - start )) s)"
