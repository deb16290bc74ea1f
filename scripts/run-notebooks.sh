#!/usr/bin/env bash
# Executes every notebook (or the ones named) headless with the treetrain evcxr kernel; fails on
# the first cell error, printing that cell's output, on a result without HTML, and on committed
# outputs that a fresh execution shows to be stale (scripts/notebook_outputs.py). Executed copies
# land in target/notebooks/.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
bash "$TREETRAIN_ROOT/scripts/setup-notebooks.sh"
export JUPYTER_PATH=$TREETRAIN_DEPS/jupyter
out=$TREETRAIN_ROOT/target/notebooks
mkdir -p "$out"
# The display check must catch a result that fell back to Debug: a notebook made to trip it.
check_log=$out/display_check.log
if "$TREETRAIN_DEPS/venv/bin/python" "$TREETRAIN_ROOT/scripts/execute_notebook.py" \
    "$TREETRAIN_ROOT/tests/notebooks/display_check.ipynb" "$out/display_check.ipynb" 2> "$check_log" \
    || ! grep -q "code cell 2 (\`vec!\[fine, 2, 3\]\`): a result without HTML" "$check_log"; then
    cat "$check_log" >&2
    echo "the notebook display check did not catch a Debug fallback" >&2
    exit 1
fi
echo "display check: catches a Debug fallback (tests/notebooks/display_check.ipynb)"
cd "$TREETRAIN_ROOT/notebooks"
notebooks=("$@")
[ ${#notebooks[@]} -gt 0 ] || notebooks=(*.ipynb)
passed=0
for nb in "${notebooks[@]}"; do
    nb=$(basename "$nb")
    start=$(date +%s)
    # Run from notebooks/, so relative `:dep` paths resolve as they do for users.
    if ! "$TREETRAIN_DEPS/venv/bin/python" "$TREETRAIN_ROOT/scripts/execute_notebook.py" "$nb" "$out/$nb"; then
        echo "notebook $nb FAILED (see above; partial output in $out/$nb)" >&2
        exit 1
    fi
    # The committed outputs (what GitHub shows) must come from these very cells.
    if [ "${TREETRAIN_NOTEBOOK_OUTPUTS:-check}" != skip ]; then
        "$TREETRAIN_DEPS/venv/bin/python" "$TREETRAIN_ROOT/scripts/notebook_outputs.py" check \
            "$out/$nb" "$nb" "cells/${nb%.ipynb}.txt"
    fi
    echo "notebook $nb ok ($(( $(date +%s) - start )) s)"
    passed=$((passed + 1))
done
echo "notebooks: $passed passed, 0 failed"
