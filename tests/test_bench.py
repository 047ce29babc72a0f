"""The benchmark scripts still run (a few steps each, on the tiny model; TRL is not needed for these).

They measure speed, so nothing here asserts a time: only that each script runs and prints its figures.
(bench/gpu_presets.py's cases of the real Llama-style models run on two random layers in tests/test_real_configs.py.)
"""

import json

import pytest

from tests.support import run_script


@pytest.mark.slow
def test_grpo_comparison_runs_our_side_and_reports_its_figures():
    _, figures = run_script("bench.grpo_vs_trl", "--steps", "3", "--only", "ours", "--json", smoke=False)
    assert figures["bridge_vs_hf_max_logit_diff"] < 1e-3
    assert figures["ours_step_s"] > 0 and figures["ours_accuracy_start"] == pytest.approx(0.4272, abs=1e-4)
    assert "trl_step_s" not in figures and "ratio" not in figures


@pytest.mark.slow
def test_sampling_benchmark_compares_three_samplers():
    _, figures = run_script("bench.sampling", "--repeats", "1", "--json", smoke=False)
    for workload in ("rollout", "decode"):
        for side in ("ours", "bridge", "hf"):
            assert figures[f"{workload}_{side}_tokens_per_s"] > 0
        assert figures[f"{workload}_ratio"] > 0


@pytest.mark.slow
def test_shape_check_benchmark_measures_both_ways():
    _, figures = run_script("bench.shape_checks", "--steps", "2", "--repeats", "1", "--json", smoke=False)
    assert figures["step_s_checked"] > 0 and figures["step_s_unchecked"] > 0 and figures["step_ratio"] > 0
    assert figures["grpo_loss_us_checked"] > 0


def test_gpu_presets_of_a_real_model_offline_propose_random_weights(monkeypatch):
    from bench import gpu_presets
    from utils.models import ModelUnavailableError

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("utils.models._is_cached", lambda name: False)
    with pytest.raises(ModelUnavailableError, match="Qwen2.5-0.5B-Instruct.*--random-weights"):
        gpu_presets.main(["--cases", "grpo_qwen"])


def test_mutation_benchmark_kills_a_mutant_of_get_logprobs(tmp_path):
    pytest.importorskip("mutmut")  # requirements-bench.txt
    out = tmp_path / "mutation.json"
    run_script("bench.mutation", "part0_warmup", "--exercise", "get_logprobs", "--limit", "3", "--no-progress",
               "--messages", "1", "--json", str(out))
    figures = json.loads(out.read_text())
    (exercise,) = figures["exercises"]
    assert exercise["skipped"] is None and exercise["mutants"] == 3
    assert exercise["killed"] >= 1
    assert exercise["killed"] + exercise["survived"] + exercise["timed_out"] + exercise["equivalent"] == 3
    assert len(figures["survivors"]) == exercise["survived"]
    assert figures["messages"]["read"] == exercise["killed"]  # --messages 1: every killed mutant's check() message
    assert figures["messages"]["breaking a rule"] == len(figures["messages"]["faults"])


def test_a_survivor_is_equivalent_only_for_a_reason_the_rules_or_the_triage_give():
    from bench.equivalent_mutants import REFUSAL_WORDS, TRIAGED, equivalent_reason

    definition = 'def f(x):\n    if x < 0:\n        raise ValueError(f"x must be >= 0, got {x}")\n    return x\n'
    assert equivalent_reason("f", definition, definition.replace('f"x must be >= 0, got {x}"', "None"), "", "") \
        == REFUSAL_WORDS
    assert equivalent_reason("f", definition, definition.replace("x < 0", "x <= 0"), "", "") is None
    assert equivalent_reason("f", definition, definition.replace("ValueError", "TypeError"), "", "") is None
    entry = TRIAGED[0]
    assert equivalent_reason(entry.exercise, "", "", entry.original, entry.mutated) == entry.why
    assert equivalent_reason("another", "", "", entry.original, entry.mutated) is None


def test_the_course_operators_drop_one_operand_of_a_condition_and_no_grad():
    """bench/mutation.py's two operators of the course's own, on the references they were written for: a refusal
    that checks one of its two conditions (bradley_terry_loss), a merge that records a graph (merge_lora)."""
    pytest.importorskip("mutmut")  # requirements-bench.txt
    from bench.mutation import find_target, mutants_of

    dropped = {m.mutated for m in mutants_of(find_target("part6_lab", "bradley_terry_loss"))
               if m.operator == "operand_dropped"}
    assert dropped == {"if chosen_scores.shape != rejected_scores.shape:", "if chosen_scores.dim() != 1:"}, dropped
    (no_grad,) = [m for m in mutants_of(find_target("part2_lora", "merge_lora")) if m.operator == "no_grad_dropped"]
    assert no_grad.original == "@torch.no_grad()" and "@torch.no_grad()" not in no_grad.code
