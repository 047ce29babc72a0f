"""The chapter notebooks: built from their sources, and runnable top to bottom with the solutions filled in.

The run uses a real Jupyter kernel (as a learner would), on the tiny model, on CPU, with RLHF_SMOKE=1 so that
training cells take seconds. Each exercise cell gets its reference solution's source; each `check(...)` cell
then has to print a pass.
"""

import os

import nbformat
import pytest

from utils import harness, notebooks

PARTS = harness.parts()  # a part without its source fails test_notebook_is_built_from_its_source


@pytest.mark.parametrize("part", PARTS)
def test_notebook_is_built_from_its_source(part):
    path = harness.CHAPTERS / f"{part}.ipynb"
    assert (notebooks.SOURCES / f"{part}.py").exists(), f"chapters/source/{part}.py is missing"
    assert path.read_text() == notebooks.dumps(notebooks.build(part)), (
        f"chapters/{part}.ipynb is stale or was edited by hand: edit chapters/source/{part}.py, then run "
        "python -m utils.notebooks")


def test_stub_keeps_signature_and_docstring_and_drops_the_body():
    stub = notebooks.stub_source("part0_warmup", "get_logprobs")
    decorators, _, rest = stub.partition("def get_logprobs(")
    assert decorators.startswith("@contract(") and rest, "the stub keeps the solution's decorators and signature"
    assert '"""Log-probability' in rest
    assert stub.rstrip().endswith('raise NotImplementedError("write get_logprobs")')
    assert "log_softmax" not in stub, "the stub gives the solution away"


@pytest.mark.slow
@pytest.mark.parametrize("part", PARTS)
def test_notebook_runs_top_to_bottom_with_solutions(part, tmp_path, monkeypatch):
    from nbclient import NotebookClient

    monkeypatch.setenv("RLHF_SMOKE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = notebooks.with_solutions(part)
    NotebookClient(nb, timeout=900, kernel_name="python3",
                   resources={"metadata": {"path": str(harness.CHAPTERS)}}).execute()
    for cell in nb.cells:
        if "check" in cell.metadata.get("tags", []):
            text = "".join(o.get("text", "") for o in cell.outputs)
            assert "✅" in text, f"{part}: `{cell.source}` did not pass with the solution filled in:\n{text}"
    nbformat.write(nb, tmp_path / f"{part}.ipynb")  # kept for a look when a run fails
    assert os.path.getsize(tmp_path / f"{part}.ipynb") > 0
