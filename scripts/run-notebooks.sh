#!/usr/bin/env bash
# Executes every notebook (or the ones named) headless with the treetrain evcxr kernel; fails on
# the first cell error. Executed copies land in target/notebooks/ for inspection.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
bash "$TREETRAIN_ROOT/scripts/setup-notebooks.sh"
export JUPYTER_PATH=$TREETRAIN_DEPS/jupyter
out=$TREETRAIN_ROOT/target/notebooks
mkdir -p "$out"
cd "$TREETRAIN_ROOT/notebooks"
notebooks=("$@")
[ ${#notebooks[@]} -gt 0 ] || notebooks=(*.ipynb)
passed=0
for nb in "${notebooks[@]}"; do
    nb=$(basename "$nb")
    start=$(date +%s)
    cp "$nb" "$out/$nb"
    # Executed in place, so relative `:dep` paths resolve from notebooks/ as they do for users.
    if ! "$TREETRAIN_DEPS/venv/bin/jupyter-execute" --kernel_name=treetrain-rust --timeout=1200 \
        --startup_timeout=120 --output="../target/notebooks/${nb%.ipynb}" "$nb"; then
        echo "notebook $nb FAILED (see above; partial output in $out/$nb)" >&2
        exit 1
    fi
    echo "notebook $nb ok ($(( $(date +%s) - start )) s)"
    passed=$((passed + 1))
done
echo "notebooks: $passed passed, 0 failed"
