"""The off_policy experiment's exercises: clip_fraction, truncated_importance_weights, tis_grpo_loss (which without
weights is Part 3's grpo_loss); the experiment in its smoke setting."""

import math

import pytest
import torch
from torch import Tensor

from solutions import part6_lab as ref
from solutions.part3_grpo import grpo_loss
from tests.support import assert_close, assert_gradients_match, assert_inputs_unchanged, assert_raises, exercise, expect


# --- clip_fraction -------------------------------------------------------------------------------------------------

def _clip_inputs(seed=0):
    """Ratios [6, 7] around 1 with some exactly on the bounds 0.75, 1.25 and 1.5 (epsilon 0.25, epsilon_high 0.5);
    advantages of both signs and one of exactly 0 (a group whose rewards were all equal); a ragged mask with an
    empty row; and padding whose ratios are far outside every clip range (so counting padding shows)."""
    g = torch.Generator().manual_seed(seed)
    ratio = torch.exp(torch.randn(6, 7, generator=g) * 0.3)
    ratio[0, :5] = torch.tensor([0.75, 1.25, 1.5, 0.5, 0.79])
    ratio[1, :5] = torch.tensor([1.25, 1.5, 0.5, 1.6, 1.21])
    ratio[2, :3] = torch.tensor([0.3, 2.0, 0.6])
    advantages = torch.tensor([-1.0, 0.7, 0.0, -0.3, 1.2, 0.4])
    mask = torch.arange(7)[None] < torch.tensor([7, 5, 3, 0, 6, 2])[:, None]
    padding = torch.where(advantages[:, None] < 0, 0.1, 3.0).expand(6, 7)
    return torch.where(mask, ratio, padding), advantages, mask


CLIP_CONFIGS = [(0.2, None), (0.2, 0.28), (0.25, None), (0.25, 0.5), (0.1, 0.0)]
CLIP_HINT = ("The share of the real tokens (mask True) whose gradient the clip takes away: ratio < 1 - epsilon "
             "with A < 0, or ratio > 1 + epsilon_high with A > 0 (strict; epsilon_high None means epsilon); a "
             "token with A = 0 is never counted. Divide by the number of real tokens (at least 1).")


@exercise("clip_fraction")
def test_clip_fraction_matches_reference(impl):
    ratio, advantages, mask = _clip_inputs()
    for epsilon, epsilon_high in CLIP_CONFIGS:
        what = f"clip_fraction(epsilon={epsilon}, epsilon_high={epsilon_high})"
        out = impl.clip_fraction(ratio.clone(), advantages.clone(), mask.clone(), epsilon, epsilon_high)
        assert_close(out, ref.clip_fraction(ratio, advantages, mask, epsilon, epsilon_high), what,
                     factors={"23 (the number of real tokens)": 23.0, "42 (every position)": 42.0,
                              "42/23 (positions over real tokens)": 42 / 23}, hint=CLIP_HINT)


@exercise("clip_fraction")
def test_clip_fraction_counts_each_token_where_the_clip_takes_its_gradient(impl):
    """Each real token alone in the mask: the fraction is 1 exactly when the clip takes that token's gradient."""
    ratio, advantages, mask = _clip_inputs(seed=1)
    for epsilon, epsilon_high in ((0.25, None), (0.25, 0.5)):
        high = epsilon if epsilon_high is None else epsilon_high
        wrong, counted_values = [], set()
        for i, j in mask.nonzero().tolist():
            alone = torch.zeros_like(mask)
            alone[i, j] = True
            got = impl.clip_fraction(ratio.clone(), advantages.clone(), alone, epsilon, epsilon_high)
            want = ref.clip_fraction(ratio, advantages, alone, epsilon, epsilon_high)
            if not (isinstance(got, Tensor) and torch.isclose(got.float(), want.float())):
                is_counted = isinstance(got, Tensor) and got.numel() == 1 and bool(got.float() != 0)
                wrong.append(f"ratio {ratio[i, j].item():.3g} with A = {advantages[i].item():g}: "
                             f"{'counted' if want.item() == 0 else 'not counted'}"
                             + (f" (got {got.item():.4g}, expected 1)" if is_counted and want.item() != 0 else ""))
                if is_counted and want.item() != 0:
                    counted_values.add(round(got.item(), 6))
        which = (f"with the clip range [{1 - epsilon:g}, {1 + high:g}] a token counts exactly when its ratio is below "
                 f"{1 - epsilon:g} with A < 0 or above {1 + high:g} with A > 0 (strictly: a ratio on the bound is not "
                 "clipped), and a token with A = 0 never counts")
        if wrong and len(counted_values) == 1 and all(w.endswith("expected 1)") for w in wrong):
            # every miss is a counted token given the same wrong value: the condition is right, the division is not
            value = counted_values.pop()
            message = (f"the right tokens are counted (nonzero exactly where the clip takes the gradient), but with "
                       f"one real token in the mask a counted token gives {value:.4g}, not 1 (1 counted of 1 real "
                       f"token): the count is divided by {1 / value:.4g} instead of the number of real tokens")
        else:
            message = f"{which}; wrong here: {'; '.join(wrong[:5])}{' ...' if len(wrong) > 5 else ''}"
        expect(not wrong, f"which tokens clip_fraction(epsilon={epsilon}, epsilon_high={epsilon_high}) counts",
               message, observed=tuple(wrong))


@exercise("clip_fraction")
def test_clip_fraction_is_zero_on_policy_and_without_tokens(impl):
    _, advantages, mask = _clip_inputs()
    ones = torch.ones(6, 7)
    assert_close(impl.clip_fraction(ones, advantages.clone(), mask.clone(), 0.2, 0.28), torch.tensor(0.0),
                 "clip_fraction of ratios that are all 1 (num_iterations 1: the policy has not moved)",
                 hint="A ratio of 1 is inside every clip range: nothing is clipped.")
    ratio, _, _ = _clip_inputs(seed=2)
    got = impl.clip_fraction(ratio, advantages.clone(), torch.zeros_like(mask), 0.2)
    assert_close(got, torch.tensor(0.0), "clip_fraction with no real token at all",
                 hint="No token: 0, not 0/0 = NaN" + (" (divide by the count clamped to at least 1)." if isinstance(
                     got, Tensor) and got.isnan().any() else "."))


@exercise("clip_fraction")
def test_clip_fraction_leaves_inputs_alone_and_refuses_a_negative_epsilon(impl):
    ratio, advantages, mask = _clip_inputs(seed=3)
    assert_inputs_unchanged(impl.clip_fraction, ratio, advantages, mask, 0.2, 0.28, what="clip_fraction")
    for bad in ({"epsilon": -0.1}, {"epsilon_high": -0.1}):
        assert_raises(ValueError, impl.clip_fraction, ratio, advantages, mask, **bad, what=f"clip_fraction({bad})",
                      why="the clip range [1 - epsilon, 1 + epsilon_high] needs epsilons >= 0")


# --- truncated_importance_weights ----------------------------------------------------------------------------------

def _tis_inputs(seed=0):
    """Trainer and sampler log-probs [6, 7] whose log-ratios span [-2, 2] (ratios from 0.14 to 7.4: above every cap
    and below 1/cap), a ragged mask with an empty row, and padding whose log-probs are not 0 (so that forgetting the
    mask shows)."""
    g = torch.Generator().manual_seed(seed)
    sampler = -torch.rand(6, 7, generator=g) * 3 - 0.05
    log_ratio = torch.rand(6, 7, generator=g) * 4 - 2
    log_ratio[0, :4] = torch.tensor([-2.0, -0.8, 0.5, 1.9])
    mask = torch.arange(7)[None] < torch.tensor([7, 5, 3, 0, 6, 2])[:, None]
    return (sampler + log_ratio).clamp(max=-0.01), sampler, mask


TIS_HINT = ("Per token: min(exp(trainer_logprobs - sampler_logprobs), cap), i.e. pi_trainer / pi_sampler capped "
            "from above only (a small ratio is kept as it is), detached, and 0 on padding (mask False).")


@exercise("truncated_importance_weights")
def test_truncated_importance_weights_match_reference(impl):
    trainer, sampler, mask = _tis_inputs()
    for cap in (2.0, 1.5, 5.0):
        what = f"truncated_importance_weights(cap={cap})"
        out = impl.truncated_importance_weights(trainer.clone(), sampler.clone(), mask.clone(), cap)
        assert_close(out, ref.truncated_importance_weights(trainer, sampler, mask, cap), what, mask=mask,
                     hint=TIS_HINT)


@exercise("truncated_importance_weights")
def test_truncated_importance_weights_are_constants(impl):
    """The weight multiplies a token's loss as a number: no gradient may flow back through it into the trainer."""
    trainer, sampler, mask = _tis_inputs(seed=1)
    leaf = trainer.clone().requires_grad_(True)
    out = impl.truncated_importance_weights(leaf, sampler.clone(), mask.clone())
    assert_close(out, ref.truncated_importance_weights(trainer, sampler, mask), "truncated_importance_weights of "
                 "trainer log-probs that require a gradient", mask=mask, hint=TIS_HINT, gradient_hint="Detach them "
                 "(or compute under torch.no_grad()): in Yao et al.'s estimator the weight is a constant factor of the "
                 "gradient.")


@exercise("truncated_importance_weights")
def test_truncated_importance_weights_of_equal_policies_are_one(impl):
    _, sampler, mask = _tis_inputs(seed=2)
    assert_close(impl.truncated_importance_weights(sampler.clone(), sampler.clone(), mask.clone(), 1.5),
                 mask.float(), "truncated_importance_weights when the sampler is the trainer", mask=None,
                 hint="pi_trainer / pi_sampler = 1 on every real token, 0 on padding.")


@exercise("truncated_importance_weights")
def test_truncated_importance_weights_leave_inputs_alone_and_refuse_bad_values(impl):
    trainer, sampler, mask = _tis_inputs(seed=3)
    assert_inputs_unchanged(impl.truncated_importance_weights, trainer, sampler, mask, 3.0,
                            what="truncated_importance_weights")
    assert_raises(ValueError, impl.truncated_importance_weights, trainer, sampler, mask, 0.0,
                  what="truncated_importance_weights(cap=0)", why="a cap must be > 0")
    bad = sampler.clone()
    bad[1, 2] = math.nan
    assert_raises(ValueError, impl.truncated_importance_weights, trainer, bad, mask,
                  what="truncated_importance_weights of sampler log-probs holding a NaN", why="a NaN log-prob")


# --- tis_grpo_loss -------------------------------------------------------------------------------------------------

def _tisl_inputs(seed=0):
    """Log-probs, old log-probs whose ratios fall inside and outside [0.8, 1.28] for advantages of both signs,
    advantages (one 0), a ragged mask with an empty row, and importance weights in [0.1, 2] (not 1 on padding)."""
    g = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(6, 7, generator=g) * 3 - 0.05
    log_ratio = torch.randn(6, 7, generator=g) * 0.3
    log_ratio[0, :4] = torch.tensor([-0.5, 0.4, math.log(1.25), math.log(0.85)])
    log_ratio[1, :4] = torch.tensor([-0.5, 0.4, math.log(1.25), math.log(0.85)])
    advantages = torch.tensor([1.0, -0.8, 0.5, 0.0, -1.3, 0.9])
    mask = torch.arange(7)[None] < torch.tensor([7, 5, 3, 0, 6, 2])[:, None]
    weights = (torch.rand(6, 7, generator=g) * 1.9 + 0.1)
    return logprobs, logprobs - log_ratio, advantages, mask, weights


LOSS_CONFIGS = [(0.2, None, False, True), (0.2, 0.28, False, True), (0.1, None, True, True),
                (0.2, 0.28, True, True), (0.2, None, False, False), (0.2, 0.28, True, False)]
LOSS_HINT = ("Per token: -min(ratio·A, clip(ratio, 1 - epsilon, 1 + epsilon_high)·A) · weight, ratio = "
             "exp(logprobs - old_logprobs) (old None: logprobs.detach()); the sum over the real tokens divided by "
             "their number, as grpo_loss's 'dapo'. The weight multiplies the clipped term; it is not part of the "
             "ratio.")


def _tisl_what(epsilon, epsilon_high, on_policy, weighted):
    return (f"tis_grpo_loss(epsilon={epsilon}, epsilon_high={epsilon_high}, "
            f"{'old_logprobs=None' if on_policy else 'off-policy'}, {'weights' if weighted else 'weights=None'})")


@exercise("tis_grpo_loss")
def test_tis_grpo_tisl_matches_reference(impl):
    logprobs, old, advantages, mask, weights = _tisl_inputs()
    for epsilon, epsilon_high, on_policy, weighted in LOSS_CONFIGS:
        args = (logprobs, None if on_policy else old, advantages, mask, weights if weighted else None, epsilon,
                epsilon_high)
        fresh = tuple(a.clone() if isinstance(a, Tensor) else a for a in args)
        assert_close(impl.tis_grpo_loss(*fresh), ref.tis_grpo_loss(*args),
                     _tisl_what(epsilon, epsilon_high, on_policy, weighted),
                     factors={"23 (the number of real tokens)": 23.0}, hint=LOSS_HINT)


@exercise("tis_grpo_loss")
def test_tis_grpo_tisl_without_weights_is_grpo_loss(impl):
    """weights=None, or every weight 1, is Part 3's grpo_loss with beta 0 and loss_type 'dapo'."""
    logprobs, old, advantages, mask, _ = _tisl_inputs(seed=1)
    for old_lp in (old, None):
        want = grpo_loss(logprobs, old_lp, None, advantages, mask, epsilon=0.2, epsilon_high=0.28)
        for weights in (None, torch.ones(6, 7)):
            assert_close(impl.tis_grpo_loss(logprobs.clone(), None if old_lp is None else old_lp.clone(),
                                            advantages.clone(), mask.clone(), weights, 0.2, 0.28), want,
                         f"tis_grpo_loss({'weights=None' if weights is None else 'every weight 1'}, "
                         f"{'on' if old_lp is None else 'off'}-policy) against Part 3's grpo_loss",
                         hint="Without weights (or with weights of 1) it is grpo_loss(beta=0, loss_type='dapo').")


@exercise("tis_grpo_loss")
def test_tis_grpo_tisl_gradients(impl):
    """The gradient with respect to each token's log-prob is its weight times the unweighted one (-ratio·A/n inside
    the clip range, 0 where the clip binds); none flows into the weights, which are constants."""
    logprobs, old, advantages, mask, weights = _tisl_inputs(seed=2)
    for epsilon, epsilon_high, on_policy, weighted in LOSS_CONFIGS:
        assert_gradients_match(impl.tis_grpo_loss, ref.tis_grpo_loss,
                               (logprobs, None if on_policy else old, advantages, mask,
                                weights if weighted else None, epsilon, epsilon_high),
                               what=_tisl_what(epsilon, epsilon_high, on_policy, weighted),
                               wrt=["logprobs", "weights"] if weighted else ["logprobs"])


@exercise("tis_grpo_loss")
def test_tis_grpo_tisl_leaves_inputs_alone_and_refuses_bad_values(impl):
    logprobs, old, advantages, mask, weights = _tisl_inputs(seed=3)
    for old_lp in (old, None):
        assert_inputs_unchanged(impl.tis_grpo_loss, logprobs, old_lp, advantages, mask, weights, 0.2, 0.28,
                                what=f"tis_grpo_loss({'on' if old_lp is None else 'off'}-policy)")
    assert_raises(ValueError, impl.tis_grpo_loss, logprobs, old, advantages, mask, weights, -0.2,
                  what="tis_grpo_loss(epsilon=-0.2)", why="the clip range needs epsilon >= 0")
    bad = weights.clone()
    bad[0, 1] = math.nan
    assert_raises(ValueError, impl.tis_grpo_loss, logprobs, old, advantages, mask, bad,
                  what="tis_grpo_loss of weights holding a NaN", why="a NaN weight makes the loss NaN")


# --- provided: TRL 1.16's sequence mask, and the sweep's summary -------------------------------------------------

def test_sequence_mask_weights_keep_a_completion_by_its_sequence_ratio_or_mask_it_whole():
    """Hand-made log-ratios (trainer - sampler) per token, four completions of up to 4 tokens, cap 3:
    row 0: 0.5 on each of 4 tokens: sum 2.0, ratio e^2 = 7.39 > 3: masked (a mean of the log-ratios, 0.5, would have
    kept it at e^0.5 = 1.65); row 1: 0.3, 0.2, 0.0 and padding: ratio e^0.5 = 1.65, on each real token (not 1);
    row 2: -1 on 3 tokens: ratio e^-3 = 0.05, kept (no lower bound by default); row 3: 0.4 on 2 tokens and huge
    log-ratios on its padding, which must not count: ratio e^0.8 = 2.23, kept."""
    log_ratio = torch.tensor([[0.5, 0.5, 0.5, 0.5], [0.3, 0.2, 0.0, 9.0], [-1.0, -1.0, -1.0, 0.0],
                              [0.4, 0.4, 50.0, 50.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    sampler = -torch.rand(4, 4, generator=torch.Generator().manual_seed(0)) - 0.5
    trainer = (sampler + log_ratio).requires_grad_()
    weights = ref.sequence_mask_weights(trainer, sampler, mask, 3.0)
    kept = torch.tensor([0.0, math.exp(0.5), math.exp(-3.0), math.exp(0.8)])
    assert_close(weights, torch.where(mask, kept[:, None], 0.0), "sequence_mask_weights(cap=3)",
                 hint="The sequence ratio is exp(sum of the real tokens' log-ratios); above the cap the whole "
                      "completion gets 0, else every real token gets the ratio itself; padding gets 0.")
    assert not weights.requires_grad, "the weights are constants: no gradient may flow through them"
    assert torch.equal(ref.sequence_mask_weights(trainer, sampler, mask, 10.0)[0], torch.full((4,), math.exp(2.0))), \
        "with cap 10 the first completion (ratio e^2) is kept, weighted by its ratio"
    equal = ref.sequence_mask_weights(sampler, sampler, mask, 3.0)
    assert torch.equal(equal, mask.float()), "a sampler equal to the trainer weighs every real token 1"
    assert_raises(ValueError, ref.sequence_mask_weights, trainer, sampler, mask, 0.0,
                  what="sequence_mask_weights(cap=0)", why="the cap must be positive")


def test_accuracy_auc_is_the_mean_accuracy_over_the_steps():
    """Trapezoids between evaluations, divided by the steps they span: a constant curve gives the constant, a ramp
    its midpoint, and uneven spacing weights each stretch by its length."""
    from solutions.part6_lab.off_policy import accuracy_auc

    assert accuracy_auc([0, 4, 8], [0.5, 0.5, 0.5]) == pytest.approx(0.5)
    assert accuracy_auc([0, 10], [0.2, 0.6]) == pytest.approx(0.4)
    assert accuracy_auc([0, 2, 10], [0.0, 1.0, 1.0]) == pytest.approx((2 * 0.5 + 8 * 1.0) / 10)
    assert accuracy_auc([0], [0.3]) == pytest.approx(0.3)


def _fake_result(off_policy, seeds=(0, 1)):
    """A result as run() returns it, with made-up logs: the sweep's AUC is 0.5 - 0.01 * lag + 0.001 * seed."""
    sweep = off_policy.Sweep(steps=4, eval_every=2)
    log = lambda auc: {"auc": auc, "accuracy": [0.4, auc], "gap": [0.1], "sequences_over_3": [0.0]}  # noqa: E731
    gap = {name: {"max": 1.0, "mean": 0.1} for name in off_policy.SAMPLERS}
    return {"seeds": list(seeds), "smoke": True, "sweep_settings": sweep,
            "clip": {1: [{"clip": [[0.0]], "reward": [0.5]} for _ in seeds]}, "gap": [gap for _ in seeds],
            "sweep": {c: {lag: [log(0.5 - 0.01 * lag + 0.001 * s) for s in seeds] for lag in sweep.lags}
                      for c in sweep.corrections}}


def test_the_sweep_summary_has_one_entry_per_lag_and_correction():
    from solutions.part6_lab import off_policy

    figures = off_policy.summarize(_fake_result(off_policy))
    cells = [(e["lag"], e["correction"]) for e in figures["sweep"]]
    want = [(lag, c) for lag in off_policy.SWEEP.lags for c in off_policy.CORRECTIONS]
    assert sorted(cells) == sorted(want) and len(cells) == len(set(cells)) == 30, cells
    assert set(off_policy.SWEEP.lags) == {0, 1, 2, 4, 8}
    assert set(off_policy.CORRECTIONS) == {"none", "tis_token_cap1", "tis_token_cap2", "tis_token_cap5",
                                           "sequence_mask_cap3", "sampler_as_old"}
    for entry in figures["sweep"]:
        per_seed = [0.5 - 0.01 * entry["lag"] + 0.001 * s for s in (0, 1)]
        assert entry["auc_per_seed"] == pytest.approx(per_seed), entry
        assert entry["auc"] == pytest.approx(sum(per_seed) / 2) and entry["std"] > 0, entry
        assert entry["auc_minus_none"] == pytest.approx([0.0, 0.0]), "the same AUC as the uncorrected run"
    assert figures["lag0_auc_spread"] == pytest.approx(0.0)


def test_a_sweep_refuses_an_unknown_correction():
    from solutions.part6_lab import off_policy

    with pytest.raises(ValueError, match="unknown corrections"):
        off_policy.Sweep(corrections=("none", "tis_cap2"))


# --- the experiment, in its smoke setting --------------------------------------------------------------------------

@pytest.mark.slow
def test_off_policy_experiment_runs_and_summarizes():
    from solutions.part6_lab import off_policy

    result = off_policy.run(seeds=[0], smoke=True)
    figures = off_policy.summarize(result)
    assert set(figures) >= {"clip_fraction", "gap", "sweep", "lag0_auc_spread"}, figures
    assert figures["clip_fraction"]["1"]["mean"] == 0.0, "num_iterations 1: the ratio is 1, nothing is clipped"
    assert figures["gap"]["lean float32"]["max"] < 1e-3 < figures["gap"][off_policy.SAMPLERS[-1]]["mean"], figures
    cells = {(e["lag"], e["correction"]) for e in figures["sweep"]}
    assert cells == {(lag, c) for lag in off_policy.SMOKE_SWEEP.lags for c in off_policy.CORRECTIONS}, cells
    for entry in figures["sweep"]:
        assert set(entry) >= {"lag", "correction", "auc", "std", "auc_per_seed"}, entry
        assert 0.0 <= entry["auc"] <= 1.0, entry
        if entry["lag"] == 0:  # the sampler is the trainer up to float rounding
            assert entry["gap_mean"] < 1e-4, entry
    # at lag 0 every correction is (nearly) the identity: the six runs agree to a held-out answer or two
    assert figures["lag0_auc_spread"] <= 0.05, figures["lag0_auc_spread"]
    off_policy.plot(result)


def test_the_default_sweep_trains_lag_0_once_and_reports_it_under_every_correction(monkeypatch):
    """share_lag0: at lag 0 every correction trains the same run (the smoke sweep, which trains each, checks they
    agree), so the default trains it once per seed and reports that run under each correction; the lag-0 check then
    has nothing to compare (None), never a made-up 0."""
    from solutions.part6_lab import off_policy

    trained = []

    def fake_run_sweep(seed, lag, correction, *args, **kwargs):
        trained.append((lag, correction, seed))
        return {"auc": 0.5 + 0.01 * lag + 0.001 * seed, "accuracy": [0.4, 0.5], "gap": [0.1],
                "sequences_over_3": [0.0]}, None, None

    monkeypatch.setattr(off_policy, "run_sweep", fake_run_sweep)
    monkeypatch.setattr(off_policy, "measure_gaps", lambda *args: {name: {"max": 1.0, "mean": 0.1}
                                                                   for name in off_policy.SAMPLERS})
    monkeypatch.setattr(off_policy, "run_clip", lambda *args, **kwargs: {"clip": [[0.0]], "reward": [0.5]})
    sweep = off_policy.Sweep(lags=(0, 2), steps=2, share_lag0=True)
    result = off_policy.run([0, 1], smoke=True, sweep=sweep)
    first = sweep.corrections[0]
    assert [(lag, c) for lag, c, _ in trained if lag == 0] == [(0, first), (0, first)], trained
    assert len([t for t in trained if t[0] == 2]) == 2 * len(sweep.corrections), trained
    for correction in sweep.corrections:
        assert result["sweep"][correction][0] == result["sweep"][first][0], correction
    figures = off_policy.summarize(result)
    assert figures["lag0_auc_spread"] is None
    assert len(figures["sweep"]) == 2 * len(sweep.corrections)
    assert off_policy.SWEEP.share_lag0 and not off_policy.SMOKE_SWEEP.share_lag0
