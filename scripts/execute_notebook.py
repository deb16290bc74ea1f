"""Executes one notebook with the treetrain evcxr kernel; on a failing cell, prints everything
the cell emitted (evcxr reports compile errors as cell output, which nbclient's exception omits).

    python scripts/execute_notebook.py notebooks/NAME.ipynb target/notebooks/NAME.ipynb
"""
import os
import sys

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

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
