"""Tests of Part 5's exercises (DPO and RLOO). Each runs against `impl` (see utils/harness.py) and compares with the
reference.

MUTANTS, at the end, are the mistakes these tests are proven to catch (tests/test_harness.py runs them).
The TRL comparison at the end runs only where `trl` is installed (pip install -r requirements-bench.txt).
"""

import itertools
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from solutions import part5_dpo_rloo as ref
from solutions.part0_warmup import completion_logprobs
from solutions.part2_lora import LoRAModel, make_adapters
from solutions.part3_grpo import compose_rewards
from tests.helpers import active_hooks, assert_matches, run_script
from tests.test_part3_grpo import columns_as_rewards, trl_source_lines

exercise = pytest.mark.exercise


def lora_model_with_random_B(model, seed=0):
    torch.manual_seed(seed)
    adapters = make_adapters(model, 4, 8.0, ("q", "k", "v", "o"))
    with torch.no_grad():
        for a in adapters.values():
            a.B.normal_(0, 0.3)
    return LoRAModel(model, adapters)


def token_inputs(seed=0, batch=6, gen=5):
    """Per-token log-probs and a completion mask with rows of different lengths, one of them empty."""
    g = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(batch, gen, generator=g) * 3
    lengths = torch.tensor([gen, 1, 3, 0, 2, 4][:batch])
    mask = torch.arange(gen)[None] < lengths[:, None]
    return logprobs, mask


def loss_and_grads(fn, *tensors, **kwargs):
    """fn's value and its gradient with respect to each tensor argument."""
    leaves = [t.clone().requires_grad_(True) for t in tensors]
    loss = fn(*leaves, **kwargs)
    loss.backward()
    return loss.detach(), [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves]


# --- sequence_logps ----------------------------------------------------------------------------------------------

@exercise("sequence_logps")
def test_sequence_logps_sum_and_mean(impl):
    logprobs, mask = token_inputs()
    lengths = mask.sum(1).float()
    masked_sum = (logprobs * mask).sum(1)
    for average in (False, True):
        expected = ref.sequence_logps(logprobs, mask, average)
        assert_matches(impl.sequence_logps(logprobs, mask, average), expected, f"sequence_logps(average={average})",
                       mistakes={
                           "padding (mask False) was summed in": logprobs.sum(1),
                           "the mean divided by every position, padding included, not by the masked tokens":
                               masked_sum / mask.shape[1],
                           "average=True was ignored: it asks for the mean over the masked tokens": masked_sum,
                           "average=False still averaged: the default is the sum (TRL's sequence log-prob)":
                               masked_sum / lengths.clamp(min=1),
                       })
    out = impl.sequence_logps(logprobs, mask, True)
    assert out[3] == 0 and torch.isfinite(out).all(), "an empty row must average to 0, not NaN: clamp the count to 1"


# --- dpo_loss ----------------------------------------------------------------------------------------------------

def dpo_inputs(seed=0, batch=8):
    g = torch.Generator().manual_seed(seed)
    ref_chosen, ref_rejected = -torch.rand(batch, generator=g) * 6, -torch.rand(batch, generator=g) * 6
    chosen = ref_chosen + torch.randn(batch, generator=g) * 3
    rejected = ref_rejected + torch.randn(batch, generator=g) * 3
    return chosen, rejected, ref_chosen, ref_rejected


def _dpo_core(pc, pr, rc, rr, beta=0.1, loss_type="sigmoid", *, margin_fn=None, beta_outside=False, reduce="mean",
              ipo_target=None):
    margin = margin_fn(pc, pr, rc, rr) if margin_fn else (pc - rc) - (pr - rr)
    if loss_type == "sigmoid":
        losses = -beta * F.logsigmoid(margin) if beta_outside else -F.logsigmoid(beta * margin)
    elif loss_type == "hinge":
        losses = beta * torch.relu(1 - margin) if beta_outside else torch.relu(1 - beta * margin)
    else:
        losses = (margin - (ipo_target(beta) if ipo_target else 1 / (2 * beta))) ** 2
    return losses.sum() if reduce == "sum" else losses.mean()


def _dpo_no_reference(pc, pr, rc, rr, beta=0.1, loss_type="sigmoid"):
    """Leaves the reference out of the margin."""
    return _dpo_core(pc, pr, rc, rr, beta, loss_type, margin_fn=lambda pc, pr, rc, rr: pc - pr)


def _dpo_swapped(pc, pr, rc, rr, beta=0.1, loss_type="sigmoid"):
    """Prefers the rejected answer (margin of the wrong sign)."""
    return _dpo_core(pc, pr, rc, rr, beta, loss_type, margin_fn=lambda pc, pr, rc, rr: (pr - rr) - (pc - rc))


def _dpo_reference_sign(pc, pr, rc, rr, beta=0.1, loss_type="sigmoid"):
    """Adds the reference log-probs instead of subtracting them."""
    return _dpo_core(pc, pr, rc, rr, beta, loss_type, margin_fn=lambda pc, pr, rc, rr: (pc + rc) - (pr + rr))


def _dpo_beta_outside(pc, pr, rc, rr, beta=0.1, loss_type="sigmoid"):
    """Multiplies the loss by beta instead of the margin."""
    return _dpo_core(pc, pr, rc, rr, beta, loss_type, beta_outside=True)


def _dpo_summed(pc, pr, rc, rr, beta=0.1, loss_type="sigmoid"):
    """Sums the per-pair losses instead of averaging them."""
    return _dpo_core(pc, pr, rc, rr, beta, loss_type, reduce="sum")


def _dpo_ipo_target(pc, pr, rc, rr, beta=0.1, loss_type="sigmoid"):
    """Uses 1 / beta as IPO's target margin."""
    return _dpo_core(pc, pr, rc, rr, beta, loss_type, ipo_target=lambda b: 1 / b)


def _dpo_always_sigmoid(pc, pr, rc, rr, beta=0.1, loss_type="sigmoid"):
    """Ignores loss_type: always the sigmoid loss."""
    return _dpo_core(pc, pr, rc, rr, beta, "sigmoid")


DPO_MISTAKES = {
    "the reference log-probs were left out of the margin": _dpo_no_reference,
    "chosen and rejected are swapped: the margin is (chosen log-ratio) - (rejected log-ratio)": _dpo_swapped,
    "the reference log-probs were added; the log-ratio is policy - reference": _dpo_reference_sign,
    "beta multiplies the loss; it belongs inside, on the margin": _dpo_beta_outside,
    "the per-pair losses were summed; average them": _dpo_summed,
    "IPO's target margin is 1 / (2 beta), not 1 / beta": _dpo_ipo_target,
    "loss_type was ignored (always the sigmoid loss)": _dpo_always_sigmoid,
}


@exercise("dpo_loss")
def test_dpo_loss_and_gradients_match_reference(impl):
    inputs = dpo_inputs()
    for loss_type, beta in itertools.product(ref.DPO_LOSS_TYPES, [0.1, 0.5]):
        what = f"dpo_loss(beta={beta}, loss_type={loss_type!r})"
        expected, expected_grads = loss_and_grads(ref.dpo_loss, *inputs, beta=beta, loss_type=loss_type)
        mistakes = {d: m(*inputs, beta=beta, loss_type=loss_type) for d, m in DPO_MISTAKES.items()}
        loss, grads = loss_and_grads(impl.dpo_loss, *inputs, beta=beta, loss_type=loss_type)
        assert_matches(loss, expected, what, mistakes=mistakes)
        for name, grad, expected_grad in zip(["policy_chosen_logps", "policy_rejected_logps"], grads,
                                             expected_grads):
            assert_matches(grad, expected_grad, f"the gradient of {what} with respect to {name}")


@exercise("dpo_loss")
def test_dpo_loss_values_at_zero_margin_and_bad_loss_type(impl):
    zeros = torch.zeros(4)
    cases = {"sigmoid": torch.log(torch.tensor(2.0)), "hinge": torch.tensor(1.0), "ipo": torch.tensor(25.0)}
    for loss_type, expected in cases.items():
        out = impl.dpo_loss(zeros, zeros, zeros, zeros, beta=0.1, loss_type=loss_type)
        assert_matches(out, expected, f"dpo_loss(loss_type={loss_type!r}) when policy == reference (margin 0)")
    with pytest.raises(ValueError):
        impl.dpo_loss(zeros, zeros, zeros, zeros, loss_type="kto")


def test_dpo_loss_rejects_mismatched_shapes():
    with pytest.raises((ValueError, TypeError)):  # TypeError: jaxtyping's shape check, when it is on
        ref.dpo_loss(torch.zeros(4), torch.zeros(4), torch.zeros(4), torch.zeros(5))


# --- precompute_reference_logps ----------------------------------------------------------------------------------

TRIPLES = [("23+45=", "68", "69"), ("95+48=", "143", "133"), ("52+52=", "104", "95"), ("14+20=", "34", "44"),
           ("71+29=", "100", "90")]


@exercise("precompute_reference_logps")
def test_precompute_reference_logps(impl, tiny_model):
    lora_model = lora_model_with_random_B(tiny_model, seed=1)
    batch = ref.preference_batch(tiny_model.tokenizer, TRIPLES, tiny_model.cfg.device)
    with torch.no_grad():
        base, adapted = completion_logprobs(tiny_model, batch), completion_logprobs(lora_model, batch)
    for average in (False, True):
        expected = ref.sequence_logps(base, batch.completion_mask, average).chunk(2)
        wrong_hooks = ref.sequence_logps(adapted, batch.completion_mask, average).chunk(2)
        wrong_average = ref.sequence_logps(base, batch.completion_mask, not average).chunk(2)
        out = impl.precompute_reference_logps(lora_model, TRIPLES, average, batch_size=2)
        assert isinstance(out, tuple) and len(out) == 2, "return a tuple (chosen, rejected)"
        for what, got, exp, hooks, avg in zip(["chosen", "rejected"], out, expected, wrong_hooks, wrong_average):
            assert_matches(got, exp, f"reference log-probs of the {what} answers (average={average}, batch_size=2)",
                           mistakes={"the reference was computed with the LoRA hooks on: use lora_model.base": hooks,
                                     "`average` was ignored": avg,
                                     "chosen and rejected are swapped": wrong_hooks[0] * 0 + (
                                         expected[1] if what == "chosen" else expected[0])})
            assert not got.requires_grad, "reference log-probs are constants: compute them under torch.no_grad()"
    assert active_hooks(tiny_model) == [], "hooks left on the model"


# --- rloo_advantages ---------------------------------------------------------------------------------------------

REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0, 0.0, 0.5, 3.0, 1.5])  # 3 groups of 4


@exercise("rloo_advantages")
def test_rloo_advantages_matches_reference(impl):
    groups = REWARDS.view(-1, 4)
    centred = (groups - groups.mean(1, keepdim=True)).view(-1)
    others_over_g = (REWARDS - (groups.sum(1, keepdim=True) - groups).view(-1) / 4)
    for normalize in (False, True):
        expected = ref.rloo_advantages(REWARDS, 4, normalize)
        loo = ref.rloo_advantages(REWARDS, 4, False)
        assert_matches(impl.rloo_advantages(REWARDS, 4, normalize), expected, f"rloo_advantages(normalize={normalize})",
                       mistakes={
                           "the baseline is the group's mean with r_i itself in it (that is GRPO's centring); RLOO "
                           "leaves r_i out: the mean of the other G - 1": centred,
                           "the others' sum was divided by G; there are G - 1 others": others_over_g,
                           "normalize used the population std; TRL uses Bessel's correction":
                               (loo - loo.mean()) / (loo.std(unbiased=False) + 1e-4),
                           "normalize was ignored": loo,
                       })


@exercise("rloo_advantages")
def test_rloo_advantages_pairs_and_equal_groups(impl):
    out = impl.rloo_advantages(torch.tensor([3.0, 1.0, 0.5, 0.5]), 2)
    assert_matches(out, torch.tensor([2.0, -2.0, 0.0, 0.0]), "rloo_advantages with groups of 2 (r_i - r_j)")
    assert torch.equal(impl.rloo_advantages(torch.full((8,), 0.7), 4), torch.zeros(8)), (
        "a group whose rewards are all equal gets advantages of exactly 0")


NAN = float("nan")
UNSCORED = torch.tensor([1.0, 0.0, NAN, 1.0,  NAN, NAN, NAN, NAN,  2.0, NAN, 0.0, 0.5,  5.0, NAN, NAN, NAN])


def rloo_by_hand(rewards, group_size, normalize=False):
    """rloo_advantages, one number at a time: NaN rewards are left out, and get 0 (as does a lone scored one)."""
    import statistics

    values, out = rewards.tolist(), []
    for start in range(0, len(values), group_size):
        group = values[start:start + group_size]
        scored = [r for r in group if r == r]
        for r in group:
            others = len(scored) - 1
            out.append(NAN if r != r or others == 0 else r - (sum(scored) - r) / others)
    if normalize:
        valid = [a for a in out if a == a]
        mean, std = statistics.fmean(valid), statistics.stdev(valid)
        out = [(a - mean) / (std + 1e-4) for a in out]
    return torch.tensor(out).nan_to_num(0.0)


@exercise("rloo_advantages")
def test_rloo_advantages_leave_unscorable_completions_out(impl):
    for normalize in (False, True):
        assert_matches(impl.rloo_advantages(UNSCORED, 4, normalize), rloo_by_hand(UNSCORED, 4, normalize),
                       f"rloo_advantages(normalize={normalize}) with NaN rewards (unscorable completions)", mistakes={
                           "an unscorable completion (NaN reward) was counted as a reward of 0: leave it out of the "
                           "others' mean (divide by the scored siblings) and give it advantage 0, as TRL does":
                               ref.rloo_advantages(UNSCORED.nan_to_num(0.0), 4, normalize)})


def test_rloo_advantages_bad_input():
    for rewards, group_size in ((torch.ones(7), 4), (torch.ones(4), 1), (torch.tensor([1.0, float("inf")]), 2)):
        with pytest.raises(ValueError):
            ref.rloo_advantages(rewards, group_size)
    assert torch.equal(ref.rloo_advantages(torch.full((4,), NAN), 2), torch.zeros(4)), "nothing scored: no signal"


# --- kl_penalized_rewards ----------------------------------------------------------------------------------------

def kl_inputs(seed=0):
    logprobs, mask = token_inputs(seed)
    g = torch.Generator().manual_seed(seed + 1)
    ref_lp = logprobs + torch.randn(logprobs.shape, generator=g) * 0.5
    rewards = torch.rand(len(logprobs), generator=g)
    return rewards, logprobs, ref_lp, mask


@exercise("kl_penalized_rewards")
def test_kl_penalized_rewards(impl):
    rewards, logprobs, ref_lp, mask = kl_inputs()
    m = mask.float()
    d = logprobs - ref_lp
    for beta in (0.05, 0.5):
        expected = ref.kl_penalized_rewards(rewards, logprobs, ref_lp, mask, beta)
        assert_matches(impl.kl_penalized_rewards(rewards, logprobs, ref_lp, mask, beta), expected,
                       f"kl_penalized_rewards(beta={beta})", mistakes={
                           "the KL has the wrong sign: k1 = logprobs - ref_logprobs, subtracted from the reward":
                               rewards + beta * (d * m).sum(1),
                           "used k3 (GRPO's estimator); RLOO's penalty is k1 = logprobs - ref_logprobs":
                               rewards - beta * ((torch.exp(-d) + d - 1) * m).sum(1),
                           "the KL was averaged over tokens; TRL sums it over each sequence":
                               rewards - beta * (d * m).sum(1) / m.sum(1).clamp(min=1),
                           "padding was counted in the KL": rewards - beta * d.sum(1),
                       })
    lp = logprobs.clone().requires_grad_(True)
    out = impl.kl_penalized_rewards(rewards, lp, ref_lp, mask, 0.1)
    assert not out.requires_grad, "the penalised reward is a reward, a constant for the loss: detach it"


# --- rloo_loss ---------------------------------------------------------------------------------------------------

def rloo_inputs(seed=0, batch=8):
    g = torch.Generator().manual_seed(seed)
    seq = -torch.rand(batch, generator=g) * 5
    log_ratio = torch.randn(batch, generator=g) * 0.3
    log_ratio[:4] = torch.tensor([-0.5, -0.5, 0.4, 0.4])  # ratios 0.61 and 1.49, outside [0.8, 1.2] ...
    advantages = torch.randn(batch, generator=g)
    advantages[:4] = torch.tensor([-1.0, 1.0, -1.0, 1.0])  # ... with advantages of either sign
    return seq, seq - log_ratio, advantages


def _rloo_core(seq, old, adv, epsilon=0.2, epsilon_high=None, *, ratio_fn=None, one_sided=False, op=torch.minimum,
               reduce="mean"):
    eh = epsilon if epsilon_high is None else epsilon_high
    old = seq.detach() if old is None else old
    ratio = ratio_fn(seq, old) if ratio_fn else torch.exp(seq - old)
    clipped = ratio.clamp(max=1 + eh) if one_sided else ratio.clamp(1 - epsilon, 1 + eh)
    per_sequence = -op(ratio * adv, clipped * adv)
    return per_sequence.sum() if reduce == "sum" else per_sequence.mean()


def _rloo_ratio_sign(seq, old, adv, epsilon=0.2, epsilon_high=None):
    """ratio = exp(old - new)."""
    return _rloo_core(seq, old, adv, epsilon, epsilon_high, ratio_fn=lambda s, o: torch.exp(o - s))


def _rloo_one_sided(seq, old, adv, epsilon=0.2, epsilon_high=None):
    """Clips the ratio from above only."""
    return _rloo_core(seq, old, adv, epsilon, epsilon_high, one_sided=True)


def _rloo_max(seq, old, adv, epsilon=0.2, epsilon_high=None):
    """Takes the max of the two surrogates (the optimistic bound)."""
    return _rloo_core(seq, old, adv, epsilon, epsilon_high, op=torch.maximum)


def _rloo_summed(seq, old, adv, epsilon=0.2, epsilon_high=None):
    """Sums over sequences instead of averaging."""
    return _rloo_core(seq, old, adv, epsilon, epsilon_high, reduce="sum")


def _rloo_constant_ratio(seq, old, adv, epsilon=0.2, epsilon_high=None):
    """On-policy, uses a constant ratio of 1 (so the loss has no gradient)."""
    return _rloo_core(seq, seq.detach() if old is None else old, adv, epsilon, epsilon_high,
                      ratio_fn=lambda s, o: torch.exp(s.detach() - o) if old is None else torch.exp(s - o))


def _rloo_ignores_epsilon_high(seq, old, adv, epsilon=0.2, epsilon_high=None):
    """Clips symmetrically whatever epsilon_high says."""
    return _rloo_core(seq, old, adv, epsilon, None)


RLOO_MISTAKES = {
    "the ratio is upside down: ratio = exp(seq_logprobs - old_seq_logprobs)": _rloo_ratio_sign,
    "the ratio is clipped on one side only: clip to [1 - epsilon, 1 + epsilon_high]": _rloo_one_sided,
    "took the max of the two surrogates in the loss; PPO's objective takes the min (the loss is minus it)": _rloo_max,
    "the per-sequence losses were summed; average them": _rloo_summed,
    "epsilon_high was ignored": _rloo_ignores_epsilon_high,
}


@exercise("rloo_loss")
def test_rloo_loss_and_gradient_match_reference(impl):
    seq, old, adv = rloo_inputs()
    for epsilon_high, on_policy in itertools.product([None, 0.28], [False, True]):
        old_lp = None if on_policy else old
        what = f"rloo_loss(epsilon_high={epsilon_high}, {'on' if on_policy else 'off'}-policy)"
        expected, (expected_grad,) = loss_and_grads(lambda s: ref.rloo_loss(s, old_lp, adv, 0.2, epsilon_high), seq)
        mistakes = {d: m(seq, old_lp, adv, 0.2, epsilon_high) for d, m in RLOO_MISTAKES.items()}
        loss, (grad,) = loss_and_grads(lambda s: impl.rloo_loss(s, old_lp, adv, 0.2, epsilon_high), seq)
        assert_matches(loss, expected, what, mistakes=mistakes)
        assert_matches(grad, expected_grad, f"the gradient of {what}", mistakes={
            "on-policy, the ratio must still carry the gradient: use old = seq_logprobs.detach(), not a constant 1":
                torch.zeros_like(expected_grad)})


# --- the trainers and the script (provided) ----------------------------------------------------------------------

def test_preference_batch_rows():
    from utils.models import load_model

    tokenizer = load_model("tiny", device="cpu").tokenizer
    batch = ref.preference_batch(tokenizer, TRIPLES)
    assert batch.ids.shape[0] == 2 * len(TRIPLES) and batch.texts[:2] == ["68", "143"] and batch.texts[5] == "69"
    assert batch.completion_mask.sum(1).tolist() == [3, 4, 4, 3, 4, 3, 4, 3, 3, 3], "digits + EOS"
    triples = ref.preference_pairs([(23, 45), (95, 48)], seed=0)
    assert all(c == str(a + b) and abs(int(r) - int(c)) in (1, 10) for (_, c, r), (a, b) in
               zip(triples, [(23, 45), (95, 48)]))


@pytest.mark.slow
def test_dpo_trainer_reference_forms_agree_and_train_only_lora():
    from utils.models import load_model

    base = load_model("tiny", device="cpu")
    triples = ref.preference_pairs(ref.addition_pairs("train")[:64], seed=0)
    weights = {k: v.clone() for k, v in base.state_dict().items()}
    losses, rows = {}, {}
    for reference in ("implicit", "precomputed"):
        cfg = ref.DPOConfig(steps=2, batch_pairs=8, reference=reference)
        trainer = ref.DPOTrainer(cfg, model=base, triples=triples)
        trainer.evaluate = lambda: 0.0
        logger = trainer.train()
        losses[reference] = [h["loss"] for h in logger.history if "loss" in h]
        rows[reference] = trainer.reference_rows
    assert losses["implicit"] == pytest.approx(losses["precomputed"], abs=1e-5), losses
    assert rows == {"implicit": 2 * 2 * 8, "precomputed": 2 * 64}
    assert all(torch.equal(v, base.state_dict()[k]) for k, v in weights.items()), "base weights changed"
    assert (trainer.reference_kind, trainer.precomputed) == ("hooks_removed", True), "Part 4's decision, answered"
    for cfg in (ref.DPOConfig(reference="cached"), ref.DPOConfig(beta=0.0)):
        with pytest.raises(ValueError):
            ref.DPOTrainer(cfg, model=base, triples=triples)


@pytest.mark.slow
def test_rloo_trainer_runs_with_the_kl_in_the_reward():
    from utils.models import load_model

    cfg = ref.RLOOConfig(steps=2, n_prompts=4, group_size=4, beta=0.05, eval_every=0, table_every=100)
    trainer = ref.RLOOTrainer(cfg, model=load_model("tiny", device="cpu"))
    logger = trainer.train()
    assert trainer.ref.kind == "hooks_removed", "the reference is Part 4's Reference, decided by reference_kind"
    assert trainer.reference_forward_passes == trainer.ref.forward_passes == 2, "the reference is asked through Reference"
    logged = {k for h in logger.history for k in h}
    assert {"reward", "reward/exact_answer", "kl", "clip_ratio/region_mean", "clip_ratio/low_mean",
            "clip_ratio/high_mean", "loss"} <= logged


@pytest.mark.slow
def test_script_prints_json_figures(tmp_path):
    _, figures = run_script("solutions.part5_dpo_rloo", "--json", "--plot", str(tmp_path / "c.png"))
    assert {"accuracy_start", "accuracy_end", "seconds", "dpo_implicit", "dpo_precomputed", "rloo", "grpo"} <= set(
        figures)


# --- agreement with TRL's DPOTrainer and RLOOTrainer (only where trl is installed) -------------------------------

def trl_dpo_loss(per_token_logps, ref_per_token_logps, shift_mask, beta, loss_type):
    """TRL's own DPOTrainer._compute_loss, on a stand-in trainer whose model returns `per_token_logps` (rows
    [chosen; rejected]) and with the reference log-probs precomputed (sums over tokens, as TRL stores them)."""
    from trl import DPOTrainer

    rows, gen = shift_mask.shape
    completion_mask = torch.cat([torch.zeros(rows, 1, dtype=torch.long), shift_mask.long()], dim=1)  # + a prompt
    outputs = SimpleNamespace(log_probs=per_token_logps * shift_mask, entropy=torch.zeros(rows, gen),
                              mean_logits=torch.zeros(rows, gen), is_top1=torch.zeros(rows, gen, dtype=torch.bool))
    accelerator = SimpleNamespace(device="cpu", gather=lambda t: t, gather_for_metrics=lambda t: t)
    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=accelerator, aux_loss_enabled=False, ld_alpha=None,
        precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=[loss_type], loss_weights=[1.0],
        beta=beta, use_weighting=False, label_smoothing=0.0, _metrics={"train": defaultdict(list)},
        _total_train_tokens=0, _tp_size=1)
    ref_logps = (ref_per_token_logps * shift_mask).sum(1)
    inputs = {"input_ids": torch.zeros(rows, gen + 1, dtype=torch.long),
              "attention_mask": torch.ones(rows, gen + 1, dtype=torch.long), "completion_mask": completion_mask,
              "ref_chosen_logps": ref_logps[:rows // 2], "ref_rejected_logps": ref_logps[rows // 2:]}
    return DPOTrainer._compute_loss(trainer, lambda **kwargs: outputs, inputs, return_outputs=False)


def our_dpo_loss(per_token_logps, ref_per_token_logps, shift_mask, beta, loss_type):
    average = loss_type == "ipo"
    chosen, rejected = ref.sequence_logps(per_token_logps, shift_mask, average).chunk(2)
    ref_chosen, ref_rejected = ref.sequence_logps(ref_per_token_logps, shift_mask, average).chunk(2)
    return ref.dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta, loss_type)


def test_dpo_loss_agrees_with_trl():
    pytest.importorskip("trl", reason="pip install -r requirements-bench.txt to compare with TRL")
    g = torch.Generator().manual_seed(3)
    per_token = -torch.rand(8, 5, generator=g) * 3
    ref_per_token = per_token + torch.randn(8, 5, generator=g) * 0.5
    shift_mask = torch.arange(5)[None] < torch.tensor([5, 1, 3, 2, 4, 2, 5, 3])[:, None]
    for loss_type, beta in itertools.product(ref.DPO_LOSS_TYPES, [0.1, 0.5]):
        ours, (our_grad,) = loss_and_grads(lambda lp: our_dpo_loss(lp, ref_per_token, shift_mask, beta, loss_type),
                                           per_token)
        theirs, (their_grad,) = loss_and_grads(
            lambda lp: trl_dpo_loss(lp, ref_per_token, shift_mask, beta, loss_type), per_token)
        assert torch.allclose(ours, theirs, atol=1e-5), f"{loss_type}, beta={beta}: {ours} vs TRL {theirs}"
        assert torch.allclose(our_grad, their_grad, atol=1e-5), f"{loss_type}, beta={beta}: gradients"


def trl_rloo_loss(per_token_logps, mask, old_logps, advantages, epsilon=0.2, epsilon_high=None):
    """TRL's own RLOOTrainer._compute_loss, on a stand-in trainer whose model returns `per_token_logps`."""
    from trl import RLOOTrainer

    accelerator = SimpleNamespace(reduce=lambda t, reduction="sum": t, gather=lambda t: t)
    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=accelerator, aux_loss_enabled=False, epsilon_low=epsilon,
        epsilon_high=epsilon if epsilon_high is None else epsilon_high, _metrics={"train": defaultdict(list)},
        _get_per_token_logps_and_entropies=lambda *a, **k: (per_token_logps, torch.zeros_like(per_token_logps), None))
    inputs = {"prompt_ids": torch.zeros(len(mask), 1, dtype=torch.long),
              "prompt_mask": torch.ones(len(mask), 1, dtype=torch.long),
              "completion_ids": torch.zeros_like(mask, dtype=torch.long), "completion_mask": mask.long(),
              "old_logps": old_logps, "advantages": advantages}
    return RLOOTrainer._compute_loss(trainer, None, inputs)


def test_rloo_loss_agrees_with_trl():
    pytest.importorskip("trl", reason="pip install -r requirements-bench.txt to compare with TRL")
    per_token, mask = token_inputs(seed=4)
    g = torch.Generator().manual_seed(4)
    old = ref.sequence_logps(per_token, mask) + torch.randn(len(mask), generator=g) * 0.3
    adv = torch.randn(len(mask), generator=g)
    for epsilon_high in (None, 0.28):
        ours, (our_grad,) = loss_and_grads(
            lambda lp: ref.rloo_loss(ref.sequence_logps(lp, mask), old, adv, 0.2, epsilon_high), per_token)
        theirs, (their_grad,) = loss_and_grads(lambda lp: trl_rloo_loss(lp, mask, old, adv, 0.2, epsilon_high),
                                               per_token)
        assert torch.allclose(ours, theirs, atol=1e-5), f"epsilon_high={epsilon_high}: {ours} vs TRL {theirs}"
        assert torch.allclose(our_grad, their_grad, atol=1e-5), f"epsilon_high={epsilon_high}: gradients"


def trl_rloo_advantages(rewards_per_func, weights, old_lp, ref_lp, mask, beta, group_size, normalize):
    """TRL's own lines of RLOOTrainer._generate_and_score_completions, from marking unscorable completions to
    zeroing their advantages: the KL penalty in the reward, the leave-one-out baseline, the normalisation."""
    from trl import RLOOTrainer
    from trl.trainer.utils import nanstd

    code = trl_source_lines(RLOOTrainer._generate_and_score_completions,
                            "unscorable_mask = torch.isnan(rewards_per_func)", "advantages = torch.nan_to_num(")
    trainer = SimpleNamespace(reward_weights=torch.tensor(weights), reward_clip_range=None, beta=beta,
                              normalize_advantages=normalize)
    scope = {"torch": torch, "nanstd": nanstd, "gather": lambda t: t, "self": trainer, "device": "cpu",
             "rewards_per_func": rewards_per_func, "old_per_token_logps": old_lp, "ref_per_token_logps": ref_lp,
             "completion_mask": mask.long(), "num_generations": group_size}
    exec(code, scope)
    return scope["advantages"]


def test_rloo_advantages_and_kl_penalty_agree_with_trl():
    """compose_rewards, kl_penalized_rewards and rloo_advantages against TRL's own code for the same step (trl
    1.16's lines, run by trl_rloo_advantages), with completions that one function or no function judged."""
    pytest.importorskip("trl", reason="pip install -r requirements-bench.txt to compare with TRL")
    _, old_lp, ref_lp, mask = kl_inputs(seed=5)
    old_lp, ref_lp, mask = torch.cat([old_lp] * 3), torch.cat([ref_lp] * 3), torch.cat([mask] * 3)  # 18 rows
    g = torch.Generator().manual_seed(5)
    per_func = torch.randint(0, 3, (18, 2), generator=g).float()
    per_func[[1, 7], 1] = NAN                        # judged by one function only
    per_func[[3, 10, 11, 15, 16, 17], :] = NAN       # unscorable: row 9 has no scored sibling, rows 15-17 none at all
    weights, G = [1.0, 0.1], 3
    for rewards_per_func in (per_func, per_func.nan_to_num(0.5)):  # ... and the same with every reward finite
        total, _ = compose_rewards(columns_as_rewards(rewards_per_func, weights), ["p"] * 18, ["c"] * 18)
        for beta, normalize in itertools.product([0.0, 0.05], [False, True]):
            penalised = ref.kl_penalized_rewards(total, old_lp, ref_lp, mask, beta)
            ours = ref.rloo_advantages(penalised, G, normalize)
            theirs = trl_rloo_advantages(rewards_per_func, weights, old_lp, ref_lp, mask, beta, G, normalize)
            assert torch.allclose(ours, theirs, atol=1e-5), f"beta={beta}, normalize={normalize}: {ours} vs {theirs}"


# --- mutants: the mistakes these tests catch ---------------------------------------------------------------------

def _seq_unmasked(logprobs, mask, average=False):
    """Sums every position, padding included."""
    return logprobs.mean(1) if average else logprobs.sum(1)


def _seq_mean_over_all_positions(logprobs, mask, average=False):
    """Averages by dividing by the number of positions, not of masked tokens."""
    total = (logprobs * mask).sum(1)
    return total / mask.shape[1] if average else total


def _seq_ignores_average(logprobs, mask, average=False):
    """Always returns the sum."""
    return (logprobs * mask).sum(1)


def _seq_mean_nan_on_empty(logprobs, mask, average=False):
    """Divides by the token count without clamping it (NaN for an empty row)."""
    total = (logprobs * mask).sum(1)
    return total / mask.sum(1) if average else total


@torch.no_grad()
def _reference_with_hooks(lora_model, triples, average=False, batch_size=256):
    """Runs the reference through the LoRA model (hooks on)."""
    batch = ref.preference_batch(lora_model.tokenizer, triples, lora_model.cfg.device)
    return ref.sequence_logps(completion_logprobs(lora_model, batch), batch.completion_mask, average).chunk(2)


def _reference_ignores_average(lora_model, triples, average=False, batch_size=256):
    """Always sums (ignores `average`)."""
    return ref.precompute_reference_logps(lora_model, triples, False, batch_size)


def _reference_first_chunk_only(lora_model, triples, average=False, batch_size=256):
    """Returns only the first batch_size pairs."""
    return ref.precompute_reference_logps(lora_model, triples[:batch_size], average, batch_size)


def _reference_swapped(lora_model, triples, average=False, batch_size=256):
    """Returns (rejected, chosen)."""
    chosen, rejected = ref.precompute_reference_logps(lora_model, triples, average, batch_size)
    return rejected, chosen


def _loo_includes_self(rewards, group_size, normalize=False):
    """Uses the whole group's mean (GRPO's centring) as the baseline."""
    groups = rewards.view(-1, group_size)
    adv = (groups - groups.mean(1, keepdim=True)).view(-1)
    return (adv - adv.mean()) / (adv.std() + 1e-4) if normalize else adv


def _loo_divides_by_g(rewards, group_size, normalize=False):
    """Divides the others' sum by G instead of G - 1."""
    groups = rewards.view(-1, group_size)
    adv = (groups - (groups.sum(1, keepdim=True) - groups) / group_size).view(-1)
    return (adv - adv.mean()) / (adv.std() + 1e-4) if normalize else adv


def _loo_population_std(rewards, group_size, normalize=False):
    """Normalises with the population std."""
    adv = ref.rloo_advantages(rewards, group_size)
    return (adv - adv.mean()) / (adv.std(unbiased=False) + 1e-4) if normalize else adv


def _loo_unscorable_as_zero(rewards, group_size, normalize=False):
    """Counts an unscorable completion (NaN) as a reward of 0."""
    return ref.rloo_advantages(rewards.nan_to_num(0.0), group_size, normalize)


def _loo_ignores_normalize(rewards, group_size, normalize=False):
    """Never normalises."""
    return ref.rloo_advantages(rewards, group_size)


def _kl_sign(rewards, logprobs, ref_logprobs, mask, beta):
    """Adds the KL to the reward."""
    return (rewards + beta * ((logprobs - ref_logprobs) * mask).sum(1)).detach()


def _kl_k3(rewards, logprobs, ref_logprobs, mask, beta):
    """Uses GRPO's k3 estimator."""
    d = ref_logprobs - logprobs
    return (rewards - beta * ((torch.exp(d) - d - 1) * mask).sum(1)).detach()


def _kl_token_mean(rewards, logprobs, ref_logprobs, mask, beta):
    """Averages the KL over tokens instead of summing it."""
    m = mask.float()
    return (rewards - beta * ((logprobs - ref_logprobs) * m).sum(1) / m.sum(1).clamp(min=1)).detach()


def _kl_unmasked(rewards, logprobs, ref_logprobs, mask, beta):
    """Counts padding in the KL."""
    return (rewards - beta * (logprobs - ref_logprobs).sum(1)).detach()


def _kl_not_detached(rewards, logprobs, ref_logprobs, mask, beta):
    """Leaves the penalised reward attached to the graph."""
    return rewards - beta * ((logprobs - ref_logprobs) * mask).sum(1)


MUTANTS = {
    "sequence_logps": [_seq_unmasked, _seq_mean_over_all_positions, _seq_ignores_average, _seq_mean_nan_on_empty],
    "dpo_loss": list(DPO_MISTAKES.values()),
    "precompute_reference_logps": [_reference_with_hooks, _reference_ignores_average, _reference_first_chunk_only,
                                   _reference_swapped],
    "rloo_advantages": [_loo_includes_self, _loo_divides_by_g, _loo_population_std, _loo_ignores_normalize,
                        _loo_unscorable_as_zero],
    "kl_penalized_rewards": [_kl_sign, _kl_k3, _kl_token_mean, _kl_unmasked, _kl_not_detached],
    "rloo_loss": [_rloo_ratio_sign, _rloo_one_sided, _rloo_max, _rloo_summed, _rloo_constant_ratio,
                  _rloo_ignores_epsilon_high],
}
