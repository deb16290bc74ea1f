"""Committed notebook outputs: written from a fresh execution, checked against one.

The notebooks under notebooks/ are committed with their outputs (GitHub shows them), produced by
`scripts/render-notebooks.sh` from an execution of exactly the committed cells. Each carries the
sha256 of its cells file (notebooks/cells/NAME.txt) in `metadata.treetrain.cells_sha256`.

    python scripts/notebook_outputs.py commit EXECUTED.ipynb notebooks/NAME.ipynb notebooks/cells/NAME.txt
    python scripts/notebook_outputs.py check  EXECUTED.ipynb notebooks/NAME.ipynb notebooks/cells/NAME.txt

`check` (run by scripts/run-notebooks.sh after every execution) fails, exit 3, when the committed
outputs are stale: the cells file changed since they were made, a cell's source differs, or a
cell's rich results (their kinds: HTML, text) differ from the fresh execution's. Numbers inside an
output (timings, losses) are not compared: they differ run to run.
"""
import hashlib
import sys

import nbformat


def cells_sha(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def signature(cell):
    """The kinds of results a code cell shows: one tuple of mime types per rich output."""
    kinds = []
    for out in cell.get("outputs", []):
        if out.get("output_type") in ("execute_result", "display_data"):
            kinds.append(tuple(sorted(out.get("data", {}))))
    return kinds


def clean(nb):
    """Drops what changes on every run without telling a reader anything (cell timings)."""
    for cell in nb.cells:
        cell.metadata.pop("execution", None)


def commit(executed, committed, cells):
    nb = nbformat.read(executed, as_version=4)
    clean(nb)
    nb.metadata.setdefault("treetrain", {})["cells_sha256"] = cells_sha(cells)
    nbformat.write(nb, committed)
    print(f"outputs of {executed} committed into {committed}")


def check(executed, committed, cells):
    fresh = nbformat.read(executed, as_version=4)
    saved = nbformat.read(committed, as_version=4)
    problems = []
    recorded = saved.metadata.get("treetrain", {}).get("cells_sha256")
    if recorded != cells_sha(cells):
        problems.append(f"its outputs were made from another version of {cells} (or never made)")
    fresh_code = [c for c in fresh.cells if c.cell_type == "code"]
    saved_code = [c for c in saved.cells if c.cell_type == "code"]
    if len(fresh_code) != len(saved_code):
        problems.append(f"{len(saved_code)} code cells committed, {len(fresh_code)} executed")
    for number, (f, s) in enumerate(zip(fresh_code, saved_code), start=1):
        first = f.source.strip().splitlines()[0] if f.source.strip() else ""
        if f.source != s.source:
            problems.append(f"code cell {number} (`{first}`): source differs")
        elif signature(f) != signature(s):
            problems.append(f"code cell {number} (`{first}`): results {signature(s)} committed, {signature(f)} now")
    for p in problems:
        print(f"stale outputs: {committed}: {p}", file=sys.stderr)
    if problems:
        print(f"FAILED: run `bash scripts/render-notebooks.sh` and commit {committed}", file=sys.stderr)
        sys.exit(3)


if __name__ == "__main__":
    action, executed, committed, cells = sys.argv[1:5]
    {"commit": commit, "check": check}[action](executed, committed, cells)
