#!/usr/bin/env bash
# Renders the notebooks as a reader sees them, and checks what a reader would notice.
#
#   scripts/render-notebooks.sh [NAME.ipynb ...]          execute, commit the outputs into
#                                                          notebooks/, render, screenshot, check
#   scripts/render-notebooks.sh --check [NAME.ipynb ...]  render and check the executions already
#                                                          in target/notebooks/ (the test command)
#
# Pages land in target/rendered/NAME.html with a full-page screenshot NAME.png at 1300 px
# (scripts/inspect_rendered.py lists the checks: clipped SVG text, overflowing outputs,
# right-aligned text columns, wrapping values, Debug text, 05 under 8,000 px).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
bash "$TREETRAIN_ROOT/scripts/setup-render.sh"
executed=$TREETRAIN_ROOT/target/notebooks
out=$TREETRAIN_ROOT/target/rendered
mkdir -p "$out"
check_only=0
if [ "${1:-}" = "--check" ]; then
    check_only=1
    shift
fi
cd "$TREETRAIN_ROOT/notebooks"
notebooks=("$@")
[ ${#notebooks[@]} -gt 0 ] || notebooks=(*.ipynb)
if [ $check_only = 0 ]; then
    # Stale outputs are what this run replaces: execute without the freshness check.
    TREETRAIN_NOTEBOOK_OUTPUTS=skip bash "$TREETRAIN_ROOT/scripts/run-notebooks.sh" "${notebooks[@]}"
    for nb in "${notebooks[@]}"; do
        nb=$(basename "$nb")
        "$TREETRAIN_DEPS/venv/bin/python" "$TREETRAIN_ROOT/scripts/notebook_outputs.py" commit \
            "$executed/$nb" "$nb" "cells/${nb%.ipynb}.txt"
    done
fi
pages=()
for nb in "${notebooks[@]}"; do
    nb=$(basename "$nb")
    [ -e "$executed/$nb" ] || die "no execution of $nb in $executed (run scripts/run-notebooks.sh first)"
    "$TREETRAIN_DEPS/venv/bin/jupyter-nbconvert" --log-level=ERROR --to html --template lab \
        --output-dir "$out" "$executed/$nb"
    pages+=("$out/${nb%.ipynb}.html")
done
"$TREETRAIN_DEPS/venv/bin/python" "$TREETRAIN_ROOT/scripts/inspect_rendered.py" "${pages[@]}"
