"""The chapter notebooks: built from their sources, every name their cells use defined by their cells, and runnable
top to bottom with the solutions filled in.

The names are checked statically, with pyflakes, on the notebook as shipped, with the solutions filled in, and as
`--impl` runs it: a notebook must stand alone, since what solutions/ imports for itself (`math`, say) is not in the
learner's kernel. The run uses a real Jupyter kernel (as a learner would), on the tiny model, on CPU, with
RLHF_SMOKE=1 so that training cells take seconds. Each exercise cell gets its reference solution's source; each
`check(...)` cell then has to print a pass.
"""

import ast
import importlib
import os
import re

import nbformat
import pytest
from pyflakes import checker, messages

from utils import notebooks
from utils.checker import implementations, layout

PARTS = layout.parts()  # a part without its source fails test_notebook_is_built_from_its_source


@pytest.mark.parametrize("part", PARTS)
def test_notebook_is_built_from_its_source(part):
    path = layout.CHAPTERS / f"{part}.ipynb"
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


# --- every name a cell uses is defined by a cell ------------------------------------------------------------

# What pyflakes reports when code uses a name that nothing defines (or not yet, or a local before its assignment).
# Its other findings (an import a cell does not use, a name defined twice) are harmless in a notebook.
UNDEFINED = (messages.UndefinedName, messages.UndefinedLocal, messages.UndefinedExport)
MAGIC = re.compile(r"^\s*[!%]")  # IPython's `!shell` and `%magic` lines, which are not Python


class _AsPythonSeesIt(ast.NodeTransformer):
    """Two things pyflakes cannot know without running the code, made explicit before it reads the tree:

    - `from utils.contracts import *` binds the module's public names. Unexpanded, it makes pyflakes give up on
      every undefined name ("may be undefined, or defined from star imports") and the check would pass anything.
    - In `Float[Tensor, "batch seq"]` the string names jaxtyping dimensions; pyflakes would read it as a forward
      reference to names `batch` and `seq`.
    """

    def __init__(self):
        self.jaxtyping: set[str] = set()  # the names jaxtyping's array types are bound to (Float, Int, ...)

    def visit_ImportFrom(self, node):
        if node.module == "jaxtyping":
            self.jaxtyping.update(alias.asname or alias.name for alias in node.names)
        if any(alias.name == "*" for alias in node.names):
            module = importlib.import_module(node.module)
            public = getattr(module, "__all__", [name for name in vars(module) if not name.startswith("_")])
            node.names = [ast.alias(name) for name in public]
        return node

    def visit_Subscript(self, node):
        self.generic_visit(node)
        if isinstance(node.value, ast.Name) and node.value.id in self.jaxtyping:
            for item in node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]:
                if isinstance(item, ast.Constant) and isinstance(item.value, str):
                    item.value = None  # a dimension spec, not code
        return node


def undefined_names(cells: list[tuple[int, str]]) -> list[str]:
    """What pyflakes finds undefined in these (index, source) code cells, run in this order as one module; one line
    per name and line of a cell, naming the cell by its index and first line."""
    lines, starts = [], []  # starts: (first line in the module, cell index, cell source)
    for index, source in cells:
        starts.append((len(lines) + 1, index, source))
        lines += [f"# {line}" if MAGIC.match(line) else line for line in source.splitlines()] + [""]
    found = []
    for message in checker.Checker(_AsPythonSeesIt().visit(ast.parse("\n".join(lines)))).messages:
        if isinstance(message, UNDEFINED):
            start, index, source = max(s for s in starts if s[0] <= message.lineno)
            first = next((line for line in source.splitlines() if line.strip()), "")
            found.append(f"cell {index} (`{first.strip()}`), line {message.lineno - start + 1}: "
                         f"{message.message % message.message_args}")
    return list(dict.fromkeys(found))  # `math.isfinite(x) ... math.nan` is one finding


def _run_by_impl(cell) -> bool:
    """Whether `--impl notebook.ipynb` (and the grader) runs this cell: utils.checker.implementations.runs."""
    return implementations.runs(set(cell.metadata.get("tags", [])), cell.source)


def notebook_variants(part: str) -> dict[str, list[tuple[int, str]]]:
    """The (index, source) code cells of each form of the notebook that someone runs."""
    shipped = nbformat.read(layout.CHAPTERS / f"{part}.ipynb", as_version=4)
    solved = notebooks.with_solutions(part)
    return {"as shipped": [(i, c.source) for i, c in enumerate(shipped.cells) if c.cell_type == "code"],
            "with the solutions filled in": [(i, c.source) for i, c in enumerate(solved.cells)
                                             if c.cell_type == "code"],
            "as `pytest --impl` runs it, solutions filled in": [(i, c.source) for i, c in enumerate(solved.cells)
                                                                if c.cell_type == "code" and _run_by_impl(c)]}


@pytest.mark.parametrize("part", PARTS)
def test_notebook_defines_every_name_its_cells_use(part):
    failures = [f"chapters/{part}.ipynb {variant}: {finding}"
                for variant, cells in notebook_variants(part).items() for finding in undefined_names(cells)]
    assert not failures, (
        "a notebook cell uses a name that no cell of the notebook defines (solutions/ may import it, the learner's "
        "kernel does not):\n  " + "\n  ".join(failures) + f"\nImport or define it in chapters/source/{part}.py "
        "(the [setup] cell, for an import), then run python -m utils.notebooks")


def test_the_names_check_fails_a_notebook_that_uses_an_import_only_solutions_has(tmp_path, monkeypatch):
    """Part 1's bug, in a made-up part: solutions/ imports math, a [provided] cell (as PPOTrainer's `math.nan` did)
    and an exercise's solution use it, the notebook's setup cell does not import it. A star import, jaxtyping
    dimensions and a `!` line are there too: they must neither hide the finding nor add one."""
    for folder in ("solutions", "source", "chapters"):
        (tmp_path / folder).mkdir()
    monkeypatch.setattr(notebooks, "SOLUTIONS", tmp_path / "solutions")
    monkeypatch.setattr(notebooks, "SOURCES", tmp_path / "source")
    monkeypatch.setattr(layout, "CHAPTERS", tmp_path / "chapters")
    (tmp_path / "solutions" / "part9_demo.py").write_text(
        'import math\n\nfrom jaxtyping import Float\nfrom torch import Tensor\n\n\n'
        'def spread(x: Float[Tensor, "batch"]) -> float:\n'
        '    return x.var().item() if len(x) > 1 else math.nan\n\n\n'
        'def finite_or_nan(x: float) -> float:\n'
        '    """x, or NaN where x is infinite."""\n'
        '    return x if math.isfinite(x) else math.nan\n')

    def build(imports: str) -> None:
        (tmp_path / "source" / "part9_demo.py").write_text(
            "# %% [setup]\n!echo on Colab\nfrom jaxtyping import Float\nfrom torch import Tensor\n"
            f"from utils.contracts import *\nfrom utils.checker.notebook import check\n{imports}\n"
            "# %% [provided] spread\n\n# %% [exercise] finite_or_nan\n"
            "# marks: difficulty 1 · importance 1 · 5 minutes\n# hint: `math.isfinite`\n\n# %%\nspread, at_least\n")
        (tmp_path / "chapters" / "part9_demo.ipynb").write_text(notebooks.dumps(notebooks.build("part9_demo")))

    build(imports="")
    in_spread = "cell 1 (`def spread(x: Float[Tensor, \"batch\"]) -> float:`), line 2: undefined name 'math'"
    # cell 2 is the exercise's marks line (markdown); its hint and solution pointer follow the stub
    in_exercise = "cell 3 (`def finite_or_nan(x: float) -> float:`), line 3: undefined name 'math'"
    found = {variant: undefined_names(cells) for variant, cells in notebook_variants("part9_demo").items()}
    assert found == {"as shipped": [in_spread],  # the exercise's stub raises NotImplementedError: no math in it
                     "with the solutions filled in": [in_spread, in_exercise],
                     "as `pytest --impl` runs it, solutions filled in": [in_spread, in_exercise]}
    with pytest.raises(AssertionError, match=re.escape(f"chapters/part9_demo.ipynb as shipped: {in_spread}")):
        test_notebook_defines_every_name_its_cells_use("part9_demo")

    build(imports="import math")
    test_notebook_defines_every_name_its_cells_use("part9_demo")


# The chapter run again on the Llama-style model (MODEL, the first cell): the LoRA's, where the architectures differ
# most. Parts 0 to 5 all ran on it top to bottom (RLHF_MODEL=tiny-llama, 2026-11-28); the suite's time budget holds
# one. (Part 6's lab runs on the GPT-2-style model; the main job on tiny-llama is tests/test_scripts.py's.)
ON_LLAMA = ["part2_lora"]


@pytest.mark.slow
@pytest.mark.parametrize("part,model", [(part, "tiny") for part in PARTS] + [(part, "tiny-llama") for part in ON_LLAMA],
                         ids=PARTS + [f"{part}-llama" for part in ON_LLAMA])
def test_notebook_runs_top_to_bottom_with_solutions(part, model, tmp_path, monkeypatch):
    from nbclient import NotebookClient

    monkeypatch.setenv("RLHF_MODEL", model)
    monkeypatch.setenv("RLHF_SMOKE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    # Each check() cell runs its exercise's tests: this run asks that they pass on the solutions' own source, which the
    # parts' tests already run with the learner's number of drawn examples (tests/generated.py); a few here
    monkeypatch.setenv("RLHF_DRAWN_EXAMPLES", "5")
    # and on the notebook's own model only (utils/checker/plugin.py): the parts' tests run them on both
    monkeypatch.setenv("RLHF_ONE_ARCHITECTURE", "1")
    nb = notebooks.with_solutions(part)
    NotebookClient(nb, timeout=900, kernel_name="python3",
                   resources={"metadata": {"path": str(layout.CHAPTERS)}}).execute()
    for cell in nb.cells:
        if "check" in cell.metadata.get("tags", []):
            text = "".join(o.get("text", "") for o in cell.outputs)
            assert "✅" in text, f"{part}: `{cell.source}` did not pass with the solution filled in:\n{text}"
    nbformat.write(nb, tmp_path / f"{part}.ipynb")  # kept for a look when a run fails
    assert os.path.getsize(tmp_path / f"{part}.ipynb") > 0


def test_one_architecture_is_chosen_only_when_asked_and_only_the_notebooks_model(monkeypatch):
    """RLHF_ONE_ARCHITECTURE=1 (the notebook runs above) keeps the model RLHF_MODEL names; without it, or for a model
    that is neither embedded one, the tests marked both_architectures run on both."""
    from utils.checker.plugin import ARCHITECTURES, architectures

    monkeypatch.delenv("RLHF_ONE_ARCHITECTURE", raising=False)
    monkeypatch.setenv("RLHF_MODEL", "tiny-llama")
    assert architectures() == ARCHITECTURES
    monkeypatch.setenv("RLHF_ONE_ARCHITECTURE", "1")
    assert architectures() == {"llama": "tiny-llama"}
    monkeypatch.setenv("RLHF_MODEL", "tiny")
    assert architectures() == {"gpt2": "tiny"}
    monkeypatch.setenv("RLHF_MODEL", "gpt2")
    assert architectures() == ARCHITECTURES
