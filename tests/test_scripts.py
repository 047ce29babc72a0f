"""The scripts' command lines (`python -m solutions.partN_<topic>`): a flag whose value means nothing is refused by
argparse before any model loads (exit status 2, one line that says what is allowed), and `--steps 0` (`--phases 0`)
trains nothing, measures the starting model and reports its figures, null where a figure needs training."""

import importlib
import subprocess
import sys

import pytest

from tests.support import run_script
from utils.checker.layout import ROOT

# (script, flag, a value that means nothing): one of each kind, for every script
MEANINGLESS = [
    ("part0_warmup", "--samples-per-prompt", "0"),
    ("part0_warmup", "--max-new-tokens", "0"),
    ("part0_warmup", "--temperature", "-0.5"),
    ("part1_ppo", "--phases", "-1"),
    ("part1_ppo", "--kl-coef", "-0.1"),
    ("part1_ppo", "--kl-coef", "nan"),
    ("part2_lora", "--phases", "-1"),
    ("part2_lora", "--rank", "0"),
    ("part2_lora", "--alpha", "0"),
    ("part3_grpo", "--steps", "-1"),
    ("part3_grpo", "--steps", "ten"),
    ("part3_grpo", "--beta", "-0.04"),
    ("part4_reference", "--steps", "-5"),
    ("part4_reference", "--beta", "0"),
    ("part4_reference", "--seeds", "0"),
    ("part5_dpo_rloo", "--steps", "-1"),
    ("part5_dpo_rloo", "--rl-steps", "-1"),
    ("part6_lab", "--seeds", "0"),
]


@pytest.mark.parametrize("script, flag, value", MEANINGLESS)
def test_a_meaningless_flag_is_refused_in_one_line(script, flag, value, capsys, monkeypatch):
    monkeypatch.setenv("RLHF_SMOKE", "1")  # were it accepted, the run that follows is short
    main = importlib.import_module(f"solutions.{script}").main
    with pytest.raises(SystemExit) as exit_:
        main([flag, value])
    error = capsys.readouterr().err
    assert exit_.value.code == 2, f"{script} {flag} {value}: exit status {exit_.value.code}, not argparse's 2"
    assert error.count("\n") == 1, f"the refusal should be one line; got:\n{error}"
    assert flag in error and "expected" in error and value in error, f"it should name the flag, what is allowed " \
                                                                     f"and the value; got: {error}"


def test_the_command_line_exits_2_before_loading_a_model():
    result = subprocess.run([sys.executable, "-m", "solutions.part3_grpo", "--steps", "-1"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        "part3_grpo.py: error: argument --steps: expected an integer >= 0 (0 only evaluates the starting model), "
        "got -1 (see --help)"]
    assert result.stdout == ""


@pytest.mark.parametrize("script", ["part1_ppo", "part2_lora", "part3_grpo", "part4_reference", "part5_dpo_rloo"])
def test_the_help_says_what_0_steps_reports(script, capsys):
    main = importlib.import_module(f"solutions.{script}").main
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    assert "0 trains nothing" in " ".join(capsys.readouterr().out.split())


# --- 0 steps: the starting model's figures, exit status 0 ---------------------------------------------------------
# An explicit --steps wins over RLHF_SMOKE's short default, so these runs train nothing at all.

@pytest.mark.slow
def test_ppo_with_0_phases_measures_the_starting_reward(tmp_path):
    _, figures = run_script("solutions.part1_ppo", "--phases", "0", "--json", "--plot", str(tmp_path / "c.png"))
    assert figures["phases"] == 0
    assert figures["reward_start"] > 0, "one rollout of the starting model gives its mean reward"
    assert figures["reward_end"] is figures["reward_ratio"] is figures["kl_end"] is figures["kl_max"] is None


@pytest.mark.slow
def test_grpo_on_the_llama_style_model_takes_its_preset():
    """`--model tiny-llama` trains the embedded Llama-style model with its preset: rank 4 on all seven projections."""
    _, figures = run_script("solutions.part3_grpo", "--model", "tiny-llama", "--steps", "1", "--json", "--plot", "")
    rank, layers, d, d_kv, d_mlp = 4, 4, 128, 64, 352  # utils/tiny_llama/config.json
    per_layer = {"q": (d, d), "k": (d, d_kv), "v": (d, d_kv), "o": (d, d), "mlp_gate": (d, d_mlp),
                 "mlp_in": (d, d_mlp), "mlp_out": (d_mlp, d)}
    assert figures["model"] == "tiny-llama" and figures["steps"] == 1
    assert figures["trainable_params"] == layers * rank * sum(i + o for i, o in per_layer.values())
    assert figures["accuracy_start"] == 0.4148, "the shipped checkpoint's greedy held-out accuracy (training.json)"


@pytest.mark.slow
def test_grpo_with_0_steps_evaluates_the_starting_model():
    _, figures = run_script("solutions.part3_grpo", "--steps", "0", "--json", "--plot", "")
    assert figures["steps"] == 0
    assert 0 < figures["accuracy_start"] == figures["accuracy_end"] == figures["accuracy_max"] < 1
    assert figures["reward_start"] is figures["reward_end"] is None, "no training batch, so no batch reward"


@pytest.mark.slow
def test_dpo_rloo_with_0_steps_evaluates_every_run():
    _, figures = run_script("solutions.part5_dpo_rloo", "--steps", "0", "--rl-steps", "0", "--json", "--plot", "")
    for run in ("dpo_implicit", "dpo_precomputed", "dpo_precomputed_no_sft", "rloo", "grpo"):
        assert figures[run]["steps"] == 0
        assert 0 < figures[run]["accuracy_start"] == figures[run]["accuracy_end"] < 1, run
