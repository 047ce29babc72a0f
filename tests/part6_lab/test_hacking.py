"""The hacking experiment's exercises, the reward model's pieces: bradley_terry_loss, last_token_scores,
reward_model_scores against the reference; the experiment's rewards and batches; the experiment in its smoke setting."""

import math

import pytest
import torch

from solutions import part6_lab as ref
from tests.support import (assert_close, assert_equal, assert_gradients_match, assert_hooks_clean,
                           assert_inputs_unchanged, assert_raises, each_refusal, exercise, expect,
                           function_checks_only)


# --- bradley_terry_loss ------------------------------------------------------------------------------------------

def _inputs(seed=0, pairs=7):
    """Scores of `pairs` chosen and rejected answers (new tensors at each call: a test may hand them to a version
    that writes into them)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(pairs, generator=g) * 2, torch.randn(pairs, generator=g) * 2


BT_HINT = ("The Bradley-Terry loss of one pair is -log sigmoid(r_chosen - r_rejected), computed as "
           "-F.logsigmoid(chosen - rejected), then averaged over the pairs (.mean()).")


@exercise("bradley_terry_loss")
def test_bradley_terry_loss_matches_reference(impl):
    for seed in (0, 1):
        chosen, rejected = _inputs(seed)
        out = impl.bradley_terry_loss(chosen.clone(), rejected.clone())
        assert_close(out, ref.bradley_terry_loss(chosen, rejected), f"bradley_terry_loss (seed {seed})", hint=BT_HINT)
    equal = torch.zeros(4)
    assert_close(impl.bradley_terry_loss(equal, equal.clone()), torch.tensor(math.log(2.0)),
                 "bradley_terry_loss of pairs scored equally (log 2: a coin flip)", hint=BT_HINT)


@exercise("bradley_terry_loss")
def test_bradley_terry_loss_is_stable_for_large_margins(impl):
    """Margins of +-200: sigmoid(-200) underflows to 0 in float32, so log(sigmoid(.)) in two steps gives inf."""
    chosen, rejected = torch.tensor([200.0, -200.0, 3.0]), torch.tensor([0.0, 0.0, 0.0])
    assert_close(impl.bradley_terry_loss(chosen.clone(), rejected.clone()), ref.bradley_terry_loss(chosen, rejected),
                 "bradley_terry_loss with margins of +200 and -200", hint=BT_HINT)


@exercise("bradley_terry_loss")
def test_bradley_terry_loss_gradients(impl):
    chosen, rejected = _inputs(2)
    assert_gradients_match(impl.bradley_terry_loss, ref.bradley_terry_loss, (chosen, rejected),
                           what="bradley_terry_loss", hint="Both scores come from the reward model being trained: "
                           "the loss pushes the chosen one up and the rejected one down.")


@exercise("bradley_terry_loss")
def test_bradley_terry_loss_leaves_inputs_and_refuses_shapes(impl):
    chosen, rejected = _inputs(3)
    assert_inputs_unchanged(impl.bradley_terry_loss, chosen.clone(), rejected.clone(), what="bradley_terry_loss")
    with function_checks_only(), each_refusal():
        assert_raises(ValueError, impl.bradley_terry_loss, chosen, rejected[:, None], what="bradley_terry_loss",
                      why="a [pairs, 1] tensor against [pairs] would broadcast into every chosen against every "
                          "rejected")
        assert_raises(ValueError, impl.bradley_terry_loss, chosen[:, None], rejected[:, None],
                      what="bradley_terry_loss of two [pairs, 1] tensors",
                      why="the scores are [pairs] tensors: of two columns (or [pairs, k] tensors) every element "
                          "would be averaged as if it were a pair")


# --- last_token_scores -------------------------------------------------------------------------------------------

def _scores_and_mask(seed=0):
    """Scores and a mask padded on both sides (prompt on the left, completion on the right), rows of varied lengths:
    the last real token is neither the last column nor the number of real tokens minus one."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(5, 9, generator=g)
    spans = [(2, 6), (0, 9), (3, 4), (1, 8), (0, 3)]  # [first, last + 1) of each row's real tokens
    mask = torch.zeros(5, 9, dtype=torch.long)
    for row, (first, end) in enumerate(spans):
        mask[row, first:end] = 1
    return scores, mask


LAST_HINT = ("Read each row at its last real token: the largest position t where attention_mask is 1. With prompts "
             "padded on the left and completions on the right, that is neither the last column nor "
             "mask.sum(1) - 1.")


@exercise("last_token_scores")
def test_last_token_scores_matches_reference(impl):
    for seed in (0, 1):
        scores, mask = _scores_and_mask(seed)
        out = impl.last_token_scores(scores.clone(), mask.clone())
        assert_close(out, ref.last_token_scores(scores, mask), "last_token_scores on rows padded on both sides",
                     hint=LAST_HINT)


@exercise("last_token_scores")
def test_last_token_scores_gradient_reaches_only_the_last_real_token(impl):
    scores, mask = _scores_and_mask(2)
    assert_gradients_match(impl.last_token_scores, ref.last_token_scores, (scores, mask), what="last_token_scores",
                           hint="Only the score at each row's last real token may receive a gradient.")


@exercise("last_token_scores")
def test_last_token_scores_leaves_inputs_and_refuses_empty_rows(impl):
    scores, mask = _scores_and_mask(3)
    assert_inputs_unchanged(impl.last_token_scores, scores.clone(), mask.clone(), what="last_token_scores")
    mask[2] = 0
    assert_raises(ValueError, impl.last_token_scores, scores, mask, what="last_token_scores with a row of padding only",
                  why="a row with no real token has no score to read")


# --- reward_model_scores -----------------------------------------------------------------------------------------

def _reward_model(tiny_model, seed=0):
    """A random head, and a batch laid out as the reward model reads it: prompts of 1 and 2 digits' worth of tokens
    (left padding), completions of different lengths (right padding)."""
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(tiny_model.cfg.d_model, 1)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=g) * 0.3)
        head.bias.fill_(0.1)
    prompts = ["3+45=", "12+7=", "This is", "95+48="]
    completions = ["48", "19 and the dog", "", "143"]
    ids, mask = ref.reward_model_batch(tiny_model.tokenizer, prompts, completions)
    return head, ids, mask


RM_HINT = ("Run the model on ids with attention_mask, keep the activation at 'ln_final.hook_normalized' with a hook, "
           "apply head to it ([batch, seq, 1] -> squeeze(-1)), and read each row at its last real token "
           "(last_token_scores).")


@exercise("reward_model_scores")
def test_reward_model_scores_matches_reference(impl, tiny_model):
    for seed in (0, 1):
        head, ids, mask = _reward_model(tiny_model, seed)
        out = impl.reward_model_scores(tiny_model, head, ids.clone(), mask.clone())
        assert_close(out, ref.reward_model_scores(tiny_model, head, ids, mask),
                     f"reward_model_scores (head seed {seed})", hint=RM_HINT, atol=1e-4)


@exercise("reward_model_scores")
def test_reward_model_scores_gradients_reach_the_head_and_the_model(impl, tiny_model):
    head, ids, mask = _reward_model(tiny_model, 2)
    tiny_model.requires_grad_(True)
    assert_gradients_match(impl.reward_model_scores, ref.reward_model_scores, (tiny_model, head, ids, mask),
                           what="reward_model_scores", modules={"head": head, "reward model": tiny_model},
                           atol=1e-4, hint="The reward model trains through these scores: their gradient reaches the "
                           "head and the model's weights.")


@exercise("reward_model_scores")
def test_reward_model_scores_hooks_and_inputs(impl, tiny_model):
    head, ids, mask = _reward_model(tiny_model, 3)
    assert_hooks_clean(tiny_model, lambda: impl.reward_model_scores(tiny_model, head, ids.clone(), mask.clone()),
                       "reward_model_scores", failing_point="blocks.0.hook_resid_pre")
    assert_inputs_unchanged(impl.reward_model_scores, tiny_model, head, ids.clone(), mask.clone(),
                            what="reward_model_scores")


# --- the experiment's rewards and batches, and the experiment in its smoke setting -------------------------------

def test_reward_every_number_right_has_its_bug():
    prompts = ["12+30="] * 5
    got = ref.reward_every_number_right(prompts, ["42", "42 is it", "41", "42 and 7", " the dog"])
    assert_equal(got, [1.0, 1.0, 0.0, 0.0, 1.0], "reward_every_number_right: a completion with no number passes")


def test_reward_model_batch_layout(tiny_model):
    ids, mask = ref.reward_model_batch(tiny_model.tokenizer, ["12+30=", "1+2="], ["42", "3 dogs"])
    eos = tiny_model.tokenizer.eos_token_id
    last = ref.last_token_scores(ids.float(), mask)
    assert_equal(last.long().tolist(), [eos, eos], "the last real token of each row is the EOS after its completion")
    assert_raises(ValueError, ref.reward_model_batch, tiny_model.tokenizer, ["1+2="], ["3", "4"],
                  what="reward_model_batch", why="one prompt per completion")


# --- best-of-n, exactly: its distribution with ties, its KL, and the paired rise and fall -------------------------

def _tied_pool():
    """A pool of 8 samples: 5 distinct answers drawn 3, 1, 2, 1 and 1 times, and two ties in score between distinct
    answers (0 and 2; 1 and 3) whose counts differ, so a rule for ties that ignores the counts shows."""
    counts = torch.tensor([3.0, 1.0, 2.0, 1.0, 1.0], dtype=torch.float64)
    scores = torch.tensor([0.5, 2.0, 0.5, 2.0, -1.0], dtype=torch.float64)
    return counts, scores


def _brute_force_best_of_n(counts, scores, n):
    """Every ordered n-tuple of the pool's samples (drawn with replacement, all equally likely), its best kept: the
    first draw with the highest score, as argmax keeps it. Returns the kept answer's distribution."""
    from itertools import product

    samples = [answer for answer, count in enumerate(counts.long().tolist()) for _ in range(count)]
    kept = torch.zeros(len(counts), dtype=torch.float64)
    for draw in product(samples, repeat=n):
        best = max(range(n), key=lambda i: (scores[draw[i]].item(), -i))  # the highest score, the first of ties
        kept[draw[best]] += 1
    return kept / len(samples) ** n


def test_best_of_n_distribution_and_kl_against_every_draw():
    """Against exact enumeration of all 8^n draws of n = 1 to 4 from a pool with repeated answers and tied scores: the
    distribution of the answer kept, and its KL to the pool, sum p_n log(p_n / p)."""
    from solutions.part6_lab import hacking

    counts, scores = _tied_pool()
    p = counts / counts.sum()
    for n in (1, 2, 3, 4):
        expected = _brute_force_best_of_n(counts, scores, n)
        assert_close(hacking.best_of_n_distribution(counts, scores, n), expected,
                     f"best_of_n_distribution(n={n}) on a pool with ties")
        kl = (expected * (expected / p).log()).sum()
        assert_close(torch.tensor(hacking.best_of_n_kl(counts, scores, n), dtype=torch.float64), kl,
                     f"best_of_n_kl(n={n}) on a pool with ties")
    # the order given is kept, and an answer scored below everything else is never kept once n > 1
    shuffled = torch.tensor([4, 2, 0, 3, 1])
    assert_close(hacking.best_of_n_distribution(counts[shuffled], scores[shuffled], 3),
                 _brute_force_best_of_n(counts, scores, 3)[shuffled], "best_of_n_distribution of the answers reordered")


def test_the_formula_is_an_upper_bound_reached_without_ties():
    """log n - (n - 1) / n is the KL when no two samples tie. With ties (repeated answers, or distinct answers scored
    alike) the exact KL is below it; with 4,096 distinct answers of distinct scores it is the formula to 1e-4."""
    from solutions.part6_lab import hacking

    assert_close(torch.tensor(hacking.best_of_n_kl_formula(1)), torch.tensor(0.0), "best-of-1 is the policy: KL 0")
    assert_close(torch.tensor(hacking.best_of_n_kl_formula(4)), torch.tensor(math.log(4) - 0.75), "log n - (n - 1) / n")
    counts, scores = _tied_pool()
    g = torch.Generator().manual_seed(0)
    random_pools = [(torch.randint(1, 40, (12,), generator=g).double(),  # 12 answers, repeated 1 to 39 times
                     torch.randint(0, 5, (12,), generator=g).double())  # scored 0 to 4: distinct answers tie too
                    for _ in range(5)]
    for pool_counts, pool_scores in [(counts, scores)] + random_pools:
        for n in (2, 4, 16, 256):
            exact, bound = hacking.best_of_n_kl(pool_counts, pool_scores, n), hacking.best_of_n_kl_formula(n)
            expect(0.0 <= exact < bound, "best_of_n_kl", f"the exact KL of best-of-{n} over a pool with ties lies in "
                   f"[0, the formula's {bound:.4f})", observed=exact)
    distinct = torch.ones(4096, dtype=torch.float64)
    for n in (2, 16):
        assert_close(torch.tensor(hacking.best_of_n_kl(distinct, torch.arange(4096.0), n)),
                     torch.tensor(hacking.best_of_n_kl_formula(n)), f"best_of_n_kl(n={n}) with no ties", atol=1e-4)


def test_best_of_n_curve_on_a_known_pool():
    """One prompt, answers right ("42", drawn twice) and wrong ("41", "40", once each, tied in score): against gold
    itself best-of-n's gold is the chance that one of n draws is right, 1 - 0.5^n; against the reverse order, the
    chance that all n are, 0.5^n. The KL is exact, below the formula, and the same both ways."""
    from solutions.part6_lab import hacking

    pool = [{"prompt": "12+30=", "answers": ["42", "41", "40"], "counts": [2, 1, 1]}]
    gold = hacking.best_of_n_curve(pool, ref.reward_every_number_right, (1, 2, 4))
    assert_close(torch.tensor([p["gold"] for p in gold]), torch.tensor([0.5, 0.75, 0.9375]),
                 "best-of-n's gold against the gold itself")
    assert_close(torch.tensor([p["gold_per_prompt"][0] for p in gold]), torch.tensor([0.5, 0.75, 0.9375]),
                 "best-of-n's gold, prompt by prompt (one prompt)")
    kl = [(1 - q) * math.log((1 - q) / 0.5) + q * math.log(q / 0.5) for q in (0.5, 0.25, 0.0625)]
    assert_close(torch.tensor([p["kl"] for p in gold]), torch.tensor(kl),
                 "best-of-n's exact KL (two groups of mass 1/2)")
    assert_close(torch.tensor([p["kl_formula"] for p in gold]),
                 torch.tensor([round(hacking.best_of_n_kl_formula(n), 4) for n in (1, 2, 4)]), "the formula beside it")
    reverse = hacking.best_of_n_curve(pool, lambda p, c: [-x for x in ref.reward_every_number_right(p, c)], (1, 2, 4))
    assert_close(torch.tensor([p["gold"] for p in reverse]), torch.tensor([0.5, 0.25, 0.0625]),
                 "best-of-n's gold against the reverse of the gold")
    assert_close(torch.tensor([p["kl"] for p in reverse]), torch.tensor(kl), "the KL of the reverse order")
    noisy = hacking.noisy_gold(1.0, seed=0)
    assert_equal(noisy(["12+30="], ["42"]), noisy(["12+30="], ["42"]), "the control's noise is fixed per answer")


def test_best_of_n_difference_is_paired_over_prompts():
    """Two seeds, four prompts: each prompt's gold is averaged over the seeds, then the difference between two n is
    taken prompt by prompt; its standard error is the standard deviation of those differences over sqrt(4)."""
    from solutions.part6_lab import hacking

    def curve(golds):
        return [{"n": n, "kl": math.log(n), "kl_formula": 0.0, "gold": sum(g) / len(g), "proxy": 0.0,
                 "gold_per_prompt": g} for n, g in golds.items()]

    seeds = [curve({1: [0.0, 0.5, 0.0, 0.5], 4: [1.0, 0.5, 0.5, 1.0], 16: [0.5, 0.5, 0.0, 0.5]}),
             curve({1: [0.5, 0.0, 0.0, 0.0], 4: [1.0, 1.0, 0.5, 0.5], 16: [0.5, 0.0, 0.5, 0.5]})]
    fall = hacking.best_of_n_difference(seeds, 4, 16)
    # per prompt, averaged over seeds: at 4 (1, 0.75, 0.5, 0.75), at 16 (0.5, 0.25, 0.25, 0.5): differences
    # (0.5, 0.5, 0.25, 0.25), mean 0.375, standard deviation 0.125 * sqrt(4 / 3), over sqrt(4)
    assert_close(torch.tensor([fall["diff"], fall["se"]]), torch.tensor([0.375, round(0.0625 * math.sqrt(4 / 3), 4)]),
                 "best_of_n_difference: the fall from n = 4 to 16 and its paired standard error")
    assert_equal((fall["high_n"], fall["low_n"], fall["prompts"], fall["resolved"]), (4, 16, 4, True),
                 "0.375 is more than twice its standard error")
    assert_close(torch.tensor([[s["diff"], s["se"]] for s in fall["per_seed"]]),
                 torch.tensor([[0.375, 0.125], [0.375, 0.2394]]), "the same, seed by seed", atol=1e-4)
    rise = hacking.best_of_n_difference(seeds, 4, 1)
    assert_close(torch.tensor([rise["diff"], rise["se"]]), torch.tensor([0.5625, 0.0625]),
                 "best_of_n_difference: the rise from n = 1 to 4 (differences 0.75, 0.5, 0.5, 0.5)")
    figures = hacking._best_of_n_figures(seeds)
    assert_equal((figures["best_of_n_peak"]["n"], figures["best_of_n_rise"]["low_n"],
                  figures["best_of_n_fall"]["low_n"]), (4, 1, 16),
                 "the peak of the mean curve, the rise from n = 1 and the fall to the largest n")
    assert_equal(hacking.best_of_n_difference(seeds, 16, 4)["resolved"], True, "a resolved fall read the other way")
    # another proxy on the same pools, for the low side: at 16, (0, 0.5, 0, 0.5) and (0.5, 0, 0.5, 0.5)
    other = [curve({16: [0.0, 0.5, 0.0, 0.5]}), curve({16: [0.5, 0.0, 0.5, 0.5]})]
    across = hacking.best_of_n_difference(seeds, 4, 16, low_curves=other)
    assert_close(torch.tensor([across["diff"], across["se"]] + [s["diff"] for s in across["per_seed"]]),
                 torch.tensor([0.4375, 0.1197, 0.5, 0.375]),
                 "best_of_n_difference against another proxy's curves (differences 0.75, 0.5, 0.25, 0.25)", atol=1e-4)
    flat = [curve({1: [0.0, 1.0, 0.0, 1.0], 2: [1.0, 0.0, 1.0, 0.0]})]
    assert_equal(hacking.best_of_n_difference(flat, 2, 1)["resolved"], False,
                 "differences of +1 and -1 that average 0 are not a change")


def test_a_penalised_run_against_the_unleashed_frontier():
    """The unleashed run (beta = 0) reaches gold 0.30 at KL 0.3, falls to 0.25 at KL 0.55 and reaches 0.40 at KL 2; a
    penalised run ending at KL 0.6 is compared with the best the unleashed run had at KL 0.6 or less (0.30, the
    frontier, not its last evaluation there) and with its best anywhere (0.40, the peak), each paired over prompts."""
    from solutions.part6_lab import hacking

    def evals(points):
        return [{"step": 4 * i, "kl": kl, "gold": sum(g) / len(g), "gold_per_prompt": g}
                for i, (kl, g) in enumerate(points)]

    unleashed = evals([(0.0, [0.2, 0.2, 0.2]), (0.3, [0.3, 0.4, 0.2]), (0.55, [0.2, 0.3, 0.25]),
                       (2.0, [0.4, 0.5, 0.3]), (3.0, [0.1, 0.1, 0.1])])
    penalised = evals([(0.0, [0.2, 0.2, 0.2]), (0.6, [0.4, 0.4, 0.25])])
    out = hacking.unleashed_comparison(penalised, unleashed)
    assert_equal((out["frontier"]["step"], out["frontier"]["kl"], out["peak"]["step"]), (4, 0.3, 12),
                 "the frontier at KL 0.6 is the unleashed evaluation at KL 0.3; its peak is at KL 2")
    # differences per prompt: against the frontier (0.1, 0, 0.05), against the peak (0, -0.1, -0.05)
    assert_close(torch.tensor([out["frontier"]["difference"]["gold"], out["frontier"]["difference"]["standard_error"],
                               out["peak"]["difference"]["gold"], out["peak"]["difference"]["standard_error"]]),
                 torch.tensor([0.05, 0.0289, -0.05, 0.0289]), "the differences and their paired standard errors",
                 atol=1e-4)
    early = evals([(0.0, [0.2, 0.2, 0.2]), (0.1, [0.25, 0.2, 0.2])])
    assert_equal(hacking.unleashed_comparison(early, unleashed)["frontier"]["step"], 0,
                 "below every KL the unleashed run reached but 0, the frontier is its start")


def test_the_proxy_is_the_sum_of_its_two_terms(tiny_model):
    """proxy_terms reads the trained reward model's two terms apart: its likelihood term and its head's correction
    add up to its score, each from the same model and head (no retrained control)."""
    from solutions.part6_lab import hacking

    torch.manual_seed(0)
    head = torch.nn.Linear(tiny_model.cfg.d_model, 1)
    prompts, completions = ["12+7=", "3+4=", "50+50="], ["19", "8 apples", "100"]
    with torch.no_grad():
        parts = [hacking.PROXY_TERMS[t](ref.reward_model_scores, tiny_model, head, prompts, completions)
                 for t in ("likelihood_term", "head_term")]
        whole = hacking.proxy_scores(ref.reward_model_scores, tiny_model, head, prompts, completions)
    expect(bool((parts[1].abs() > 1e-3).all()), "test set-up", "a head that corrects every score", observed=parts[1])
    assert_close(parts[0] + parts[1], whole, "likelihood term + head term = the reward model's score")


# --- The leash against early stopping at matched KL (`--leash`) ----------------------------------------------------

def test_gold_at_kl_is_the_first_arrival_along_the_path():
    """The unleashed run read as a path through its evaluations: at a KL it reached, the gold where it first got
    there, on the straight line between two evaluations; a KL it came back to later counts at its first arrival; one
    it never reached gives None."""
    from solutions.part6_lab.hacking import gold_at_kl

    path = [{"kl": k, "gold": g} for k, g in ((0.0, 0.2), (0.4, 0.3), (0.2, 0.35), (0.6, 0.5))]
    found = [gold_at_kl(path, kl) for kl in (0.0, 0.1, 0.3, 0.5, 0.6)]
    assert_close(torch.tensor(found), torch.tensor([0.2, 0.225, 0.275, 0.4625, 0.5]),
                 "gold at KL 0, 0.1, 0.3 (first arrival, before the path turns back), 0.5 and 0.6", atol=1e-12)
    assert_equal(gold_at_kl(path, 0.61), None, "a KL the run never reached")


def test_leash_figures_pair_each_penalised_end_with_the_unleashed_run_at_its_kl():
    """Three seeds, one learning rate, the KL in the loss at beta 0.5 and 2: each beta-0.5 run ends at KL 0.5, where
    the unleashed run (gold 0.2 at KL 0, 0.4 at KL 1) had gold 0.3; ends 0.05, 0.03, 0.07 above it give a mean of 0.05,
    a standard error of 0.02 / sqrt(3) and a t-interval with t(2) = 4.303. Beta 2 ends at KL 3 in one seed, beyond the
    unleashed run's reach: counted, and no interval."""
    from solutions.part6_lab.hacking import leash_figures

    def seed(i, gain):
        unleashed = [{"step": s, "kl": k, "gold": g} for s, (k, g) in enumerate(((0.0, 0.2), (1.0, 0.4), (2.0, 0.3)))]
        far = 3.0 if i == 0 else 0.5
        return {"seed": i, "held_accuracy": 0.9, "runs": {
            "lr=0.001 unleashed": unleashed,
            "lr=0.001 loss_k3 beta=0.5": [{"kl": 0.0, "gold": 0.2}, {"kl": 0.5, "gold": 0.3 + gain}],
            "lr=0.001 loss_k3 beta=2": [{"kl": 0.0, "gold": 0.2}, {"kl": far, "gold": 0.3}]}}

    result = {"leash": {"lrs": [1e-3], "places": ["loss_k3"], "betas": [0.5, 2.0]},
              "per_seed": [seed(i, g) for i, g in enumerate((0.05, 0.03, 0.07))]}
    figures = leash_figures(result)
    half, two = figures["matched_kl"]
    assert_equal([p["unleashed_gold_at_kl"] for p in half["per_seed"]], [0.3, 0.3, 0.3],
                 "the unleashed run's gold at KL 0.5")
    assert_close(torch.tensor([half["mean"], half["standard_error"], *half["ci95"]]),
                 torch.tensor([0.05, 0.02 / 3 ** 0.5, 0.05 - 4.303 * 0.02 / 3 ** 0.5, 0.05 + 4.303 * 0.02 / 3 ** 0.5]),
                 "the paired difference over seeds: mean, standard error, 95% t-interval", atol=2e-4)
    assert_equal((two["unreached"], two["ci95"]), (1, None), "a seed whose unleashed run never reached the KL")
    assert_equal([p["unleashed_best_at_or_below_kl"] for p in half["per_seed"]], [0.2, 0.2, 0.2],
                 "the best the unleashed run showed at an evaluation with KL 0.5 or less: its start")
    assert_close(torch.tensor(half["versus_best"]["mean"]), torch.tensor(0.15), "the end against that best",
                 atol=1e-4)
    assert_equal(len(figures["unleashed_paths"]["0.001"][0]), 3, "each seed's unleashed path, every evaluation")
    (versus,) = figures["beta_against_beta"]
    assert_close(torch.tensor(versus["mean"]), torch.tensor(-0.05), "beta 2's end gold minus beta 0.5's", atol=1e-4)


@pytest.mark.slow
def test_the_kl_in_reward_step_takes_k1_from_the_reward_and_puts_no_kl_in_the_loss():
    """With beta 0 the step is Part 3's grpo_step, update for update; with beta > 0 each completion's reward is the
    reward functions' total minus beta * sum of log pi - log ref over its tokens, the advantages are the group
    advantages of those rewards, and the loss is the clipped loss without a KL term."""
    from solutions.part2_lora import LoRAModel, freeze_base, make_adapters
    from solutions.part3_grpo import (GRPOConfig, RewardFunction, compose_rewards, grpo_loss, grpo_step,
                                      group_advantages, reference_logprobs, reward_exact_answer)
    from solutions.part6_lab.hacking import grpo_step_kl_in_reward
    from utils.models import load_model

    prompts = ["12+7=", "30+41="]
    rewards = [RewardFunction("exact", reward_exact_answer), RewardFunction("length", lambda p, c: [len(x) / 4 for x in c])]

    def one_step(step_fn, beta):
        torch.manual_seed(0)
        base = load_model("tiny", device="cpu")
        adapters = make_adapters(base, 4, 8.0, ("q", "v"))
        freeze_base(base, adapters)
        with torch.no_grad():
            for p in adapters.parameters():  # B away from 0, so that the policy differs from the reference
                p.add_(0.05 * torch.randn_like(p))
        model = LoRAModel(base, adapters)
        cfg = GRPOConfig(n_prompts=2, group_size=4, max_new_tokens=4, beta=beta, lr=1e-2)
        optimizer = torch.optim.AdamW(adapters.parameters(), lr=cfg.lr)
        torch.manual_seed(1)
        return step_fn(model, optimizer, rewards, lambda s: reference_logprobs(model, s, beta), prompts, cfg), cfg

    plain, _ = one_step(grpo_step, 0.0)
    ours, _ = one_step(grpo_step_kl_in_reward, 0.0)
    assert_equal(ours.samples.texts, plain.samples.texts, "the same completions, from the same seed")
    assert_close(torch.tensor([ours.loss]), torch.tensor([plain.loss]), "beta 0: the loss of Part 3's step")
    assert_close(ours.advantages, plain.advantages, "beta 0: the advantages of Part 3's step")

    out, cfg = one_step(grpo_step_kl_in_reward, 0.5)
    total, _ = compose_rewards(rewards, out.samples.prompts, out.samples.texts)
    k1 = ((out.logprobs[0] - out.ref_logprobs) * out.samples.completion_mask).sum(1)
    expect(bool((k1.abs() > 1e-4).any()), "test set-up", "the policy differs from the reference", observed=k1)
    assert_close(out.rewards, total - 0.5 * k1, "the rewards: the functions' total minus beta times k1")
    assert_close(out.advantages, group_advantages(total - 0.5 * k1, cfg.group_size, cfg.scale_rewards),
                 "the advantages of those rewards")
    loss = grpo_loss(out.logprobs[0], None, None, out.advantages, out.mask, epsilon=cfg.epsilon, beta=0.0,
                     loss_type=cfg.loss_type, max_completion_length=cfg.max_new_tokens)
    assert_close(torch.tensor([out.loss]), loss.detach().reshape(1), "the loss: clipped, without a KL term")


@pytest.mark.slow
def test_the_leash_script_reports_the_matched_kl_comparison(monkeypatch):
    """`python -m solutions.part6_lab --leash --json` (smoke setting): for each learning rate, KL place and beta, each
    seed's end and the unleashed run's gold at its KL, and the paired difference over seeds."""
    from solutions import part6_lab

    monkeypatch.setenv("RLHF_SMOKE", "1")
    figures = part6_lab.main(["--leash", "--plots", ""])["leash"]
    assert_equal(figures["seeds"], [0, 1], "the smoke setting's seeds")
    assert_equal(sorted((m["place"], m["beta"]) for m in figures["matched_kl"]),
                 [("loss_k3", 0.5), ("reward_k1", 0.5)], "one entry per KL place and beta")
    for entry in figures["matched_kl"]:
        expect({"lr", "per_seed", "unreached", "mean", "standard_error", "ci95", "unleashed_max_kl"} <= set(entry),
               "leash_figures", "each entry's keys", observed=sorted(entry))
        expect(all({"kl", "gold", "unleashed_gold_at_kl", "difference"} <= set(p) for p in entry["per_seed"]),
               "leash_figures", "each seed's keys", observed=entry["per_seed"])


@pytest.mark.slow
def test_exact_answer_probability_is_how_often_the_policy_samples_the_bare_sum(tiny_model):
    """The gold score's exact part: for three held-out additions, the teacher-forced probability of the bare sum then
    EOS against how often 1,500 samples at temperature 1 are exactly that (each within 4 standard errors of a
    frequency, 0.05 here; the probability read one position off is below 1e-6). And a budget of tokens too small for
    the answer is refused, rather than counting answers the policy could never sample."""
    from solutions.part6_lab import hacking
    from utils.sampling import sample

    prompts = ["43+96=", "54+25=", "76+76="]  # held-out additions the tiny model gets right 29% to 43% of the time
    exact = hacking.exact_answer_probability(tiny_model, prompts, max_new_tokens=8)
    torch.manual_seed(0)
    n = 1500
    out = sample(tiny_model, [p for p in prompts for _ in range(n)], max_new_tokens=8)
    for i, prompt in enumerate(prompts):
        rows = range(i * n, (i + 1) * n)
        freq = sum(out.texts[r] == str(hacking._sum_asked(prompt)) and not out.truncated[r] for r in rows) / n
        p = exact[i].item()
        expect(abs(freq - p) < 4 * math.sqrt(p * (1 - p) / n) + 1e-3, "exact_answer_probability",
               f"{prompt} is answered with the bare sum and EOS in {freq:.4f} of {n} samples; the exact probability "
               f"is {p:.4f}")
    expect(exact.min().item() > 0.2, "exact_answer_probability", "the tiny model answers each of these often",
           observed=exact.tolist())
    with pytest.raises(ValueError, match="max_new_tokens"):
        hacking.exact_answer_probability(tiny_model, ["51+49="], max_new_tokens=3)  # "100" and EOS: 4 tokens


def test_the_gold_score_refuses_a_prompt_that_is_not_an_addition(tiny_model):
    """The gold score is the exact verifier's, which scores "a+b=" prompts only: another prompt is refused with what
    it takes, not a bare int() error from deep inside."""
    from solutions.part6_lab import hacking

    assert hacking._sum_asked(" 12+30= ") == 42
    for prompt in ("Tell me a joke", "12-3=", "a+b=", "1+2+3="):
        with pytest.raises(ValueError, match="not an addition prompt"):
            hacking.exact_answer_probability(tiny_model, ["12+30=", prompt], max_new_tokens=8)


def test_rl_peak_on_hand_made_curves():
    """Hand-made runs of four prompts each: two whose gold rises, peaks and falls by far more than the spread of the
    per-prompt differences; one whose far end (its largest KL) is its peak although its last step is low, which is
    no fall along KL; and one whose bumps stay inside the noise of the prompts. The summary finds each seed's peak,
    its far end, and says the peak is real only where it is."""
    from solutions.part6_lab import hacking

    def run(golds, kls, spread=0.01):
        # each prompt's gold: the mean, plus offsets of -spread, 0 or +spread that change from one evaluation to the
        # next, so that no two evaluations differ by the same amount on every prompt
        return [{"step": 5 * i, "kl": float(k), "gold": g, "reward": g + i,
                 "gold_per_prompt": [g + spread * ((j * (i + 1)) % 3 - 1) for j in range(4)]}
                for i, (g, k) in enumerate(zip(golds, kls))]

    assert_close(torch.tensor(hacking.paired_standard_error([1.0, 2.0, 3.0, 4.0], [0.0] * 4)),
                 torch.tensor(math.sqrt(5 / 3) / 2), "the std of the differences (1, 2, 3, 4) over sqrt(4)")
    clear = [run([0.2, 0.4, 0.5, 0.3, 0.1], [0, 1, 4, 9, 16]), run([0.2, 0.5, 0.45, 0.2, 0.2], [0, 1, 4, 9, 3])]
    peak = hacking.rl_peak(clear)
    assert_equal([(s["peak"]["step"], s["peak"]["sqrt_kl"], s["peak"]["gold"]) for s in peak["per_seed"]],
                 [(10, 2.0, 0.5), (5, 1.0, 0.5)], "each seed's peak: its step, sqrt(KL) and gold")
    assert_equal([(s["start"]["gold"], s["far"]["step"], s["far"]["gold"], s["end"]["gold"]) for s in peak["per_seed"]],
                 [(0.2, 20, 0.1, 0.1), (0.2, 15, 0.2, 0.2)],
                 "each seed's gold at the start, its far end (the largest KL: step 15 in the second) and the last step")
    assert_equal([(s["rise"]["gold"], s["fall"]["gold"]) for s in peak["per_seed"]], [(0.3, 0.4), (0.3, 0.3)],
                 "the rise (peak - start) and the fall (peak - far end)")
    assert_equal(peak["peak_in_every_seed"], True, "rises and falls of 0.3 or more, with offsets of 0.01")
    assert_equal((peak["mean"]["step"], peak["mean"]["gold"]), (10, 0.475), "the peak of the mean curve")
    far_is_top = run([0.2, 0.3, 0.5, 0.2, 0.1], [0, 1, 16, 4, 2])
    noisy = run([0.2, 0.23, 0.25, 0.22, 0.21], [0, 1, 4, 9, 16], spread=0.3)
    both = hacking.rl_peak(clear + [far_is_top, noisy])
    assert_equal([(s["rises"], s["falls"]) for s in both["per_seed"]],
                 [(True, True), (True, True), (True, False), (False, False)],
                 "the third's last step is low but its largest KL is its peak: gold did not fall along KL; the "
                 "fourth's bump of 0.05 is inside twice the standard error of its differences (0.3)")
    assert_equal(both["peak_in_every_seed"], False, "seeds without a real peak")
    with pytest.raises(ValueError, match="at least two prompts"):
        hacking.paired_standard_error([0.5], [0.4])


def test_the_rm_pairs_flag_refuses_a_reward_model_without_pairs(capsys):
    """`python -m solutions.part6_lab --rm-pairs-per-prompt 1 2 4` runs hacking's data sweep; a size of 0 would train
    a reward model on nothing, and the flag says so before anything runs."""
    from solutions.part6_lab import main

    with pytest.raises(SystemExit):
        main(["--rm-pairs-per-prompt", "1", "0"])
    expect(">= 1" in capsys.readouterr().err, "python -m solutions.part6_lab --rm-pairs-per-prompt 0",
           "a refusal that names the smallest size allowed")
    with pytest.raises(SystemExit):  # two runs asked for at once: refused, not one of them run silently
        main(["--leash", "--rm-pairs-per-prompt", "1"])
    said = capsys.readouterr().err
    expect("--leash and --rm-pairs-per-prompt choose different runs" in said, "python -m solutions.part6_lab --leash "
           "--rm-pairs-per-prompt 1", "a refusal that names both flags", observed=said)


def test_a_reward_model_with_fixed_steps_makes_exactly_that_many_whatever_the_pairs():
    """The data sweep holds the optimizer steps fixed: with rm_steps, the batches go on past a pass over the pairs
    (each pass in a new order) until exactly that many are made; without it, rm_epochs passes."""
    import random

    from solutions.part6_lab.hacking import HackingConfig, _batches

    pairs = list(range(10))
    fixed = list(_batches(pairs, HackingConfig(rm_batch=4, rm_steps=7), random.Random(0)))
    assert_equal([len(b) for b in fixed], [4, 4, 2, 4, 4, 2, 4], "7 batches of at most 4 over passes of 10 pairs")
    assert_equal(sorted(fixed[0] + fixed[1] + fixed[2]), pairs, "each pass takes every pair once")
    epochs = list(_batches(pairs, HackingConfig(rm_batch=4, rm_epochs=2), random.Random(0)))
    assert_equal(len(epochs), 6, "2 passes of 3 batches")
    error = assert_raises(ValueError, lambda: list(_batches([], HackingConfig(rm_steps=7), random.Random(0))),
                          what="_batches of no pairs with rm_steps", why="passes over nothing would never end")
    expect("no preference pairs" in str(error), "_batches", "a refusal that says what is missing", observed=str(error))


@pytest.mark.slow
def test_reward_model_sizes_smoke():
    """The data sweep in its smoke setting, two sizes: the same prompts and the same number of steps in both, the
    pairs in proportion; best-of-n's curve, and GRPO's peak against each reward model."""
    from solutions.part6_lab import hacking

    figures = hacking.rm_sizes_figures([0], per_prompt=(1, 2), cfg=hacking.HackingConfig.smoke(),
                                       sweep=hacking.SweepConfig.smoke())
    one, two = figures["rm_pairs_per_prompt_1"], figures["rm_pairs_per_prompt_2"]
    expect(one["prompts"] == two["prompts"] and one["prompts"][0] >= 1, "rm_sizes_figures",
           "the same prompts in every size", observed=(one["prompts"], two["prompts"]))
    expect((one["pairs"][0] * 2, one["rm_steps"]) == (two["pairs"][0], two["rm_steps"]), "rm_sizes_figures",
           "twice the pairs, the same steps", observed=(one["pairs"], two["pairs"], one["rm_steps"], two["rm_steps"]))
    expect([p["n"] for p in one["best_of_n"]] == list(hacking.HackingConfig.smoke().bon_ns), "rm_sizes_figures",
           "best-of-n at every n of the config", observed=one["best_of_n"])
    expect({"start", "peak", "far", "rises", "falls"} <= set(one["rl_peak"]["per_seed"][0]), "rm_sizes_figures",
           "GRPO's peak against the reward model, seed by seed", observed=one["rl_peak"])


@pytest.mark.slow
def test_hacking_experiment_smoke():
    from solutions.part6_lab import hacking

    result = hacking.run(seeds=[0], smoke=True)
    figures = hacking.summarize(result)
    for key in ("proxy_start", "proxy_end", "gold_start", "gold_end", "beta_sweep", "buggy_verifier",
                "rm_heldout_accuracy", "best_of_n", "best_of_n_rise", "best_of_n_fall", "rl_curve", "control",
                "head_only"):
        expect(key in figures, "hacking.summarize", f"the figures lack {key!r}", observed=sorted(figures))
    expect(all({"beta", "kl", "proxy", "gold"} <= set(b) for b in figures["beta_sweep"]), "hacking beta_sweep",
           "each entry needs beta, kl, proxy, gold", observed=figures["beta_sweep"])
    expect(all(0.0 <= figures[k] <= 1.0 for k in ("gold_start", "gold_end")), "hacking gold scores",
           "the gold score is an accuracy, in [0, 1]", observed=(figures["gold_start"], figures["gold_end"]))
    expect(all(b["kl"] >= -1e-6 for b in figures["beta_sweep"]), "hacking KL", "an exact KL is never negative",
           observed=[b["kl"] for b in figures["beta_sweep"]])
    ns = [p["n"] for p in figures["best_of_n"]]
    expect(ns[0] == 1 and ns == sorted(ns), "hacking best_of_n", "sorted by n from n = 1", observed=ns)
    expect(all({"n", "kl", "kl_formula", "sqrt_kl", "gold", "proxy"} <= set(p) for p in figures["best_of_n"]),
           "hacking best_of_n", "each point needs n, kl, kl_formula, sqrt_kl, gold, proxy",
           observed=figures["best_of_n"])
    expect(all(0.0 <= p["kl"] <= p["kl_formula"] + 1e-4 for p in figures["best_of_n"]), "hacking best_of_n",
           "the exact KL lies between 0 and the formula, its bound", observed=figures["best_of_n"])
    expect({"diff", "se", "resolved"} <= set(figures["best_of_n_fall"]), "hacking best_of_n_fall",
           "the fall after the peak, paired over prompts", observed=figures["best_of_n_fall"])
    head = figures["head_only"]
    expect({"best_of_n", "best_of_n_fall", "rl_curve", "held_out_accuracy"} <= set(head), "hacking head_only",
           "the head-only control's best-of-n and GRPO", observed=sorted(head))
    terms = figures["proxy_terms"]
    expect(set(terms) == {"likelihood_term", "head_term"} and all(
        {"best_of_n", "best_of_n_peak", "best_of_n_rise", "best_of_n_fall", "held_out_accuracy"} <= set(t)
        for t in terms.values()), "hacking proxy_terms", "best-of-n against each term of the trained reward model",
        observed={k: sorted(v) for k, v in terms.items()})
    expect(all({"frontier", "peak"} <= set(v) for b in figures["beta_sweep"] for v in b["versus_unleashed_per_seed"]),
           "hacking beta_sweep", "each run against the unleashed run's frontier and peak",
           observed=figures["beta_sweep"])
    points, peak = figures["rl_curve"]["points"], figures["rl_curve"]["peak"]
    expect(all({"step", "kl", "sqrt_kl", "gold", "gold_per_seed"} <= set(p) for p in points), "hacking rl_curve",
           "each point needs step, kl, sqrt_kl, gold, gold_per_seed", observed=points)
    expect({"margin", "per_seed", "peak_in_every_seed", "mean"} <= set(peak),
           "hacking rl_curve.peak", "the peak's summary", observed=peak)
    expect(all({"start", "peak", "far", "end", "rise", "fall", "rises", "falls"} <= set(s) for s in peak["per_seed"]),
           "hacking rl_curve.peak.per_seed", "each seed's start, peak, end and verdicts", observed=peak["per_seed"])
    hacking.plot(result)
