"""Executes one notebook with the treetrain evcxr kernel; on a failing cell, prints everything
the cell emitted (evcxr reports compile errors as cell output, which nbclient's exception omits).

Then checks every cell's result: a value a cell ends with must render as HTML (every type a
notebook user holds has an `evcxr_display`); a result with only `text/plain` is evcxr falling
back to Rust's Debug (the display did not compile, or the type has none), and a bare `()` is a
stray unit value. Either fails, naming the cell.

    python scripts/execute_notebook.py notebooks/NAME.ipynb target/notebooks/NAME.ipynb
"""
import os
import sys

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

def display_problems(nb):
    """(cell number, first source line, what is wrong) for every result that is not HTML."""
    problems = []
    code_cells = [c for c in nb.cells if c.get("cell_type") == "code"]
    for number, cell in enumerate(code_cells, start=1):
        for out in cell.get("outputs", []):
            if out.get("output_type") != "execute_result":
                continue
            data = out.get("data", {})
            plain = "".join(data.get("text/plain", "")).strip()
            first = cell.source.strip().splitlines()[0] if cell.source.strip() else ""
            if plain == "()":
                problems.append((number, first, "a stray `()` result (end the cell with a statement)"))
            elif "text/html" not in data:
                problems.append((number, first, "a result without HTML (evcxr fell back to Debug): " + plain[:120]))
    return problems



src, dst = sys.argv[1:3]
nb = nbformat.read(src, as_version=4)
client = NotebookClient(nb, timeout=1200, startup_timeout=120, kernel_name="treetrain-rust",
                        resources={"metadata": {"path": os.path.dirname(os.path.abspath(src))}})
try:
    client.execute()
except CellExecutionError as e:
    for cell in nb.cells:
        if cell.get("cell_type") != "code":
            continue
        errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
        if errors:
            print("---- failing cell ----\n" + cell.source, file=sys.stderr)
            for o in cell.get("outputs", []):
                text = o.get("text") or "\n".join(o.get("traceback", [])) or str(o.get("data", ""))
                print(text, file=sys.stderr)
    nbformat.write(nb, dst)
    print(f"FAILED: {str(e).splitlines()[0] if str(e) else e}", file=sys.stderr)
    sys.exit(1)
nbformat.write(nb, dst)
problems = display_problems(nb)
for number, first, what in problems:
    print(f"display check: {src} code cell {number} (`{first}`): {what}", file=sys.stderr)
if problems:
    print(f"FAILED: {len(problems)} result(s) without a rich display", file=sys.stderr)
    sys.exit(2)
