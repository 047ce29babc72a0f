"""What the course's progress bars show: none for the embedded models' loads (milliseconds of work), a count that is
what the bar says (a GRPO run of N steps ends at N/N), and, in a notebook, a text bar whose saved output is its last
state (tqdm.auto's widget kept only its first, "0/52", in a saved notebook)."""

import json

import pytest
from transformers.utils import logging as hf_logging

from solutions.part3_grpo import GRPOConfig, GRPOTrainer
from utils.checker.layout import ROOT
from utils.models import load_model


def test_an_embedded_model_loads_without_a_bar_and_leaves_the_switch_as_it_was(capfd):
    was_on = hf_logging.is_progress_bar_enabled()
    for name in ("tiny", "tiny-llama"):
        load_model(name, device="cpu")
    assert "Loading weights" not in capfd.readouterr().err
    assert hf_logging.is_progress_bar_enabled() == was_on, "transformers' progress-bar switch was not put back"
    hf_logging.disable_progress_bar()
    try:
        load_model("tiny", device="cpu")
        assert not hf_logging.is_progress_bar_enabled(), "a switch turned off before the load was turned on"
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


@pytest.mark.slow
def test_the_grpo_bar_counts_the_steps_and_not_the_final_evaluation(capsys):
    GRPOTrainer(GRPOConfig(steps=2, eval_every=2, n_prompts=2, group_size=2, table_every=10 ** 9)).train()
    states = [s.strip() for s in capsys.readouterr().err.replace("\r", "\n").splitlines() if "GRPO steps" in s]
    assert states and "2/2" in states[-1], states
    assert not any("/3" in s or "3/" in s for s in states), states


NOTEBOOK_CELL = """
import sys
sys.path.insert(0, {root!r})
from utils.logger import tqdm
for _ in tqdm(range(3), desc="steps"):
    pass
"""


@pytest.mark.slow
def test_in_a_notebook_the_bar_is_text_on_stdout_whose_last_state_is_saved():
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(NOTEBOOK_CELL.format(root=str(ROOT)))]
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3").execute()
    outputs = nb.cells[0].outputs
    assert all(o.output_type == "stream" and o.name == "stdout" for o in outputs), \
        "a widget or stderr output:\n" + "\n".join(json.dumps(dict(o)) for o in outputs)
    shown = "".join(o.text for o in outputs).split("\r")[-1]  # what a notebook shows of a line redrawn with \r
    assert "3/3" in shown, shown
