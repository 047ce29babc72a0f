"""--impl (utils/checker/implementations.py, layout.py): a learner's notebook with a broken cell fails only that
exercise, its helper cells are run, another part's file is skipped, and a bad path is reported once."""

import subprocess
import sys

import pytest

from utils import notebooks
from utils.checker import layout
from utils.checker.layout import ROOT


# --- --impl: broken cells, helper cells, other parts, bad paths ----------------------------------------------

def notebook_with(part: str, change) -> dict:
    nb = notebooks.with_solutions(part)
    change(nb)
    return nb


def exercise_cell(nb, name):
    return next(c for c in nb.cells if "exercise" in c.metadata.get("tags", []) and f"def {name}(" in c.source)


def run_pytest(*args, timeout=600):
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                            cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    return result.returncode, result.stdout + result.stderr


@pytest.mark.slow
def test_impl_notebook_with_a_broken_cell_fails_only_that_exercise(tmp_path):
    import nbformat

    def change(nb):
        exercise_cell(nb, "sample_next_token").source += "\n)"                  # a syntax error
        exercise_cell(nb, "make_steering_hook").source += "\nraise RuntimeError('oops')"  # a top-level exception
        helper = nbformat.v4.new_code_cell("SHIFT = 1\n\ndef shifted(logits, k):\n    return logits[:, k - SHIFT:-1]")
        index = nb.cells.index(exercise_cell(nb, "get_logprobs"))
        nb.cells.insert(index, helper)  # an untagged helper cell that the exercise below uses
        exercise_cell(nb, "get_logprobs").source = (
            "def get_logprobs(logits, tokens, prefix_len=1):\n"
            "    if not 1 <= prefix_len < tokens.shape[1]:\n"
            "        raise ValueError('prefix_len')\n"
            "    return shifted(logits, prefix_len).log_softmax(-1).gather(-1, tokens[:, prefix_len:, None])[..., 0]")

    path = tmp_path / "part0_warmup.ipynb"
    nbformat.write(notebook_with("part0_warmup", change), path)
    code, out = run_pytest("tests/part0_warmup", "--impl", str(path), "-k",
                           "get_logprobs or sample_next_token or make_steering_hook or completion_logprobs_matches")
    assert code == 1, out
    failed = {line.split("::")[1].split(" ")[0] for line in out.splitlines() if line.startswith("FAILED")}
    assert failed and all("sample_next_token" in t or "steering_hook" in t for t in failed), out
    assert "code cell" in out and "SyntaxError" in out and "RuntimeError" in out, out
    assert "get_logprobs_matches_reference" not in " ".join(failed), "the helper cell was not picked up"


@pytest.mark.slow
def test_impl_of_another_part_is_skipped_and_a_bad_path_reported_once(tmp_path):
    code, out = run_pytest("tests/part1_ppo", "--impl", "chapters/part0_warmup.ipynb", "-k", "kl_k3")
    assert code in (0, 5) and "failed" not in out and "skipped" in out, out
    code, out = run_pytest("tests/part0_warmup", "--impl", str(tmp_path / "missing.ipynb"))
    assert code == 4 and out.count("no such file") == 1, out
    (tmp_path / "bad.ipynb").write_text("{not json")
    code, out = run_pytest("tests/part0_warmup", "--impl", str(tmp_path / "bad.ipynb"))
    assert code == 4 and "not a readable notebook" in out, out


def test_part_of_names_the_part_of_files_and_modules():
    assert layout.part_of("tests/part0_warmup/test_get_logprobs.py") == "part0_warmup"
    assert layout.part_of("tests.part3_grpo.test_advantages") == "part3_grpo"
    assert layout.part_of("tests/test_part3_grpo.py") == "part3_grpo"
    assert layout.part_of("/content/drive/MyDrive/Copy of part2_lora.ipynb") == "part2_lora"
    assert layout.part_of("my_answers.ipynb") is None


def test_helper_cells_are_recognised():
    assert layout.is_helper_cell("import math\nEPS = 1e-8\nSCALE = math.sqrt(2)\n\ndef f(x):\n    return x")
    assert not layout.is_helper_cell("model = load_model('tiny')")
    assert not layout.is_helper_cell("print(1)")
    assert not layout.is_helper_cell("!pip install x")
