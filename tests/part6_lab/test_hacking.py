"""The hacking experiment's exercises, the reward model's pieces: bradley_terry_loss, last_token_scores,
reward_model_scores against the reference; the experiment's rewards and batches; the experiment in its smoke setting."""

import math

import pytest
import torch

from solutions import part6_lab as ref
from tests.support import (assert_close, assert_equal, assert_gradients_match, assert_hooks_clean,
                           assert_inputs_unchanged, assert_raises, exercise, expect, function_checks_only)


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
    with function_checks_only():
        assert_raises(ValueError, impl.bradley_terry_loss, chosen, rejected[:, None], what="bradley_terry_loss",
                      why="a [pairs, 1] tensor against [pairs] would broadcast into every chosen against every "
                          "rejected")


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
    """`python -m solutions.part6_lab --rm-pairs 100 500 2500` runs hacking's longer variant; a size of 0 would train
    a reward model on nothing, and the flag says so before anything runs."""
    from solutions.part6_lab import main

    with pytest.raises(SystemExit):
        main(["--rm-pairs", "100", "0"])
    expect(">= 1" in capsys.readouterr().err, "python -m solutions.part6_lab --rm-pairs 0",
           "a refusal that names the smallest size allowed")


@pytest.mark.slow
def test_reward_model_sizes_smoke():
    """The longer variant in its smoke setting, one size: best-of-n's curve, and GRPO's peak against that reward
    model."""
    from solutions.part6_lab import hacking

    figures = hacking.rm_sizes_figures([0], pairs=(6,), cfg=hacking.HackingConfig.smoke())
    size = figures["rm_pairs_6"]
    expect(size["pairs"][0] <= 6, "rm_sizes_figures", "a reward model trained on at most the pairs asked for",
           observed=size["pairs"])
    expect([p["n"] for p in size["best_of_n"]] == list(hacking.HackingConfig.smoke().bon_ns), "rm_sizes_figures",
           "best-of-n at every n of the config", observed=size["best_of_n"])
    expect({"start", "peak", "far", "rises", "falls"} <= set(size["rl_peak"]["per_seed"][0]), "rm_sizes_figures",
           "GRPO's peak against the reward model, seed by seed", observed=size["rl_peak"])


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
