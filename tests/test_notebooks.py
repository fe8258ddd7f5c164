"""notebooks/*.ipynb: stored without outputs, and executed headless (nbclient) in small mode.

JAXSPEC_NOTEBOOK_SMALL=1 is read by each notebook's parameter cell and shrinks every size, so
the four together stay within a few minutes of CPU; any cell error fails the test.
"""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def stored_problems(nb) -> list[str]:
    """What a stored notebook must not have: outputs, execution counts; and what it must have:
    the small-mode parameter and the one install cell."""
    out = [f"cell {i} has outputs" for i, c in enumerate(nb.cells) if c.cell_type == "code" and c.get("outputs")]
    out += [f"cell {i} has an execution count" for i, c in enumerate(nb.cells)
            if c.cell_type == "code" and c.get("execution_count") is not None]
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    if not any("JAXSPEC_NOTEBOOK_SMALL" in s for s in code):
        out.append("no parameter cell reading JAXSPEC_NOTEBOOK_SMALL")
    if sum("def platform_kind" in s for s in code) != 1:
        out.append("not exactly one install cell")
    return out


def test_the_four_notebooks_exist():
    assert {p.name for p in NOTEBOOKS} == {"quickstart.ipynb", "ablation.ipynb", "train_head.ipynb", "serve.ipynb"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_stored_without_outputs(path):
    assert stored_problems(nbformat.read(path, as_version=4)) == []


def test_stored_check_has_teeth():
    nb = nbformat.read(NOTEBOOKS[0], as_version=4)
    code = next(c for c in nb.cells if c.cell_type == "code")
    code.outputs = [nbformat.v4.new_output("stream", text="hi")]
    code.execution_count = 3
    assert stored_problems(nb)[:2] == ["cell 1 has outputs", "cell 1 has an execution count"]


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_in_small_mode(path, tmp_path, monkeypatch):
    from nbclient import NotebookClient

    monkeypatch.setenv("JAXSPEC_NOTEBOOK_SMALL", "1")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(path, as_version=4)
    # Run from a scratch folder (the serve notebook writes its log there); any cell error raises.
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
