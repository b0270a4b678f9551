"""Executes the notebooks in place so the stored outputs match the code.

    python scripts/execute_notebooks.py notebooks/01_quickstart.ipynb [...]

`make test` executes them again (nbmake) without writing; this script refreshes what is
stored in the files.
"""

import sys

import nbformat
from nbclient import NotebookClient


def execute(path: str) -> None:
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": "."}}).execute()
    for cell in nb.cells:
        if cell.cell_type == "code":
            # Kernel start-up chatter on stderr is not part of the notebook's story.
            cell.outputs = [o for o in cell.outputs if not (o.get("name") == "stderr" and "IPKernelApp" in o.get("text", ""))]
    nbformat.write(nb, path)
    print(f"executed {path}")


if __name__ == "__main__":
    for notebook in sys.argv[1:]:
        execute(notebook)
