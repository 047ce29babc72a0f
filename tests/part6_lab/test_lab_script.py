"""The lab's script, `python -m solutions.part6_lab`, which runs the five experiments; and the experiments' refusal of
an exercise they do not take."""

import pytest

from solutions import part6_lab as ref
from tests.support import run_script


# --- The script: every experiment, and the figures issue 16 asks for ------------------------------------------------

@pytest.mark.slow
def test_the_lab_script_reports_every_experiment(tmp_path):
    """`python -m solutions.part6_lab --json` (smoke setting) runs the five experiments and reports the figures
    docs/lab.md quotes, and the exact-gradient results agree with the theory. One seed: what the script adds to the
    experiments is their order, the JSON and the figures; each experiment's own test (and the notebook's run) takes
    them over several seeds."""
    _, figures = run_script("solutions.part6_lab", "--json", "--seeds", "1", "--plots", str(tmp_path / "lab"),
                            timeout=900)
    assert figures["seeds"] == [0], figures["seeds"]
    for key in ("kl_gradients", "hacking", "length_bias", "layer_ablation", "off_policy", "seconds"):
        assert key in figures, f"the script's JSON has no {key!r}; it has {sorted(figures)}"
    kl = figures["kl_gradients"]
    for name in ("k1_loss", "k2_loss", "k3_loss", "exact_token_loss", "k1_reward"):
        assert set(kl[name]) >= {"cosine_reverse", "cosine_forward", "norm_ratio"}, f"kl_gradients[{name!r}]"
    assert kl["k1_loss"]["norm_ratio"] < 1e-5, "k1 in the loss has zero expected gradient"
    assert abs(kl["k1_reward"]["cosine_reverse"] - 1.0) < 1e-4, "k1 in the reward follows the reverse KL"
    hacking = figures["hacking"]
    assert set(hacking) >= {"proxy_start", "proxy_end", "gold_start", "gold_end", "beta_sweep"}, "hacking's keys"
    for point in hacking["beta_sweep"]:
        assert set(point) >= {"beta", "kl", "proxy", "gold"}, f"a beta_sweep entry: {point}"
    # best-of-n's KL computed exactly from the pool (ties counted), never above the formula, which bounds it
    for point in hacking["best_of_n"]:
        assert point["kl"] <= point["kl_formula"] + 1e-9, f"a best_of_n entry above its upper bound: {point}"
    assert set(hacking["best_of_n_fall"]) >= {"diff", "se"}, "hacking.best_of_n_fall"
    assert "head_only" in hacking, "hacking.head_only, the proxy without its likelihood term"
    exact = figures["off_policy"]["exact"]
    assert len(exact) >= 7 and all(set(e) >= {"correction", "cap", "cosine", "norm_ratio"} for e in exact), \
        "off_policy.exact: each correction's expected gradient against the on-policy one"
    for name in ("grpo", "dr_grpo", "control"):  # the configurations trained (and the settings, under "settings")
        lengths = figures["length_bias"][name]
        assert set(lengths) >= {"wrong_start", "wrong_end", "right_start", "right_end"}, f"length_bias[{name!r}]"
    assert set(figures["length_bias"]["paired"]) >= {"mean", "standard_error", "seeds"}, "length_bias.paired"
    assert isinstance(figures["length_bias"]["positive_control"]["detected"], bool), "length_bias.positive_control"
    ablation = figures["layer_ablation"]
    assert set(ablation) >= {"all", "none", "without"}, "layer_ablation's keys"
    assert len(ablation["without"]) == 4, "one accuracy without each of the tiny model's 4 blocks"
    for name in ("kl_gradients", "hacking", "length_bias", "policy_shift", "off_policy"):
        assert (tmp_path / f"lab_{name}.png").exists(), f"the script saved no figure for {name}"


def test_an_experiment_refuses_an_exercise_it_does_not_take():
    """A misspelt keyword would otherwise run the reference silently instead of the learner's version: every
    experiment takes the learner's functions as explicit keyword arguments, so Python refuses an unknown one."""
    from solutions.part6_lab import off_policy, policy_shift

    for experiment in (off_policy, policy_shift):
        with pytest.raises(TypeError, match=r"unexpected keyword argument 'token_log_ratio'"):
            experiment.run(seeds=[0], smoke=True, token_log_ratio=ref.token_log_ratios)
