"""Tests of the checker itself (utils/checker/): the diagnosing comparison recognises each kind of difference and
invents none; check() survives a function that never returns and lets an interrupt through; --impl copes with a
broken notebook cell, a learner's helper cells, another part's file and a path that does not exist."""

import json
import math
import subprocess
import sys
import threading
import time

import pytest
import torch

from tests.helpers import CheckFailure, assert_close, assert_equal, assert_raises, describe_difference
from utils import harness, notebooks
from utils.checker import runner

torch.manual_seed(0)
E = torch.randn(6, 5)
MASK = torch.arange(5)[None] < torch.tensor([5, 1, 3, 5, 2, 4])[:, None]


# --- the diagnosing comparison: each kind of difference, named --------------------------------------------------

CASES = [
    ("sign", -E, {}, "opposite sign"),
    ("half", 0.5 * E, {}, "factor of 1/2"),
    ("Bessel", E * 8 / 7, {"group_size": 8}, "G/(G-1) with G = 8"),
    ("temperature", E / 0.7, {"factors": {"1/T with T = 0.7": 1 / 0.7}}, "1/T with T = 0.7"),
    ("tokens", E * MASK.sum().item() / MASK.numel(), {"mask": MASK}, "real tokens / all positions"),
    ("offset", E + 0.3, {}, "off by a constant"),
    ("row offsets", E + torch.arange(1.0, 7.0)[:, None], {}, "each row is off by its own constant"),
    ("row factors", E * torch.arange(2.0, 8.0)[:, None], {}, "each row is off by its own factor"),
    ("shift", torch.cat([E[:, 1:], E[:, :1]], 1), {}, "shifted by one position along dimension 1"),
    ("padding", torch.where(MASK, E, 5.0), {"mask": MASK}, "right on the real tokens"),
    ("real tokens", torch.where(MASK, E + 1, E), {"mask": MASK}, "right on padding"),
    ("rows", torch.cat([E[:2], E[2:4] * 3, E[4:]]), {"group_size": 2}, "rows [2, 3] are wrong"),
    ("columns", torch.cat([E[:, :1] + 1, E[:, 1:]], 1), {}, "only positions [0] of the last dimension"),
    ("order", E.flip(0), {}, "another order"),
    ("zeros", torch.zeros_like(E), {}, "every value is 0"),
    ("NaN on padding", torch.where(MASK, E, float("nan")), {"mask": MASK}, "all of them on padding"),
    ("inf", torch.where(MASK, E, float("inf")).T.contiguous().T, {}, "inf at"),
    ("transposed", E.T, {}, "transposed"),
    ("broadcast", E[None].expand(6, 6, 5), {}, "broadcasting"),
    ("one too many", torch.randn(6, 6), {}, "one position too many along dimension 1"),
    ("size-1 dimension", E[:, :, None], {}, "a dimension of size 1"),
    ("not reduced", E, {"expected": torch.tensor(0.5)}, "a single number"),
    ("dtype", (E > 0), {"expected": (E > 0).float()}, "dtype torch.bool"),
    ("None", None, {}, "returned nothing"),
    ("list", E.tolist(), {}, "got a list"),
]


@pytest.mark.parametrize("label, actual, options, phrase", CASES, ids=[c[0] for c in CASES])
def test_each_kind_of_difference_is_named(label, actual, options, phrase):
    options = dict(options)
    expected = options.pop("expected", E)
    text = describe_difference(actual, expected, **options)
    assert text is not None and phrase in text, f"{label}: {text!r} does not say {phrase!r}"


def test_equal_values_have_no_difference():
    assert describe_difference(E.clone(), E) is None
    assert describe_difference(E + 1e-7, E) is None
    nan = torch.tensor([1.0, float("nan")])
    assert describe_difference(nan.clone(), nan) is None


SPECIFIC = ("sign", "factor", "constant", "shifted", "transposed", "padding", "real tokens", "order", "every value",
            "own", "NaN", "inf")


@pytest.mark.parametrize("seed", range(20))
def test_a_random_difference_gets_no_invented_cause(seed):
    g = torch.Generator().manual_seed(seed)
    expected = torch.randn(6, 5, generator=g)
    actual = torch.randn(6, 5, generator=g)
    text = describe_difference(actual, expected, mask=MASK, group_size=2)
    assert not any(word in text for word in SPECIFIC), text
    assert "values differ" in text
    scalar = describe_difference(torch.tensor(0.37 + seed), torch.tensor(-1.91), group_size=8)
    assert scalar.startswith("got ") and "factor" not in scalar, scalar


def test_a_few_random_errors_are_located_not_explained():
    actual = E.clone()
    actual[3, 2] += 0.5
    text = describe_difference(actual, E, mask=MASK)
    assert "rows [3]" in text and not any(w in text for w in ("sign", "factor", "shifted", "constant")), text


def test_gradients_are_compared():
    x = torch.randn(4, requires_grad=True)
    with pytest.raises(CheckFailure, match="no gradient flows back"):
        assert_close((x * 2).detach(), x * 2, "y")
    with pytest.raises(CheckFailure, match="carry a gradient that the reference's do not"):
        assert_close(x * 2, (x * 2).detach(), "y")
    with pytest.raises(CheckFailure, match=r"\.item\(\)"):
        assert_close((x.sum() * 2).item(), x.sum() * 2, "loss")


def test_failure_message_shows_expected_and_got():
    with pytest.raises(CheckFailure) as raised:
        assert_close(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 3.0]), "f(x)", hint="f doubles its input")
    text = str(raised.value)
    assert text.startswith("f(x): ") and "expected: [2] [1, 3]" in text and "got:      [2] [1, 2]" in text
    assert text.rstrip().endswith("f doubles its input")


def test_assert_equal_and_assert_raises_say_what_happened():
    with pytest.raises(CheckFailure, match="expected 3 items, got 2"):
        assert_equal([1.0, 0.0], [1.0, 0.0, None], "rewards")
    with pytest.raises(CheckFailure, match="should raise a ValueError .*returned 4"):
        assert_raises(ValueError, lambda: 4, what="f()", why="a reason")
    with pytest.raises(CheckFailure, match="raised TypeError"):
        assert_raises(ValueError, lambda: math.floor("x"), what="f()", why="a reason")


# --- check(): time limit, interrupts, stubs ------------------------------------------------------------------

def test_check_gives_up_on_a_function_that_never_returns(capsys):
    def get_logprobs(logits, tokens, prefix_len=1):
        while True:
            pass

    start = time.perf_counter()
    runner.check(get_logprobs, timeout=2)
    assert time.perf_counter() - start < 15
    assert "⏱️ get_logprobs: stopped after 2 s" in capsys.readouterr().out


def test_an_interrupt_during_check_reaches_the_notebook():
    import _thread

    def get_logprobs(logits, tokens, prefix_len=1):
        while True:
            time.sleep(0.01)

    timer = threading.Timer(1.0, _thread.interrupt_main)  # what Jupyter's interrupt button does
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            runner.check(get_logprobs, timeout=30)
    finally:
        timer.cancel()


def test_check_says_a_stub_is_not_written_yet(capsys):
    stub = harness.resolve("stubs", "part0_warmup").get_logprobs
    runner.check(stub)
    assert "✏️ get_logprobs: not written yet" in capsys.readouterr().out


# --- --impl: broken cells, helper cells, other parts, bad paths ----------------------------------------------

def notebook_with(part: str, change) -> dict:
    nb = notebooks.with_solutions(part)
    change(nb)
    return nb


def exercise_cell(nb, name):
    return next(c for c in nb.cells if "exercise" in c.metadata.get("tags", []) and f"def {name}(" in c.source)


def run_pytest(*args, timeout=600):
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                            cwd=harness.ROOT, capture_output=True, text=True, timeout=timeout)
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
    code, out = run_pytest("tests/test_part0_warmup.py", "--impl", str(path), "-k",
                           "get_logprobs or sample_next_token or make_steering_hook or completion_logprobs_matches")
    assert code == 1, out
    failed = {line.split("::")[1].split(" ")[0] for line in out.splitlines() if line.startswith("FAILED")}
    assert failed and all("sample_next_token" in t or "steering_hook" in t for t in failed), out
    assert "code cell" in out and "SyntaxError" in out and "RuntimeError" in out, out
    assert "get_logprobs_matches_reference" not in " ".join(failed), "the helper cell was not picked up"


@pytest.mark.slow
def test_impl_of_another_part_is_skipped_and_a_bad_path_reported_once(tmp_path):
    code, out = run_pytest("tests/test_part1_ppo.py", "--impl", "chapters/part0_warmup.ipynb", "-k", "kl_k3")
    assert code in (0, 5) and "failed" not in out and "skipped" in out, out
    code, out = run_pytest("tests/test_part0_warmup.py", "--impl", str(tmp_path / "missing.ipynb"))
    assert code == 4 and out.count("no such file") == 1, out
    (tmp_path / "bad.ipynb").write_text("{not json")
    code, out = run_pytest("tests/test_part0_warmup.py", "--impl", str(tmp_path / "bad.ipynb"))
    assert code == 4 and "not a readable notebook" in out, out


def test_part_of_names_the_part_of_files_and_modules():
    assert harness.part_of("tests/test_part0_warmup.py") == "part0_warmup"
    assert harness.part_of("tests.test_part3_grpo") == "part3_grpo"
    assert harness.part_of("/content/drive/MyDrive/Copy of part2_lora.ipynb") == "part2_lora"
    assert harness.part_of("my_answers.ipynb") is None


def test_helper_cells_are_recognised():
    assert harness.is_helper_cell("import math\nEPS = 1e-8\nSCALE = math.sqrt(2)\n\ndef f(x):\n    return x")
    assert not harness.is_helper_cell("model = load_model('tiny')")
    assert not harness.is_helper_cell("print(1)")
    assert not harness.is_helper_cell("!pip install x")
    json.dumps(None)
