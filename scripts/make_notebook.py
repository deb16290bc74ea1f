"""Writes an evcxr notebook from a list of (kind, source) cells: `python3 scripts/make_notebook.py notebooks/NAME.ipynb < notebooks/cells/NAME.txt`.

Cells in the input are separated by lines `# %% md` or `# %% rust`. Kept so notebooks are edited as
plain text and regenerated, not hand-edited JSON.
"""
import json
import sys

out = sys.argv[1]
cells, kind, lines = [], None, []


def flush():
    if kind is None:
        return
    src = "\n".join(lines).strip("\n")
    cell = {"cell_type": "markdown" if kind == "md" else "code", "metadata": {}, "source": src.splitlines(True)}
    if kind != "md":
        cell.update({"execution_count": None, "outputs": []})
    cells.append(cell)


for line in sys.stdin.read().splitlines():
    if line.startswith("# %% "):
        flush()
        kind, lines = line[5:].strip(), []
    else:
        lines.append(line)
flush()
nb = {
    "cells": cells,
    "metadata": {
        "kernelspec": {"display_name": "Rust (treetrain)", "language": "rust", "name": "treetrain-rust"},
        "language_info": {"codemirror_mode": "rust", "file_extension": ".rs", "mimetype": "text/rust",
                          "name": "Rust", "pygment_lexer": "rust", "version": ""},
    },
    "nbformat": 4,
    "nbformat_minor": 5,
}
for i, c in enumerate(nb["cells"]):
    c["id"] = f"cell-{i}"
json.dump(nb, open(out, "w"), indent=1)
open(out, "a").write("\n")
