"""The numbers the lab chapter's text quotes, held to the figures they come from.

tests/test_lab_figures.py does this for the page docs/lab.md; this file does it for the chapter: the Markdown cells of
chapters/source/part6_lab.py (the source the notebook chapters/part6_lab.ipynb is built from), each line without its
leading `# `, joined and whitespace-normalised into PROSE. Code cells are not prose and are left out.

The figures are the stored runs of docs/figures/ (lab.json, the default run; lab_leash.json, `--leash`;
lab_rm_sweep.json, `--rm-pairs-per-prompt 1 2 4`), read and formatted with the helpers of tests/test_lab_figures.py.
For each section of the chapter a function below builds the chapter's phrases from those figures, {what: phrase}, in
the chapter's own forms (it writes a range "86-90%", with a hyphen, where the page writes an en dash), and a test
asserts that every phrase is in the chapter's prose. A verdict the chapter states ("in every seed", "not resolved") is
built with _if: when the figures do not bear it out, the phrase becomes one the chapter does not hold.

NOT_STORED lists the numbers the chapter quotes that no stored file holds, each with where it comes from; an entry
whose reason starts "disagrees with lab.json" is a number that docs/figures/lab.json gives otherwise (the chapter
quotes another run there). SETTINGS lists the numbers that are not results (a seed list, a step count, a formula's
constant, a paper's year). The last test reads every number of the prose outside code spans and fails on one that is
in none of these, so that a number added to the chapter must say where it comes from."""

import math
import re
import statistics
from decimal import ROUND_CEILING, ROUND_DOWN, Decimal
from pathlib import Path

import pytest

from tests.test_lab_figures import (_at_least, _at_most, _fixed, _if, _lab, _leash, _pct, _pct_span, _pm,
                                    _pts, _rm_sweep, _sci, _two_digits, numbers_by_source)

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "chapters" / "source" / "part6_lab.py"


def markdown_cells(source: str) -> list[str]:
    """The text of each `# %% [markdown]` cell of a notebook source: its lines up to the next `# %%` line, each
    without its leading `#` and the space after it."""
    parts = re.split(r"^# %%(.*)$", source, flags=re.M)  # [before the first cell, kind, body, kind, body, ...]
    cells = []
    for kind, body in zip(parts[1::2], parts[2::2]):
        if kind.strip() == "[markdown]":
            lines = body.strip("\n").splitlines()
            assert all(line.startswith("#") for line in lines if line), f"a Markdown line without `#` in {lines}"
            cells.append("\n".join(line.removeprefix("#").removeprefix(" ") for line in lines))
    return cells


PROSE = " ".join(" ".join(markdown_cells(SOURCE.read_text())).split())  # a sentence's words, wherever lines break


# --- how the chapter writes a figure, beyond the page's helpers ----------------------------------------------------

WORDS = {2: "two", 6: "six", 8: "eight"}
T_2 = 4.303  # the 95% t quantile with 2 degrees of freedom (3 seeds)


def _and(items) -> str:
    """'a', 'a and b', 'a, b and c' (the page's helper wants two items at least)."""
    items = [str(item) for item in items]
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _listed(items) -> str:
    """'a, b, c'."""
    return ", ".join(str(item) for item in items)


def _hyphen(span: str) -> str:
    """The chapter's form of a range: '86-90%' where the page writes '86–90%'."""
    return span.replace("–", "-")


def _to(values, places: int, scale: int = 1, unit: str = "") -> str:
    """The smallest and the largest of `values` joined by 'to': '0.52 to 1.00'; with unit='%', '56% to 61%'."""
    return f"{_fixed(min(values), places, scale=scale)}{unit} to {_fixed(max(values), places, scale=scale)}{unit}"


def _pct_to(values, places: int = 0) -> str:
    return _to(values, places, scale=100, unit="%")


def _every(values, places: int, sign: bool = False) -> str:
    """What every one of `values` rounds to, or a marker the chapter does not hold when they differ."""
    shown = {_fixed(v, places, sign) for v in values}
    return shown.pop() if len(shown) == 1 else f"(not one figure: {sorted(shown)})"


def _close(x: float) -> str:
    """A cosine near 1: two decimals, three where two would say 1.00 ('0.81', '0.998')."""
    return _fixed(x, 3) if _fixed(x, 2) == "1.00" and x != 1 else _fixed(x, 2)


def _cosine(x: float) -> str:
    """A seed's cosine in a list: two decimals, and three beside them where two say 1.00 ('1.00 (0.998)')."""
    return f"{_fixed(x, 2)} ({_fixed(x, 3)})" if _fixed(x, 2) == "1.00" and x != 1 else _fixed(x, 2)


def _pct_tie_down(x: float) -> str:
    """A percentage to one decimal of a stored figure exactly half-way there (0.4535): the chapter rounded the
    unrounded figure, which the JSON does not keep, and it went down ('45.3%')."""
    exact = Decimal(str(x)) * 100
    down = exact.quantize(Decimal("0.1"), rounding=ROUND_DOWN)
    assert exact - down == Decimal("0.05"), f"{x} is no tie at one decimal in percent"
    return f"{down:f}%"


def _ceil(x: float, places: int) -> str:
    """A bound from above: x rounded up, 3.1882 -> '3.2'."""
    return f"{Decimal(str(x)).quantize(Decimal(1).scaleb(-places), rounding=ROUND_CEILING):f}"


def _minus(a: float, b: float) -> float:
    """a − b for two stored decimals, exactly (0.3127 − 0.2842 is 0.0285, not 0.028499...)."""
    return float(Decimal(str(a)) - Decimal(str(b)))


def _mp(stats: dict, sign: bool = True) -> str:
    """A paired statistic of the JSON, its mean ± its standard error to three decimals: '+0.226 ± 0.023'."""
    return f"{_fixed(stats['mean'], 3, sign)} ± {_fixed(stats['standard_error'], 3)}"


def _assert_the_chapter_says(claims: dict, source: str):
    wrong = {what: phrase for what, phrase in claims.items() if phrase not in PROSE}
    assert not wrong, f"chapters/source/part6_lab.py does not say what {source} says: {wrong}"


# --- the chapter's sections, each against the stored figures -------------------------------------------------------

def kl_gradients_claims() -> dict:
    """Section 1, "KL gradients, exactly": what to look for."""
    seeds, figures = _lab()["seeds"], _lab()["kl_gradients"]
    k2, k3, exact = figures["k2_loss"], figures["k3_loss"], figures["exact_token_loss"]
    k1_reward, k3_ratio = figures["k1_reward"], figures["k3_ratio_loss"]
    noise, n = figures["noise"], figures["noise"]["n"]
    at_64 = n.index(64)
    bound = _at_most(max(figures["k3_equals_per_token_forward_kl_on_policy_states"]["max_relative_error"],
                         figures["k3_times_ratio_equals_exact_per_token_kl"]["max_relative_error"]))
    near, mid, main, far = (next(s for s in figures["scale_sweep"] if s["scale"] == scale)
                            for scale in (0.1, 0.5, 1, 1.5))

    def cosines(scale: dict) -> list[float]:  # every term's cosine with the reverse-KL gradient at one scale
        return [c for key, c in scale.items() if key.startswith("cosine_") and c is not None]

    def per_seed(term: dict, key: str) -> str:
        return _listed(_fixed(v, 2) for v in term["per_seed"][key])

    def own(term: str, i: int) -> str:  # the cosine of N samples' gradient with its own expectation
        return _fixed(noise[term]["cosine_own"][i], 2)

    one_gradient = all(term["per_seed"] == k2["per_seed"] for term in (exact, k3_ratio))
    k2_closest = seeds[max(range(len(seeds)), key=lambda i: k2["per_seed"]["cosine_reverse"][i])]
    one_sample = [noise[term]["cosine_own"][0] for term in ("k2_loss", "k3_loss", "k1_reward")]
    most_samples = [noise[term]["cosine_own"][-1] for term in noise if term != "n" and noise[term]["cosine_own"]]
    k3_from_16 = [c for size, c in zip(n, noise["k3_loss"]["cosine_reverse"]) if size >= 16]
    k1_noise = noise["k1_loss"]["cosine_reverse"]
    k1_ratio = figures["k1_loss"]["per_seed"]["norm_ratio"]
    return {
        "k1 in the loss, exactly": "Its expected gradient's norm is "
                                   + " to ".join(_sci(x, 0) for x in (min(k1_ratio), max(k1_ratio)))
                                   + " of the reverse-KL gradient's",
        "k1 in the loss, from N samples": f"stays between {_fixed(min(k1_noise), 2)} and {_fixed(max(k1_noise), 2)} "
                                          f"from N = {n[0]} to {n[-1]}",
        "k1 in the reward": f"cosine {_every(k1_reward['per_seed']['cosine_reverse'], 6)} and norm ratio "
                            f"{_every(k1_reward['per_seed']['norm_ratio'], 4)} on every seed",
        "k3 in the loss": f"Cosine {_fixed(k3['cosine_reverse'], 2)} with the reverse-KL gradient "
                          f"({per_seed(k3, 'cosine_reverse')} on seeds {_listed(seeds)}), and "
                          f"{_fixed(k3['norm_ratio'], 2)} of its norm ({per_seed(k3, 'norm_ratio')})",
        "the k3 identity": f"to a relative error below {bound} on every seed",
        "k3 against the forward KL": f"(cosine {_fixed(k3['cosine_forward'], 2)}) than to the reverse one",
        "the two KLs": f"the forward KL is {_fixed(figures['forward_kl']['mean'], 2)} nats where the reverse is "
                       f"{_fixed(figures['reverse_kl']['mean'], 1)}",
        "k2, the exact per-token KL and k3 × ratio": _if(one_gradient, "have one expected gradient")
                                                     + _if(k2["per_seed"] == exact["per_seed"],
                                                           " (k2 and the exact KL equal to six digits on every seed")
                                                     + f", k3 × ratio to a relative error below {bound})",
        "their cosine and norm": f"Cosine {_fixed(k2['cosine_reverse'], 2)} ({per_seed(k2, 'cosine_reverse')}), "
                                 f"norm {_fixed(k2['norm_ratio'], 2)} ({per_seed(k2, 'norm_ratio')})",
        "the seed where the first token's share is small": f"on seed {k2_closest} that share is small",
        "k3 × ratio's noise against the exact per-token KL's": f"(cosine with its own expectation "
                                                               f"{own('k3_ratio_loss', 0)} at N = {n[0]} and "
                                                               f"{own('k3_ratio_loss', at_64)} at N = {n[at_64]}, "
                                                               f"against {own('exact_token_loss', 0)} and "
                                                               f"{own('exact_token_loss', at_64)})",
        "k3 × ratio's noise is k2's": _if(noise["k3_ratio_loss"] == noise["k2_loss"],
                                          "are the same numbers to the last digit"),
        "the distance": f"(KL {_fixed(near['reverse_kl'], 4)} nats) every cosine is above "
                        f"{_at_least(min(cosines(near)), 3)}, and at {_fixed(mid['reverse_kl'], 2)} nats above "
                        f"{_at_least(min(cosines(mid)), 3)}; at {_fixed(main['reverse_kl'], 0)} nats k3's falls to "
                        f"{_fixed(main['cosine_reverse_k3_loss'], 2)}, at {_fixed(far['reverse_kl'], 0)} nats to "
                        f"{_fixed(far['cosine_reverse_k3_loss'], 2)}",
        "one sample's noise": f"One sample's gradient has cosine {_to(one_sample, 2)} with its own expectation for k2, "
                              f"k3 and k1 in the reward, but {own('exact_token_loss', 0)} for the exact per-token KL",
        "many samples": f"At N = {n[-1]} every term is within cosine {_at_least(min(most_samples), 2)} of its own "
                        f"expectation, but k3's cosine with the reverse-KL gradient stops at {_to(k3_from_16, 2)} "
                        "from N = 16 on",
    }


def hacking_claims() -> dict:
    """Section 2, "Reward hacking, live, and the leash": the experiment and what to look for, with the matched-KL run
    (lab_leash.json) and the data sweep (lab_rm_sweep.json) it quotes."""
    seeds, h = _lab()["seeds"], _lab()["hacking"]
    model, best, peak = h["reward_model"], h["best_of_n"], h["best_of_n_peak"]
    rise, fall = h["best_of_n_rise"], h["best_of_n_fall"]
    first, last = best[0], best[-1]
    at_peak = next(p for p in best if p["n"] == peak["n"])
    pairs = 10 * round(statistics.fmean(model["pairs"]) / 10)  # "about 230": the mean over seeds, to the nearest 10
    likelihood, head = h["proxy_terms"]["likelihood_term"], h["proxy_terms"]["head_term"]
    mode, head_only = h["likelihood_only"], h["head_only"]  # the frozen policy's likelihood; the head-only model
    curve = h["rl_curve"]["peak"]["per_seed"]  # each seed's GRPO run at beta 0: its start, peak, far end, end
    head_curve = head_only["rl_curve"]["peak"]["per_seed"]
    unleashed, leashed, tight = h["beta_sweep"]  # beta 0, 0.5, 2
    versus = [v["peak"] for v in leashed["versus_unleashed_per_seed"]]  # beta 0.5's end minus beta 0's best gold
    above = [i for i, v in enumerate(versus) if v["gold"] > h["rl_curve"]["peak"]["margin"] * v["standard_error"]]
    level = [i for i in range(len(seeds)) if i not in above]
    below = [100 * _minus(g, t) for g, t in zip(leashed["gold_per_seed"], tight["gold_per_seed"])]
    buggy = h["buggy_verifier"]

    def paired(stats: dict, sign: bool = False) -> str:  # a paired difference over prompts, in points
        return _pm(stats["diff"], stats["se"], sign)

    def first_below_start(points: list[dict]) -> int:  # the first n whose gold is below n = 1's
        return next(p["n"] for p in points if p["gold"] < points[0]["gold"])

    def steps(values) -> str:  # '4 or 8'
        return " or ".join(map(str, sorted(set(values))))

    formula, exact_kl = last["kl_formula"], last["kl"]
    mode_peak, mode_fall = _pct_tie_down(mode["best_of_n_peak"]["gold"]), mode["best_of_n_fall"]
    against_mode = [mode[k] for k in ("reward_model_at_its_peak_minus_this", "reward_model_minus_this_at_largest_n")]
    mode_right = round(mode["best_of_n_peak"]["gold_at_largest_n"] * fall["prompts"])  # prompts it gets right
    same_as_proxy = [p["gold"] for p in likelihood["best_of_n"]] == [p["gold"] for p in best]

    leash = _leash()["leash"]
    matched, k3_tight = leash["matched_kl"], leash["beta_against_beta"][0]  # beta 2 minus beta 0.5, k3 in the loss
    assert (k3_tight["place"], k3_tight["high"], k3_tight["low"]) == ("loss_k3", 2, 0.5)
    means = [m["mean"] for m in matched]
    held = [m["versus_best"]["mean"] for m in matched if m["versus_best"]["ci95"][0] > 0]  # above the hindsight best
    (loose,) = {m["beta"]: m for m in matched if m["versus_best"]["ci95"][0] <= 0 <= m["versus_best"]["ci95"][1]
                and m["place"] == "reward_k1"}.values()  # level with it: the loosest leash, at both learning rates
    reward_k1_kl = [p["kl"] for m in matched if m["place"] == "reward_k1" and m["beta"] == 2 for p in m["per_seed"]]
    reward_k1_above = all(v["ci95"][0] > 0 for v in leash["beta_against_beta"] if v["place"] == "reward_k1")

    sweep = _rm_sweep()
    sizes = [sweep[f"rm_pairs_per_prompt_{k}"] for k in (1, 2, 4)]
    peaks, falls = [s["peak"] for s in sizes], [s["best_of_n_fall"] for s in sizes]
    sweep_pairs = _and(format(s["pairs"][0], ",") for s in sizes)
    sweep_accuracy = _and(_hyphen(_pct_span(s["held_accuracy"])) for s in sizes)
    head_only_last = head_only["best_of_n"][-1]
    return {
        # the experiment, and the data sweep it describes
        "the reward model's pairs": f"(about {pairs} pairs)",
        "the data sweep's settings": f"trained on {_and(s['pairs'][0] // s['prompts'][0] for s in sizes)} pairs of "
                                     f"each of the same {_every([p for s in sizes for p in s['prompts']], 0)} "
                                     f"training prompts, each for the same {_every([s['rm_steps'] for s in sizes], 0)}"
                                     " optimizer steps",
        "the data sweep": f"Over seeds {_listed(sweep['seeds'])}, with {sweep_pairs} pairs, the held-out accuracy "
                          f"was {sweep_accuracy}; best-of-n's mean gold peaked at "
                          f"n = {_every([p['n'] for p in peaks], 0)} each time, "
                          + _if(peaks == sorted(peaks, key=lambda p: p["gold"]), "higher with more pairs")
                          + f" ({_listed(_pct(p['gold']) for p in peaks)}), "
                          + _if(falls == sorted(falls, key=lambda f: -f["diff"]), "and fell less after it")
                          + f" ({_and(paired(f) for f in falls)} points down to n = "
                          + _every([f["low_n"] for f in falls], 0) + ", "
                          + _if(all(f["resolved"] for f in falls), "each resolved") + ")",
        "GRPO in the data sweep": _if(all(s["rl_peak"]["peak_in_every_seed"] for s in sizes),
                                      "GRPO had a real peak in every seed of every size"),
        # what to look for: the reward model
        "its accuracy": f"The reward model ranks {_hyphen(_pct_span(model['held_out_accuracy']))} of held-out pairs "
                        f"right ({_hyphen(_pct_span(model['train_accuracy']))} of its training pairs)",
        "the head-only model's accuracy": f"the head-only reward model ranks only "
                                          f"{_pct_to(head_only['held_out_accuracy'])} right "
                                          f"({_pct_to(head_only['train_accuracy'])} of its training pairs)",
        "the reward model's pairs, again": f"from about {pairs} pairs, most of the judging",
        # best-of-n
        "best-of-n's curve": f"Gold goes from {_pct(first['gold'])} at n = {first['n']} to a peak of "
                             f"{_pct(peak['gold'])} at n = {peak['n']} (each seed's peak at n = "
                             f"{steps(peak['n_per_seed'])}), then falls to {_pct(last['gold'])} "
                             f"({_pct_to(last['gold_per_seed'])} over the seeds) at n = {last['n']}",
        "its rise and fall": f"Paired over the {rise['prompts']} prompts, the rise is {paired(rise)} points and the "
                             f"fall {paired(fall)}, "
                             + _if(rise["resolved"] and fall["resolved"] and rise["margin"] == 2,
                                   "each more than twice its standard error"),
        "the fall in every seed": _if(all(s["diff"] > fall["margin"] * s["se"] for s in fall["per_seed"]),
                                      "the fall is so in every seed")
                                  + f" ({_and(paired(s) for s in fall['per_seed'])} points)",
        "the exact KL at the peak": f"The exact KL at the peak is {_fixed(peak['kl'], 2)} nats where",
        "the formula's": f"says {_fixed(at_peak['kl_formula'], 2)}, and {_fixed(exact_kl, 2)} at n = {last['n']} "
                         f"where it says {_fixed(formula, 2)}, {_fixed(100 * (formula / exact_kl - 1), 0)}% more "
                         f"({_fixed(100 * (math.sqrt(formula / exact_kl) - 1), 0)}% more in √KL",
        "the synthetic control's peaks": ", ".join(f"n = {c['peak']['n']} ({_pct(c['peak']['gold'], 0)}) at "
                                                   f"σ = {c['sigma']:g}" for c in h["control"]),
        # the proxy taken apart
        "the likelihood term's accuracy": _if(likelihood["held_out_accuracy"] == model["held_out_accuracy"],
                                              "held-out pairs right as the whole proxy, to four decimals")
                                          + f" ({_pct_to(likelihood['held_out_accuracy'])})",
        "the likelihood term's curve": _if(same_as_proxy, f"the same peak of "
                                                          f"{_pct(likelihood['best_of_n_peak']['gold'])} at "
                                                          f"n = {likelihood['best_of_n_peak']['n']} and the same fall, "
                                                          f"{paired(likelihood['best_of_n_fall'])} points to "
                                                          f"n = {likelihood['best_of_n_fall']['low_n']}"),
        "the head term's accuracy": f"a coin toss ({_pct_to(head['held_out_accuracy'])} of held-out pairs right)",
        "best-of-n against the head term": f"loses gold from n = {first_below_start(head['best_of_n'])} on, down to "
                                           f"{_pct(head['best_of_n'][-1]['gold'])} at n = {head['best_of_n'][-1]['n']}",
        "the frozen policy's likelihood": f"rises by {paired(mode['best_of_n_rise'])} points, to {mode_peak} at "
                                          f"n = {mode['best_of_n_peak']['n']}, "
                                          + _if(not mode_fall["resolved"], "and stays there"),
        "its most likely answers": f"right on {mode_right} of the {fall['prompts']} prompts "
                                   f"(n = {mode_fall['high_n']} minus n = {mode_fall['low_n']}: "
                                   f"{_fixed(mode_fall['diff'], 2, sign=True, scale=100)} ± "
                                   f"{_fixed(mode_fall['se'], 2, scale=100)} points)",
        "the reward model against it": f"above the mode's {mode_peak}, and its end below it, "
                                       + _if(not any(d["resolved"] for d in against_mode), "is not resolved")
                                       + f" at {fall['prompts']} prompts ("
                                       + " and ".join(paired(d, sign=True) for d in against_mode) + " points, paired)",
        "the head-only model, a poor judge": f"is a poor judge too ({_pct_to(head_only['held_out_accuracy'])})",
        "best-of-n against it": f"best-of-n's rise, {paired(head_only['best_of_n_rise'], sign=True)} points at "
                                f"n = {head_only['best_of_n_rise']['high_n']}, "
                                + _if(not head_only["best_of_n_rise"]["resolved"], "is not resolved")
                                + f", gold is back below the policy's own {_pct(first['gold'])} by "
                                  f"n = {first_below_start(head_only['best_of_n'])} and falls to "
                                  f"{_pct(head_only_last['gold'])} at n = {head_only_last['n']}",
        "GRPO against it": f"gains {_to([100 * s['rise']['gold'] for s in head_curve], 1)} points by step "
                           f"{steps(s['peak']['step'] for s in head_curve)} ("
                           + _if(all(s["rises"] for s in head_curve), "resolved in each seed")
                           + f"), then collapses to {_pct_to(head_only['gold_end_per_seed'], 1)} gold by step "
                             f"{_every([s['end']['step'] for s in head_curve], 0)}, at "
                             f"{_to(head_only['kl_end_per_seed'], 1)} nats from the reference",
        "GRPO against the reward model, at most": f"no seed went past {_ceil(max(unleashed['max_kl_per_seed']), 1)} "
                                                  f"nats in {h['rl_curve']['points'][-1]['step']} steps",
        # GRPO against the reward model
        "GRPO's curve": f"Gold goes from {_pct(h['gold_start'])} to a peak of "
                        f"{_pct_to([s['peak']['gold'] for s in curve])} (at √KL "
                        f"{_to([s['peak']['sqrt_kl'] for s in curve], 2)}), then down to "
                        f"{_pct_to([s['far']['gold'] for s in curve])} where the run is furthest from its reference "
                        f"(√KL {_to([s['far']['sqrt_kl'] for s in curve], 1)})",
        "its rises and falls": f"Each rise ({_to([100 * s['rise']['gold'] for s in curve], 1)} points) and fall "
                               f"({_to([100 * s['fall']['gold'] for s in curve], 0)} points) "
                               + _if(h["rl_curve"]["peak"]["peak_in_every_seed"],
                                     "is more than twice the standard error of its difference")
                               + " (" + _to([s[c]["standard_error"] for s in curve for c in ("rise", "fall")], 3)
                               + ")",
        # the leash
        "the leash's ends": f"`beta` {_and(format(b['beta'], 'g') for b in h['beta_sweep'])} end at KL "
                            f"{_and(_fixed(b['kl'], 2) for b in h['beta_sweep'])} nats with gold "
                            f"{_and(_pct(b['gold'], 0) for b in h['beta_sweep'])}",
        "beta 0.5 against the unleashed run's best": f"in seeds {_and(seeds[i] for i in above)} (by "
                                                     + _and(_pm(versus[i]["gold"], versus[i]["standard_error"])
                                                            for i in above)
                                                     + f" points) and level with it in seed "
                                                       f"{_and(seeds[i] for i in level)} ("
                                                     + _listed(_pm(versus[i]["gold"], versus[i]["standard_error"],
                                                                   sign=True) for i in level) + ")",
        "the matched-KL run's seeds": f"--leash`: {len(leash['seeds'])} seeds, the unleashed run evaluated after "
                                      "every step",
        "the matched-KL run": f"the penalised runs ended {_pts(min(means))} to {_pts(max(means))} points above in all "
                              f"{WORDS[len(matched)]} settings"
                              + _if(all(m["positive"] == len(m["per_seed"]) for m in matched), " and every seed")
                              + _if(all(m["ci95"][0] > 0 for m in matched),
                                    ", each 95% t-interval over the seeds clear of 0"),
        "the matched-KL run, against the best": f"they still ended {_pts(min(held))} to {_pts(max(held))} points above "
                                                f"in {WORDS[len(held)]} settings, and level in the loosest (k1 in the "
                                                f"reward at `beta` {loose['beta']:g})",
        "beta 2, k3 in the loss": f"holds the policy so close ({_fixed(tight['kl'], 2)} nats) that it climbs less: "
                                  f"{_to(below, 1)} points below `beta` = 0.5 in each seed here, "
                                  f"{_pts(abs(k3_tight['mean']))} over the {len(leash['seeds'])} seeds (interval "
                                  f"[{_pts(k3_tight['ci95'][0])}, {_pts(k3_tight['ci95'][1])}])",
        "beta 2, k1 in the reward": f"holds it at {_to(reward_k1_kl, 2)} nats "
                                    + _if(reward_k1_above, "and ends above `beta` = 0.5"),
        # the buggy verifier
        "the buggy verifier": f"the buggy reward goes from {_pct(buggy['buggy_start'], 0)} to "
                              f"{_pct(buggy['buggy_end'], 0)} while the gold score goes to "
                              f"{_pct(buggy['gold_end'], 0)} " + _if(not any(buggy["gold_end_per_seed"]),
                                                                     "in every seed"),
    }


def length_bias_claims() -> dict:
    """Section 3, "Length bias, measured": what to look for (the one update on seeds 0–9, training on seeds 0–2)."""
    figures = _lab()["length_bias"]
    settings, control, primary = figures["settings"], figures["positive_control"], figures["paired"]
    raw_control = figures["paired_raw_gap"]["control"]["ci95"]
    training_gap = figures["training"]["grpo"]["eos_gap"]["ci95"]
    measured = f"{settings['push_seeds'][0]}–{settings['push_seeds'][-1]}"
    ends = [(figures[c]["wrong_end"], figures[c]["right_end"]) for c in ("grpo", "dr_grpo", "control")]
    gap, stop = figures["training"]["grpo"]["eos_gap"], figures["training"]["grpo"]["stop_rate_gap"]

    def length(name: str, when: str) -> str:  # the mean length of wrong and right answers, one decimal
        return _fixed((figures[name][f"wrong_{when}"] + figures[name][f"right_{when}"]) / 2, 1)
    return {
        "the positive control": f"{_fixed(control['mean'], 4, sign=True)} ± {_fixed(control['standard_error'], 4)} "
                                f"(95% interval {_fixed(control['ci95'][0], 4, sign=True)} to "
                                f"{_fixed(control['ci95'][1], 4, sign=True)}) on seeds {measured}",
        "the control detected": _if(control["positive"] == len(control["seeds"]) and control["detected"],
                                    "every seed positive, so `detected` is true"),
        "the primary result": f"`\"dr_grpo\"`: {_fixed(primary['mean'], 4, sign=True)} ± "
                              f"{_fixed(primary['standard_error'], 4)} ({_fixed(primary['ci95'][0], 4, sign=True)} to "
                              f"{_fixed(primary['ci95'][1], 4, sign=True)}) on seeds {measured}",
        "grpo against dr_grpo in training, seeds 0–2": f"in the raw gap is {_fixed(gap['mean'], 3, sign=True)} ± "
                                                       f"{_fixed(gap['standard_error'], 3)} on seeds 0–2 (interval "
                                                       f"{_fixed(gap['ci95'][0], 3, sign=True)} to "
                                                       f"{_fixed(gap['ci95'][1], 3, sign=True)};",
        "the stop rates in training, seeds 0–2": f"({_fixed(stop['mean'], 3, sign=True)}, "
                                                 + _if(stop["positive"] == len(stop["seeds"]), "all three positive")
                                                 + f", interval {_fixed(stop['ci95'][0], 3, sign=True)} to "
                                                 f"{_fixed(stop['ci95'][1], 3, sign=True)};",
        "the lengths in training, seeds 0–2": f"(on seeds 0–2 {length('grpo', 'start')} → {length('grpo', 'end')} "
                                              f"under `\"grpo\"`, {length('control', 'start')} → "
                                              f"{length('control', 'end')} under the control;",
        "grpo's push over the control's": f"to {_fixed(primary['mean'] / control['mean'], 1)} times the control's push",
        "dapo": _if(not any(figures["paired_all"]["dapo"]["seeds"]), "`\"dapo\"` − `\"dr_grpo\"` is 0 exactly"),
        "the control on the raw gap": f"the control on the raw gap is {_fixed(raw_control[0], 4, sign=True)} to "
                                      f"{_fixed(raw_control[1], 4, sign=True)} on seeds {measured}, "
                                      + _if(raw_control[0] < 0 < raw_control[1], "not detected"),
        "grpo against dr_grpo in training": _if(training_gap[0] < 0 < training_gap[1], "every interval across 0"),
        "the control in training": _if(not control["training_detected"],
                                       "The control is not detected in training either"),
        "right and wrong lengths": _if(all(abs(wrong - right) <= 1 for wrong, right in ends),
                                       "right and wrong answers stay within about a token of each other"),
        "the training runs": f"in the drift of a {settings['steps']}-step run with lengths of 3 to "
                             f"{settings['max_new_tokens']} tokens",
    }


def policy_shift_claims() -> dict:
    """Section 4, "The policy shift, through hooks": what to look for."""
    ablation, shift = _lab()["layer_ablation"], _lab()["policy_shift"]
    by_role = shift["right_answer_log_ratio_by_role"]
    blocks = range(len(ablation["without"]))
    gains = [_minus(only, ablation["none"]) for only in ablation["only"]]
    before, after = shift["operand_attention_by_layer_before"], shift["operand_attention_by_layer_after"]
    rise = [_minus(a, b) for a, b in zip(after, before)]
    most = sorted(sorted(blocks, key=lambda b: rise[b])[-2:])  # the two blocks whose share rose most
    least = min(blocks, key=lambda b: rise[b])
    shares_before, shares_after = shift["attention_shares_before"], shift["attention_shares_after"]
    others_fell = all(shares_after[k] < shares_before[k] for k in shares_before if not k.endswith("operand"))

    def moved(b: int) -> str:
        return f"{_pct(before[b])} → {_pct(after[b])}"

    def log_ratio(role: str) -> str:
        return _fixed(by_role[role], 2, sign=True)

    return {
        "the runs": f"{ablation['steps']} GRPO steps take the held-out accuracy from {_pct(ablation['none'])} (the "
                    f"base, \"none\") to {_pct(ablation['all'])} ± {_pct(ablation['std']['all'])} (\"all\"; "
                    f"{_and(_pct(a) for a in ablation['per_seed']['all'])} by seed)",
        "the digits": f"the mean log-ratio is {log_ratio('units')} nats on the units digit and {log_ratio('tens')} on "
                      f"the tens, but {log_ratio('hundreds')} on the hundreds digit (always a 1) and "
                      f"{_fixed(by_role['EOS'], 2)} on the EOS",
        "right and wrong answers' tokens": f"the tokens of right answers average "
                                           f"{_fixed(shift['log_ratio_right_tokens'], 2, sign=True)} nats and those of "
                                           f"wrong ones {_fixed(shift['log_ratio_wrong_tokens'], 2, sign=True)}",
        "without block 0": f"Without block 0's adapter the accuracy falls to {_pct(ablation['without'][0])} ± "
                           f"{_pct(ablation['std']['without'][0])}",
        "without the others": f"without block {_listed(blocks[1:-1])} or {blocks[-1]}, to "
                              f"{_and(_pct(a) for a in ablation['without'][1:])}",
        "each block alone": f"Alone, block 0's adapter reaches {_pct(ablation['only'][0])} ± "
                            f"{_pct(ablation['std']['only'][0])}, blocks 1 and 2 about "
                            f"{_pct(statistics.fmean(ablation['only'][1:3]), 0)}, and block 3's falls *below* the "
                            f"base ({_pct(ablation['only'][3])}, "
                            + _if(all(seed[3] < ablation["none"] for seed in ablation["per_seed"]["only"]),
                                  "in every seed") + ")",
        "the gains": f"The gains of the blocks alone add up to {_pts(sum(gains), sign=True)} points, the gain of all "
                     f"of them together is {_pts(_minus(ablation['all'], ablation['none']), sign=True)}",
        "attention on the operands": f"rises from {_pct(shift['operand_attention_before'])} to "
                                     f"{_pct(shift['operand_attention_after'])} "
                                     f"({_and(_pct(a) for a in shift['operand_attention_after_per_seed'])} by seed)"
                                     + _if(others_fell, ", a little from each other kind of key"),
        "by block": f"most in blocks {_and(most)} ({_listed(moved(b) for b in most)}), hardly in block {least} "
                    f"({moved(least)})",
    }


def off_policy_claims() -> dict:
    """Section 5, "On- and off-policy": the experiment and what to look for."""
    figures = _lab()["off_policy"]
    seeds, settings, exact_settings = figures["seeds"], figures["sweep_settings"], figures["exact_settings"]
    cells = {(e["lag"], e["correction"]): e for e in figures["sweep"]}  # the sweep, by lag and correction
    corrections = list(dict.fromkeys(c for _, c in cells))  # "none" first
    lags = sorted({lag for lag, _ in cells})
    late, last = lags[1:], lags[-1]  # the lags behind the trainer
    paired = {(p["lag"], p["a"], p["b"]): p for p in figures["paired"]}
    exact = {e["correction"]: e for e in figures["exact"]}  # the exact comparison, by correction
    gaps, n = exact_settings["gaps"], exact_settings["sample_sizes"]
    cap1, cap2, cap5 = caps = [c for c in corrections if c.startswith("tis_token_cap")]
    cap_of = {c: format(exact[c]["cap"], "g") for c in caps}
    assert list(cap_of.values()) == ["1", "2", "5"], "the sentences below name the caps 1, 2 and 5"
    weights = caps + ["tis_token_uncapped"]  # the per-token weights
    mask, old = "sequence_mask_cap3", "sampler_as_old"

    # the exact comparison
    def cosines(c: str) -> list[float]:  # each seed's cosine with the on-policy gradient at the largest gap
        return exact[c]["per_seed"]["cosine"]

    def away(c: str) -> int:  # the seed in which a correction's expected gradient points away (cosine < 0)
        negative = [seeds[i] for i, x in enumerate(cosines(c)) if x < 0]
        return negative[0] if len(negative) == 1 else f"(not one seed: {negative})"

    def closer(a: str, b: str) -> list[int]:  # the seeds in which correction a came closer than b
        return [s for s, x, y in zip(seeds, cosines(a), cosines(b)) if x > y]

    def on_policy(c: str, i: int) -> str:  # N samples' cosine with the on-policy gradient (N = n[i])
        return _fixed(exact[c]["noise"]["cosine_on_policy"][i], 2)

    at_first_gap = [(round(x, 2), c, s) for c, e in exact.items()  # (cosine, correction, seed) at the smallest gap
                    for s, x in zip(seeds, e["by_gap"][0]["cosine_per_seed"])]
    lowest = {(c, s) for x, c, s in at_first_gap if x == min(at_first_gap)[0]}
    ratio = exact["sequence_ratio"]
    ratio_cosines = [x for g in ratio["by_gap"] for x in g["cosine_per_seed"]]
    ratio_norms = ratio["per_seed"]["norm_ratio"] + [g["norm_ratio"] for g in ratio["by_gap"]]
    reached = all(abs(r - g) <= 0.03 * g for g, rs in zip(gaps, exact_settings["gaps_reached"]) for r in rs)
    as_the_sweep = [_fixed(cells[lag, "none"]["gap_mean"], 2) for lag in late] == [_fixed(g, 2) for g in gaps]
    cap5_not_closer = [s for s in seeds if s not in closer(cap5, cap2)]
    old_seed = seeds.index(away(old))
    old_first_away = next(g for g in exact[old]["by_gap"] if g["cosine_per_seed"][old_seed] < 0)
    against_range = figures["exact_sampler_as_old"][-1]  # the clip against the sampler, at the largest gap
    by_n = [exact[c]["noise"]["cosine_on_policy"][0] for c in weights]

    # the clip, and the sampler against the trainer
    clip, rewards, gap = figures["clip_fraction"], figures["reward_end"], figures["gap"]
    stale, bf16 = gap[f"lean, {figures['gap_lag']} steps stale"], gap["lean bfloat16"]

    def iterations_against_one(k: str) -> tuple[str, bool]:  # the reward with k iterations minus with 1, by seed
        differences = [_minus(a, b) for a, b in zip(rewards[k]["per_seed"], rewards["1"]["per_seed"])]
        error = statistics.stdev(differences) / math.sqrt(len(differences))
        # the mean of the differences is the difference of the means; taken from the stored means, which the JSON
        # rounds once (4 minus 1: −0.0295), not from the per-seed values, rounded three times (−0.02947)
        mean = _minus(rewards[k]["mean"], rewards["1"]["mean"])
        return f"{_fixed(mean, 3, sign=True)} ± {_fixed(error, 3)}", abs(mean) > T_2 * error

    (two, two_resolved), (four, four_resolved) = iterations_against_one("2"), iterations_against_one("4")

    # the sweep
    def resolved(c: str, against: str = "minus_none") -> list[int]:  # the lags at which a difference is resolved
        return [lag for lag in late if cells[lag, c][against]["resolved"]]

    def unresolved(c: str, against: str = "minus_none") -> list[int]:
        return [lag for lag in late if lag not in resolved(c, against)]

    def pair(lag: int, a: str, b: str) -> str:
        return _mp(paired[lag, a, b])

    def lead(b: str) -> list[int]:  # the lags at which the sampler as old's lead over b is resolved
        return [lag for lag in late if paired[lag, old, b]["resolved"]]

    def below(c: str) -> str:  # how far a correction stayed below the on-policy run at the largest lag, unsigned
        return _mp(cells[last, c]["minus_on_policy"]).removeprefix("−")

    binomial = math.sqrt(0.5 * 0.5 / settings["held_out"])  # one evaluation's standard error at 50% accuracy
    none_aucs = [cells[lag, "none"]["auc"] for lag in lags]
    distances = _listed(_fixed(cells[lag, "none"]["gap_mean"], 3) for lag in late)
    lag0 = [cells[0, c]["auc_per_seed"] for c in corrections]
    every_lag = [c for c in corrections[1:] if resolved(c) == late]
    helped = all(d > 0 for lag in late for c in corrections[1:] for d in cells[lag, c]["auc_minus_none"])
    means_rose = all(cells[lag, cap1]["auc"] < cells[lag, cap2]["auc"] < cells[lag, cap5]["auc"] for lag in late)
    caps_resolved = any(paired[lag, a, b]["resolved"] for lag in late for a, b in ((cap2, cap1), (cap5, cap2),
                                                                                    (cap5, cap1)))
    old_highest = all(cells[lag, old]["auc_per_seed"][i] > cells[lag, c]["auc_per_seed"][i]
                      for lag in late for c in corrections if c != old for i in range(len(seeds)))
    return {
        # the experiment
        "the samplers' gaps": f"is {_listed(_fixed(g, 2) for g in gaps[:-1])} or {_fixed(gaps[-1], 2)} "
                              + _if(reached, "(reached to within 3%)")
                              + _if(as_the_sweep, f", about what the uncorrected sweep below saw at lags {_and(late)}"),
        # exactly
        "the sequence ratio": f"at every gap and in every seed: cosine {_every(ratio_cosines, 4)}, norm ratio "
                              f"{_every(ratio_norms, 4)}",
        "the smallest gap": f"At a mean |log-ratio| of {_fixed(gaps[0], 2)} per token (the uncorrected sweep's lag "
                            f"{late[0]}) the cosines are {_to([x for x, _, _ in at_first_gap], 2)} "
                            + _if(lowest == {(old, seeds[-1]), ("none", seeds[-1])},
                                  f"(the lowest: the sampler as old and no correction, both in seed {seeds[-1]})"),
        "the largest gap": f"at {_fixed(gaps[-1], 2)} (lag {last}; a sequence-level KL(sampler‖π) of "
                           f"{_fixed(exact_settings['kl_sampler_policy'][-1], 2)} nats on average)",
        "no correction": f"no correction: {_listed(_fixed(x, 2) for x in cosines('none'))}, at "
                         f"{_and(_two_digits(r) for r in exact['none']['per_seed']['norm_ratio'])} times the "
                         f"on-policy gradient's norm: in seed {away('none')} it points away from it",
        "per-token TIS uncapped": f"(`tis_token_uncapped`): {_listed(map(_cosine, cosines('tis_token_uncapped')))}.",
        "per-token TIS capped": f"Capped at {_and(cap_of.values())}: "
                                + "; ".join(f"{_listed(_fixed(cosines(c)[i], 2) for c in caps)} (seed {s})"
                                            for i, s in enumerate(seeds)),
        "the caps seed by seed": _if(closer(cap2, cap1) == seeds and closer(cap5, cap1) == seeds,
                                     "Cap 2 came closer than cap 1 and cap 5 closer than cap 1 in every seed")
                                 + f", cap 5 than cap 2 in {WORDS[len(closer(cap5, cap2))]} "
                                   f"(seed {_and(cap5_not_closer)}: "
                                 + _and(_fixed(cosines(cap5)[seeds.index(s)], 3) for s in cap5_not_closer)
                                 + " against "
                                 + _and(_fixed(cosines(cap2)[seeds.index(s)], 3) for s in cap5_not_closer)
                                 + "); removing the cap went further away in seeds "
                                 + _and(closer(cap5, "tis_token_uncapped")),
        "TRL's sequence mask": f"TRL's sequence mask (cap {format(exact[mask]['cap'], 'g')}): "
                               f"{_listed(_fixed(x, 2) for x in cosines(mask))}; in seed {away(mask)} it points away "
                               f"from the on-policy gradient, at "
                               f"{_fixed(exact[mask]['per_seed']['norm_ratio'][seeds.index(away(mask))], 2)} of its "
                               "norm",
        # the chapter gives seed 0's norm ratio to two decimals, the others to one
        "the sampler as old": f"the sampler as old policy: {_listed(map(_cosine, cosines(old)))}, at "
                              f"{_fixed(exact[old]['per_seed']['norm_ratio'][0], 2)}, "
                              f"{_and(_fixed(r, 1) for r in exact[old]['per_seed']['norm_ratio'][1:])} times the norm; "
                              f"in seed {away(old)} it points away already at a gap of "
                              f"{_fixed(old_first_away['gap'], 2)} "
                              f"({_fixed(old_first_away['cosine_per_seed'][old_seed], 2)})",
        "the clip against the sampler": f"{_pct(against_range['above_with_negative_advantage'])} of the sampler's "
                                        "tokens (the mean over seeds) were above the range with a negative advantage, "
                                        f"with ratios up to about {round(against_range['max_ratio_above'], -3):,.0f}",
        "their part of the gradient": f"their part of the expected gradient had "
                                      f"{_fixed(against_range['above_part_norm'], 2)} of its norm",
        "the same in the sweep": f"at lag {last}, {_pct(cells[last, old]['above_against'])} of the tokens of the "
                                 "`sampler_as_old` runs were above the range",
        "N samples": f"At the largest gap, from N = {n[-1]} completions, the gradient's cosine with the on-policy one "
                     f"is {on_policy('sequence_ratio', -1)} for the sequence ratio, "
                     f"{_to([exact[c]['noise']['cosine_on_policy'][-1] for c in weights], 2)} for the per-token "
                     f"weights (capped or not) and "
                     f"{_fixed(figures['exact_on_policy_noise']['cosine_on_policy'][-1], 2)} for {n[-1]} samples of "
                     f"the policy itself, but about {_fixed(exact['none']['noise']['cosine_on_policy'][-1], 1)} with "
                     f"no correction, {on_policy(mask, -1)} for the sequence mask and {on_policy(old, -1)} for the "
                     f"sampler as old, though the first and the last are within cosine "
                     f"{_fixed(exact['none']['noise']['cosine_own'][-1], 2)} and "
                     f"{_fixed(exact[old]['noise']['cosine_own'][-1], 2)} of their own expectations",
        "fewer samples": _if(by_n == sorted(by_n, reverse=True), "the lower the cap, the closer")
                         + f" (N = {n[0]}: " + _listed(f"{on_policy(c, 0)} for cap {cap_of[c]}" for c in caps)
                         + f", {on_policy('tis_token_uncapped', 0)} uncapped, {on_policy('sequence_ratio', 0)} for "
                           "the sequence ratio)",
        # the clip
        "the clip fraction": _if(not any(clip["1"]["per_seed"]),
                                 "the clip fraction is exactly 0 at every step of every seed")
                             + f": the ratio is 1. With 2 it averages {_pct(clip['2']['mean'])} of the tokens "
                               f"({_pct_to(clip['2']['per_seed'], 1)} over the three seeds), with 4 "
                               f"{_pct(clip['4']['mean'])} ({_pct_to(clip['4']['per_seed'], 1)})",
        "the reward": _if(max(rewards["2"]["mean"], rewards["4"]["mean"]) <= rewards["1"]["mean"],
                          "the extra updates did not raise the reward")
                      + f": {_and(_fixed(rewards[k]['mean'], 2) for k in ('1', '2', '4'))}",
        "the reward, paired": f"2 minus 1 iteration is {two} (standard error over the seeds) and 4 minus 1 {four}, "
                              + _if(not two_resolved and not four_resolved, "neither resolved"),
        # the sampler against the trainer
        "float32 samplers": f"within {_sci(gap['lean float32']['max'])} and {_sci(gap['bridge float32']['max'])} of "
                            f"the trainer's (means {_sci(gap['lean float32']['mean'], 0)} and "
                            f"{_sci(gap['bridge float32']['mean'], 0)})",
        "bfloat16": f"bfloat16 is off by {_fixed(bf16['mean'], 3)} on average and {bf16['max']:g} at worst, a "
                    f"probability {_pct(math.exp(bf16['max']) - 1, 0)} off",
        "stale weights": f"Weights {figures['gap_lag']} steps stale: {_fixed(stale['mean'], 2)} on average and "
                         f"{stale['max']:g} at worst, a factor of {_fixed(math.exp(stale['max']), 1)}",
        "the lag-0 runs": _if(all(a == lag0[0] for a in lag0), "the same AUC in every seed")
                          + f" ({_listed(f'{a:.4f}' for a in lag0[0])})",
        # the sweep
        "one evaluation's noise": f"One evaluation of {settings['held_out']} additions near 50% accuracy has a "
                                  f"binomial standard error of about {_fixed(binomial, 3)}; the AUC combines "
                                  f"{settings['steps'] // settings['eval_every'] + 1} evaluations of a run",
        "uncorrected": f"over the {settings['steps']} steps) fell from {_fixed(none_aucs[0], 3)} on-policy "
                       f"({_to(cells[0, 'none']['auc_per_seed'], 3)} over the three seeds) to "
                       + _and([f"{_fixed(none_aucs[1], 3)} at lag {late[0]}"]
                              + [f"{_fixed(a, 3)} at {lag}" for lag, a in zip(late[1:], none_aucs[2:])]),
        "uncorrected against on-policy": "Paired with the on-policy run: "
                                         + _listed(f"{_mp(cells[lag, 'none']['minus_on_policy'])} at "
                                                   + ("lag " if lag == late[0] else "") + str(lag) for lag in late)
                                         + ", " + _if(resolved("none", "minus_on_policy") == late, "each resolved"),
        "the sampler's distance": f"grew with it ({distances})",
        "every correction helped": _if(helped, f"every correction raised the AUC at every lag from {late[0]} to "
                                               f"{last} in every seed"),
        "resolved at every lag": "Resolved: TIS with "
                                 + " and ".join(f"cap {cap_of[c]}" for c in every_lag if c in caps)
                                 + _if(old in every_lag, " and the sampler as old")
                                 + f" at every lag (at lag {last}: "
                                 + _listed(_mp(cells[last, c]["minus_none"]) for c in every_lag) + ")",
        "TRL's mask and cap 1": f"TRL's sequence mask at lags {_and(resolved(mask))} "
                                f"({_mp(cells[last, mask]['minus_none'])} at {last}), not at {_and(unresolved(mask))} ("
                                + _listed(_mp(cells[lag, mask]["minus_none"]) for lag in unresolved(mask))
                                + f"); cap 1 only at lag {_and(resolved(cap1))} ("
                                + _listed(_mp(cells[lag, cap1]["minus_none"]) for lag in resolved(cap1)) + ")",
        "the caps": _if(means_rose, "The means rose with the cap at every lag") + ", but "
                    + _if(not caps_resolved, "no difference between caps is resolved")
                    + f": cap 5 minus cap 2 is {pair(late[0], cap5, cap2)} at lag {late[0]} "
                      f"({_fixed(cells[late[0], cap5]['auc'], 3)} against {_fixed(cells[late[0], cap2]['auc'], 3)}), "
                    + _and(f"{pair(lag, cap5, cap2)} at {lag}" for lag in late[1:])
                    + f"; cap 2 minus cap 1 from {pair(late[0], cap2, cap1)} (lag {late[0]}) to "
                      f"{pair(last, cap2, cap1)} (lag {last})",
        "the mask against cap 5": _if(not any(paired[lag, mask, cap5]["resolved"] for lag in late), "Nor is")
                                  + f" the sequence mask against cap 5 ({pair(late[0], mask, cap5)} at lag {late[0]} "
                                    f"to {pair(last, mask, cap5)} at lag {last}); it masked few completions "
                                    f"({_pct(cells[last, mask]['sequences_over_3'])} at lag {last})",
        "back to on-policy": f"At lag {last} the weighted corrections stayed below the on-policy run in the means: "
                             f"cap 5 by {below(cap5)} and cap 2 by {below(cap2)} ("
                             + _if(not resolved(cap5, "minus_on_policy") and not resolved(cap2, "minus_on_policy"),
                                   "not resolved")
                             + f"), the sequence mask by {below(mask)} ("
                             + _if(cells[last, mask]["minus_on_policy"]["resolved"], "resolved")
                             + f"); cap 1 was below it at lags {_and(resolved(cap1, 'minus_on_policy'))} (resolved: "
                             + _listed(_mp(cells[lag, cap1]["minus_on_policy"])
                                       for lag in resolved(cap1, "minus_on_policy")) + ")",
        "the sampler as old, the highest": _if(old_highest, f"`sampler_as_old` had the highest AUC of the six at "
                                                            f"every lag from {late[0]} to {last} in every seed")
                                           + f" ({_and(_fixed(cells[lag, old]['auc'], 3) for lag in late)} at lags "
                                             f"{_and(late)})",
        "its lead": f"Resolved: its lead over cap 5 at lags {_and(lead(cap5))} ("
                    + _listed(pair(lag, old, cap5) for lag in lead(cap5)) + "), not at "
                    + _and(lag for lag in late if lag not in lead(cap5)) + " ("
                    + _listed(pair(lag, old, cap5) for lag in late if lag not in lead(cap5))
                    + f"); over the sequence mask at lags {_and(lead(mask))} ("
                    + _listed(pair(lag, old, mask) for lag in lead(mask)) + "), not at "
                    + _and(lag for lag in late if lag not in lead(mask)),
        "the sampler as old against on-policy": "Against the on-policy run: "
                                                + _and(_mp(cells[lag, old]["minus_on_policy"]) for lag in late)
                                                + f" at lags {_and(late)}, "
                                                + _if(not resolved(old, "minus_on_policy"), "none resolved"),
        "its distance to its sampler": f"a mean |log-ratio| of {_fixed(cells[last, old]['gap_mean'], 3)} per token at "
                                       f"lag {last}, against {_fixed(cells[last, 'none']['gap_mean'], 3)} uncorrected",
        "the bfloat16 gap against the stale one": _if(bf16["max"] < stale["max"] / 10
                                                      and bf16["mean"] < stale["mean"] / 10,
                                                      f"is less than a tenth of the {figures['gap_lag']}-step-stale "
                                                      "one's"),
    }


def summary_claims() -> dict:
    """"What to take away": the closing summary, section by section."""
    lab = _lab()
    kl, h, lb, op = lab["kl_gradients"], lab["hacking"], lab["length_bias"], lab["off_policy"]
    ablation, by_role = lab["layer_ablation"], lab["policy_shift"]["right_answer_log_ratio_by_role"]
    k3 = kl["k3_loss"]
    best, peak, fall = h["best_of_n"], h["best_of_n_peak"], h["best_of_n_fall"]
    unleashed, leashed, tight = h["beta_sweep"]  # beta 0, 0.5, 2
    leash = _leash()["leash"]
    means = [m["mean"] for m in leash["matched_kl"]]
    above_best = [m["versus_best"]["mean"] for m in leash["matched_kl"] if m["versus_best"]["ci95"][0] > 0]
    learning_rates = {m["lr"] for m in leash["matched_kl"]}
    most = min(range(len(ablation["without"])), key=lambda b: ablation["without"][b])  # the block that matters most
    cells = {(e["lag"], e["correction"]): e for e in op["sweep"]}
    corrections = list(dict.fromkeys(c for _, c in cells))
    last = max(lag for lag, _ in cells)
    exact = {e["correction"]: e for e in op["exact"]}
    weights = [c for c in exact if c.startswith("tis_token")]  # the per-token weights, capped or not
    weight_cosines = [x for c in weights for x in exact[c]["per_seed"]["cosine"]]
    every_lag = [c for c in corrections[1:] if all(e["minus_none"]["resolved"] for (lag, k), e in cells.items()
                                                     if k == c and lag > 0)]
    caps = [c.removeprefix("tis_token_cap") for c in every_lag if c.startswith("tis_token_cap")]
    clip, gap = op["clip_fraction"], op["gap"]
    stale = gap[f"lean, {op['gap_lag']} steps stale"]
    away = [c for c in ("none", "sequence_mask_cap3", "sampler_as_old")
            if sum(x < 0 for x in exact[c]["per_seed"]["cosine"]) == 1]

    def beta(b: dict) -> str:
        return f"`beta` {b['beta']:g}"

    return {
        # section 1
        "k3's cosine": f"At {_fixed(kl['reverse_kl']['mean'], 0)} nats from the reference its cosine with the "
                       f"reverse-KL gradient was {_fixed(k3['cosine_reverse'], 2)} "
                       f"({_to(k3['per_seed']['cosine_reverse'], 2)} over {len(lab['seeds'])} seeds), at "
                       f"{_fixed(k3['norm_ratio'], 2)} of its norm",
        "k2's cosine": f"(cosine {_fixed(kl['k2_loss']['cosine_reverse'], 2)} here)",
        "the exact per-token KL from one sample": "from one sample is already within cosine "
                                                  f"{_fixed(kl['noise']['exact_token_loss']['cosine_own'][0], 2)} of "
                                                  "its expectation",
        # section 2
        "best-of-n": f"Best-of-n against a reward model that ranks "
                     f"{_hyphen(_pct_span(h['reward_model']['held_out_accuracy']))} of held-out pairs right "
                     + _if(peak["gold"] >= 2 * best[0]["gold"], "doubled gold")
                     + f" ({_pct(best[0]['gold'])} to {_pct(peak['gold'])} at n = {peak['n']}), then lost "
                       f"{_pm(fall['diff'], fall['se'])} points of it by n = {fall['low_n']}",
        "best-of-n's KL": f"({_fixed(best[-1]['kl'], 2)} nats against {_fixed(best[-1]['kl_formula'], 2)} at "
                          f"n = {best[-1]['n']})",
        "the buggy verifier": f"took the buggy reward to {_pct(h['buggy_verifier']['buggy_end'], 0)}, the gold score "
                              f"to {h['buggy_verifier']['gold_end']:g}",
        "beta": f"{beta(unleashed)} ran past the peak (KL {_fixed(unleashed['kl'], 2)} nats, gold "
                f"{_pct(unleashed['gold'], 0)}), {beta(tight)} held the policy so close that it climbed less (KL "
                f"{_fixed(tight['kl'], 2)}, gold {_pct(tight['gold'], 0)}), and {beta(leashed)} ended at KL "
                f"{_fixed(leashed['kl'], 2)} with gold {_pct(leashed['gold'], 0)}",
        "matched KL": f"Over {len(leash['seeds'])} seeds, at matched KL, with the KL term in the loss or in the "
                      f"reward and at {WORDS[len(learning_rates)]} learning rates, the penalised runs ended "
                      f"{_pts(min(means))} to {_pts(max(means))} points above (the eight settings' means)",
        "against the best at that KL": f"and {_pts(min(above_best))} to {_pts(max(above_best))} points above the best "
                                       f"it showed at that KL or less in {WORDS[len(above_best)]} settings",
        # section 3
        "the one update": f"on the same {lb['settings']['push_completions']} completions pushes",
        "the primary result": f"({_fixed(lb['paired']['mean'], 4, sign=True)} and",
        # section 4
        "the digits": f"({_every([by_role['units'], by_role['tens']], 1, sign=True)} nats each on right answers)",
        "the block that matters": f"Block {most}'s adapter carries most of the gain (without it, "
                                  f"{_pct(ablation['without'][most])} instead of {_pct(ablation['all'])})",
        # section 5
        "the clip": _if(not any(clip["1"]["per_seed"]),
                        "With `num_iterations` 1 the ratio is exactly 1 and the clip fraction 0")
                    + f"; with 2 and 4, {_pct(clip['2']['mean'])} and {_pct(clip['4']['mean'])} of the tokens are "
                      f"clipped ({len(op['seeds'])} seeds)",
        "the sampler": f"Our lean decoder matches the trainer to {_sci(gap['lean float32']['max'])} in log-prob; in "
                       f"bfloat16 it is {gap['lean bfloat16']['max']:g} off at worst, and weights {op['gap_lag']} "
                       f"steps stale {stale['max']:g}",
        "the lag": f"from {_fixed(cells[0, 'none']['auc'], 3)} on-policy to {_fixed(cells[last, 'none']['auc'], 3)} "
                   f"at {last} steps (paired: {_mp(cells[last, 'none']['minus_on_policy'])}, {len(op['seeds'])} seeds)",
        "the corrections": f"TIS with cap {' or '.join(caps)}"
                           + _if("sampler_as_old" in every_lag,
                                 " and the sampler as PPO's old policy resolved at every lag"),
        "the sampler as old": f"every lag ({_mp(cells[last, 'sampler_as_old']['minus_on_policy'])} at lag {last})",
        "the per-token weights' cosines": f"at lag {last}'s gap their cosines with the on-policy gradient were "
                                          f"{_close(min(weight_cosines))} to {_close(max(weight_cosines))}",
        "each pointed away in one seed": _if(len(away) == 3, "no correction, TRL's mask and the clip against the "
                                                             "sampler each pointed away from it in one seed"),
    }


CLAIMS = (kl_gradients_claims, hacking_claims, length_bias_claims, policy_shift_claims, off_policy_claims,
          summary_claims)


# --- numbers no stored file holds -----------------------------------------------------------------------------------

# {the phrase as the chapter has it: where it comes from}. An entry whose reason starts "disagrees with lab.json" is a
# number that docs/figures/lab.json, the default run's output, gives otherwise.
NOT_STORED = {
    # the introduction
    "(5 to 9 minutes on 2 CPU cores, by the machine; at most 10)":
        "the range of the two timed runs docs/lab.md quotes (4 min 45 s of wall time for the stored run, 543 s for an "
        "earlier one on another machine), and the lab's budget",
    # KL gradients
    "about 90 likely ones": "how many second operands are likely after `a+` is not stored",
    "already 0.69 of the reverse-KL gradient's on seed 2, and it is back to 0.995 only at 0.003 of the scale (KL 8e-7)":
        "the scale sweep's norm ratios, and its scales below 0.1, are not stored (scale_sweep keeps the cosines)",
    # reward hacking
    "already ranks about 80% of pairs right": "the untrained likelihood's accuracy on the pairs is not stored",
    "holds 10 to 48 distinct ones (21 on average, the commonest about 37% of the pool; seeds 0, 1, 2)":
        "the pools' statistics are not stored",
    "a standard error of 0.04": "arithmetic: √(p(1 − p)/128) at gold ≈ 0.25, not a figure of the run",
    "is about 0.015": "the design's estimate; the stored runs' standard errors of such differences, 0.006 to 0.016, "
                      "are checked in the hacking section",
    "about 3 minutes on 2 cores": "the wall time of `--rm-pairs-per-prompt 1 2 4`, rounded (lab_rm_sweep.json's "
                                  "rm_sizes_seconds, 148.3, is the run's own clock)",
    # length bias
    "in about 98% of samples (lengths 3 and 4 tokens)": "the lengths of the additions' answers are not stored",
    "against about 15 when the answer goes on": "the length of an answer that goes on past its first sentence is not "
                                                "stored",
    "have a cosine between −0.57 and +0.65": "the cosine of the two read-outs' gradients is not stored",
    "+0.0017 ± 0.0002 (+0.0012 to +0.0023) on seeds 10–19": "`--only length_bias` from seed 10 (not stored)",
    "+0.0045 ± 0.0007 (+0.0029 to +0.0060) on seeds 10–19, 20 of 20 seeds positive":
        "`--only length_bias` from seed 10 (not stored); seeds 0–9's 10 of 10 are lab.json's",
    "2.6 to 2.8 times": "2.6 is seeds 10–19's ratio (not stored); seeds 0–9's 2.8 is checked",
    "gave +0.015 / −0.001 on one / two threads": "an earlier run's training, on another machine (not stored)",
    "+0.19 / −0.005 on seeds 10–12": "the training runs from seed 10, on 1 and on 2 threads (not stored)",
    "the earlier run +0.027 / +0.032": "an earlier run's training, on another machine (not stored)",
    "and not on seeds 10–12 (+0.008 / −0.003)": "the training runs from seed 10, on 1 and on 2 threads (not stored)",
    "13.4 → 17.3 under `\"grpo\"` on seeds 10–12": "the training runs from seed 10 (not stored)",
    "in about 8 minutes": "an estimate from its parts; LengthBiasConfig.long() was not run whole",
    # the policy shift
    "for 57+85 the wrong 141 gained +0.9 nats on its last digit, more than the right 142 (+0.4)":
        "the heatmaps' samples (seed 0) are not stored",
    # on- and off-policy
    "every ratio 1 to about 1e-6": "the run that trained the lag-0 cell once per correction (not stored)",
    "with weights and ratios of 1 to about 1e-6": "the same run (not stored)",
    "about 113,000 (seed 2)": "which seed had the largest ratio is not stored (the ratio, 112,600, is checked)",
    "(0.47 to 0.65 by seed)": "exact_sampler_as_old keeps the mean over seeds only",
    "below the 0.437 the model starts from": "the base model's accuracy on the sweep's 135 additions is not stored",
    # the summary: the one update's second set of seeds
    "in 20 of 20 seeds": "seeds 0–9 (lab.json: 10 of 10) and seeds 10–19 (not stored)",
    "+0.0045 on two sets of 10, intervals above 0": "`--only length_bias` from seed 10 (not stored)",
}

# Numbers that are not results: seed lists, run settings, sizes, formulas and their constants, papers, dates and
# software versions, and the chapter's references to its own parts.
SETTINGS = (
    "and 30 steps of sampling",
    # the introduction
    "# Part 6 — The lab", "its vocabulary has 356 tokens and its answers", "1. **KL gradients, exactly.**",
    "2. **Reward hacking, and the leash.**", "3. **Length bias, measured.**", "4. **The policy shift, through hooks.**",
    "5. **On- and off-policy.**", "the GPT-2-style one",
    "Part 3's GRPO needs a LoRA on all seven of its projections, 200 steps and a lower learning rate to gain on it "
    "what the GPT-2-style model gains in 150",
    # 1. KL gradients
    "## 1. KL gradients, exactly", "Part 3's GRPO adds `beta * k3`",
    "as TRL's GRPO did by default before 1.10 (TRL 1.16's default multiplies",
    "from the **reward** (Part 5), as TRL's PPO trainer did too (TRL 1.0 to 1.12; TRL 1.16 has none); Part 1's PPO",
    "The tiny model's vocabulary has 356 tokens, so a prompt has 356² = 126,736 two-token completions, and **one** "
    "batched forward pass of 356 rows",
    "a rank-4 LoRA on `q` and `v` (Part 2) whose",
    "(Tang & Munos 2025, *On a few pitfalls in KL divergence gradient estimation for RL*, arXiv:2506.09477;",
    r"$\sum_a \pi(a)\nabla\log\pi(a) = \nabla\sum_a\pi(a) = 0$",
    r"expected gradient $\sum_y \pi(y)\nabla\log\pi(y) = 0$",
    r"($\frac{\text{ref}}{\pi} - 1 - \log\frac{\text{ref}}{\pi}$ per token: Part 3's `beta` term",
    r"\mathbb{E}_{a\sim\pi}[(1 - \frac{\text{ref}(a)}{\pi(a)}", r"($\frac12\log^2", "TRL 1.16's default `beta` term",
    "predict token $t + 1$: the prompt's last position (index -2 of a row) predicts the first token, the same in "
    "every row; the last position (-1) predicts the second",
    "(Schulman, *Approximating KL divergence*, 2020): $k_1 = r$, $k_2 = r^2/2$, $k_3 = e^{-r} - 1 + r$",
    "Token 1 of row $i$", "the exact KLs over all 126,736 completions",
    "1. `B` is scaled until KL(π‖ref) = 2 nats per sequence",
    "every cosine would be 1; 2. at 0.1, 0.25, 0.5, 1 and 1.5 times that scale", "3. at the main scale, the gradient",
    "N = 1 ... 1024, 6 repeats each", "--only kl_gradients`, seeds 0, 1, 2, at KL(π‖ref) = 2 nats per sequence)",
    "k3 in the loss (Part 3's `beta` term) is not", "So `beta` on k3 alone (Part 3, and TRL with",
    "(Part 1's PPO term)", "(Means over 6 repeats and 3 seeds; the bands",
    # 2. reward hacking
    "## 2. Reward hacking, live, and the leash",
    'Gao, Schulman & Hilton (2022, "Scaling Laws for Reward Model Overoptimization", fig. 1)',
    "the exact verifier (Part 3's `reward_exact_answer`), so we can watch",
    "1. **Pairs.** The tiny model answers additions from the training split, 8 samples each at temperature 1;",
    "2. **The reward model.**",
    "(Bradley & Terry 1952; the reward-model loss of InstructGPT, Ouyang et al. 2022, eq. 1, and of TRL's",
    "3. **Best-of-n against it**", "from a pool of 256 samples per prompt",
    r"$\mathrm{KL} = \log n - (n-1)/n$ (Gao et al. 2022, section 2)",
    "A small model repeats itself: a pool of 256 answers", "(Beirami et al. 2024, arXiv:2401.01879)",
    "4. **GRPO against it**, Part 3's trainer", "logged with weight 0;", "5. **The proxy taken apart.**",
    "6. **A verifier with a bug**", "underflows to 0 (a margin of $-200$)", "like Part 5's preference pairs",
    "whose mask is 1 (refuse a row", '("68.", "68 is it")', "pairs from 300 training additions (",
    "a held-out set of pairs from 100 held-out additions; the reward model trains for 4 epochs (AdamW, lr 3e-4,",
    "best-of-n for n = 1, 2, 4, ..., 256 over a pool of 256 answers to each of 64 held-out additions",
    "the synthetic control at σ = 0.5, 1 and 2;",
    "GRPO against the reward model (8 prompts × 8 completions a step, up to 8 new tokens, a rank-4 LoRA, lr "
    "1.5e-3, 40 steps) at `beta` 0, 0.5 and 2, and against the head-only reward model (`beta` 0, 20 steps);",
    "GRPO against the buggy verifier (beta 0, lr 1e-2, 40 steps);",
    "every 4 steps, one completion of each of 128 held-out additions (temperature 1)", '(" 68", "068")',
    "Sampled alone, 128 completions would give gold", "Gao et al.'s fig. 1 varies",
    "--only hacking`, seeds 0, 1, 2; one and two torch threads", "the shape of Gao et al.'s fig. 1,",
    r"where $\log n - (n-1)/n$ says", "128 sampled completions give", "Here `beta` = 0.5 ended above",
    "these ± are over the 128 prompts of one run", "the unleashed run is seen every 4 steps only",
    "`beta` = 2 with k3 in the loss", "the strict verifier (Part 3's `reward_exact_answer`)",
    # 3. length bias
    "## 3. Length bias, measured Part 3's `grpo_loss`",
    'Liu et al. 2025 ("Understanding R1-Zero-Like Training: A Critical Perspective", section 3.1,', "the weight $1/L$",
    "DAPO (Yu et al. 2025)", "The additions of Part 3 cannot show", "after its 2 or 3 digits", "Part 1's sentences can",
    "before EOS: 3 to 24+ tokens",
    r'`"grpo"`: $1/(B L_i)$; `"bnpo"` and `"dapo"`: $1/\sum_i L_i$; `"dr_grpo"`: $1/(B \cdot$',
    "when it is None). 0 on padding, and 0 (not NaN) for a row or a batch with no real token, as `grpo_loss` gives "
    "0 there",
    "with every advantage $-1$", "every sequence weighs $1/B$",
    "each token of the 8-token completion weighs a quarter of what a token of the 2-token one does",
    "(a mean of nothing is not 0, and a 0 would draw a false point",
    r'with $c_i = 1/(B L_i)$ under `"grpo"` and $1/(B \cdot$', r"it is $\nabla E[1/L \mid w]$",
    "after a right word ($A > 0$) shorter, after a wrong one ($A < 0$) longer. The first lever of $1/L$",
    r"($L \approx 3$",
    "(1) The primary result, one update: from the starting policy, 512 completions (64 for each of the 8 prompts)",
    "a step of norm 1 along", "its mean, standard error and 95% t-interval over 10 seeds",
    "(at `lr` 1e-2, a step of norm about 0.64 over the 4,096 numbers of the `B` matrices, the only ones with a "
    "gradient while `B` = 0)",
    "over all 160 contexts",
    "(2) Training with shared random numbers: `\"grpo\"`, `\"dr_grpo\"` and the control, 30 steps of Part 3's "
    "`grpo_step` (4 prompts × 8 completions, up to 24 tokens, `lr` 1e-2, `beta` 0)",
    "paired (3 seeds). (3) A positive control",
    r"$r + \kappa(2r-1)\,3/L$ with $\kappa = 1$ (`length_term_reward`; 3 tokens is the shortest answer)",
    r"$\kappa(2r(w)-1)\nabla E[3/L \mid w]$",
    "--only length_bias`: seeds 0, 1, 2 trained and 0 to 9 measured by the one update; and the same from seeds 10, "
    "11, 12, so 10 to 19;",
    r"The known term ($\kappa = 1$, shape $3/L$)", "on seeds 0–9", "Three seeds (t(2) = 4.30", "$(2r-1)(1 - L/24)$",
    "The read-out was chosen on seeds 0–9; seeds 10–19 are the check", "After 30 steps,",
    "leans the predicted way on seeds 0–2", "Over 30 steps the mean lengths", "a nat per gradient step of norm 1",
    "so $1/L$ spans", "(20 seeds of 1,024 completions each, every configuration, 60 training steps)",
    # 4. the policy shift
    "## 4. The policy shift, through hooks", "because of how Part 2 built things", "1. **per token**:",
    "2. **per block**:", "3. **per head**:",
    "Part 3's `GRPOTrainer` with its defaults (a rank-4 LoRA on `q` and `v` in every block, 16 prompts × 8 "
    "completions a step), 60 steps per seed instead of 150",
    "and 0 after each completion's first EOS", "Part 0's `completion_logprobs`", "score the token at $t + 1$",
    "it would give 0 everywhere", "(Part 2's `make_adapters`)", "TransformerLens 4 exposes",
    "Rows after a completion's first EOS are 0", "train the policy (GRPO, 60 steps)",
    "sample 4 completions of 3 held-out prompts from it, score them with Part 3's `reward_exact_answer`",
    "the greedy accuracy on all 810 held-out additions",
    "the attention of the answer positions on 96 held-out additions", "--only policy_shift`, seeds 0, 1, 2;",
    "(its length, its leading 1)", "In the heatmaps (seed 0)", "(3 prompts per seed: a glimpse",
    "So whatever block 0's LoRA",
    # 5. on- and off-policy
    "## 5. On- and off-policy", r"leaves $[1-\epsilon,\ 1+\epsilon_\text{high}]$",
    "With `num_iterations` 1 (Part 3's default, and TRL's), \"old\" is the policy itself: the ratio is exactly 1",
    "With `num_iterations` 2 or 4 the same samples", "one that `num_iterations` 1 does not protect you from",
    "a lean GPT-2 of our own", 'Yao et al. 2025 ("Your Efficient RL Framework',
    'Liu, Li et al. 2025 ("When Speed Kills', "TRL 1.16's `GRPOTrainer` (when vLLM samples)",
    "when that is at most 3, and 0 when it is above", "no completion's weight exceeds 3",
    "(and Part 3's `GRPOTrainer.clip_ratios`)",
    r"ratio $< 1-\epsilon$ where the advantage is negative, or $> 1+\epsilon_\text{high}$ where",
    "a token whose advantage is 0 has none to take", "detached, and 0 on padding",
    r"Part 3's `grpo_loss` with $\beta = 0$", "or 0 on all of them when the ratio is above the cap",
    "section 1's trick answers exactly. Over the 356² two-token completions",
    r"\mathrm{clip}(r_t,\ 1-\epsilon,\ 1+\epsilon_\text{high})",
    r"none ($w = 1$, and old is $\pi_\theta$ detached, so $r_t = 1$", r"since $\sum_y \pi(y)\nabla\log\pi(y) = 0$",
    "in section 1's setting", "The reward is 1 on a random half of the 356² completions and 0 on the rest",
    "(N = 16, 128, 1024; 3 repeats)",
    "Then GRPO on Part 3's additions (8 prompts × 8 completions a step, a rank-4 LoRA on q and v, `lr` 3e-3)",
    "GRPO (Part 3's `grpo_step`) with `num_iterations` 1, 2 and 4", "the lean decoder with the LoRA of 4 steps before",
    "trail the trainer's by 0, 1, 2, 4 or 8 steps", "your TIS weights with $C$ = 1, 2 or 5",
    "TRL 1.16's sequence mask with $C = 3$", "Each run (24 steps, 8 prompts × 8 completions)",
    "greedy accuracy on 135 held-out additions at steps 0, 4, ..., 24; trapezoids, divided by the 24 steps",
    "At lag 0 the sampler's log-probs", "every weight is 1 and",
    "--only off_policy`, seeds 0, 1, 2; the same with 1 and 2 threads",
    r"has left $[1-\epsilon,\ 1+\epsilon_\text{high}]$", "(above the range with $A > 0$, below it with $A < 0$)",
    r"below $1-\epsilon$ with $A > 0$ its factor is at most $(1-\epsilon)A$, but above $1+\epsilon_\text{high}$ "
    "with $A < 0$",
    "(Ye et al. 2020, arXiv:1912.09729) bounds the objective of a token with $A < 0$", "for a constant $c > 1$",
    "(Means of 3 repeats in each of the 3 seeds.)", "With `num_iterations` 1 the clip fraction",
    "Over 16 steps the extra updates", "over the last 5 steps", "The lag-0 check held", "the six lag-0 runs",
    "trains lag 0 once", "a mean difference over the 3 seeds",
    "95% t-interval (the mean ± 4.30 standard errors, with 3 seeds) excludes 0", "on these 135 additions",
    "Three seeds, 24 steps, one task", "the gain from TIS with cap 2 or 5",
    # what to take away
    "wrong in gradient** (section 1)",
    r"PPO with GAE $\lambda < 1$ (TRL's PPO trainer up to TRL 1.12, $\lambda = 0.95$)",
    "critic's error (Part 1, section 4)", "forward KL** (section 1): Part 3's `beta` term",
    "(its default before TRL 1.10)", "(Tang & Munos 2025). At", "TRL 1.16's default multiplies k3 by the ratio",
    "least noisy** (section 1)", "blind spots** (section 2)", r"best-of-n's KL is below $\log n - (n-1)/n$",
    "to be collected** (section 2)", "early stopping** (section 2)", "of arithmetic** (section 3)",
    "the weight 1/(B L)", "positive control** (section 3)", "with 3 seeds, the raw read-out", "cheap** (section 4)",
    "got wrong** (section 4)", "not the leading 1 or the EOS", "not how** (section 4)",
    "off-policy** (section 5). With `num_iterations` 1", "the sampler** (section 5)",
    "on-policy one** (section 5, exactly", r"unbounded for a ratio above $1+\epsilon_\text{high}$ with $A < 0$",
)


# --- the tests ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("claims, source", [
    (kl_gradients_claims, "docs/figures/lab.json"),
    (hacking_claims, "docs/figures/lab.json, lab_leash.json and lab_rm_sweep.json"),
    (length_bias_claims, "docs/figures/lab.json"),
    (policy_shift_claims, "docs/figures/lab.json"),
    (off_policy_claims, "docs/figures/lab.json"),
    (summary_claims, "docs/figures/lab.json and lab_leash.json"),
], ids=["kl_gradients", "reward hacking", "length bias", "policy shift", "off-policy", "summary"])
def test_each_section_is_the_stored_figures(claims, source):
    _assert_the_chapter_says(claims(), source)


def test_the_numbers_not_stored_are_still_in_the_chapter():
    gone = [phrase for phrase in [*NOT_STORED, *SETTINGS] if phrase not in PROSE]
    assert not gone, f"NOT_STORED or SETTINGS name phrases the chapter no longer has (drop or update them): {gone}"


def where_each_number_comes_from() -> list[tuple[str, str, str | None]]:
    """Each number of the chapter's prose: "checked" (a phrase a test builds from the stored figures), "not stored",
    "setting", or None (numbers_by_source)."""
    return numbers_by_source(PROSE, {"checked": [phrase for claims in CLAIMS for phrase in claims().values()],
                                     "not stored": list(NOT_STORED), "setting": SETTINGS})


def test_every_number_in_the_chapter_says_where_it_comes_from():
    loose = [f"  {number!r} in …{context}…"
             for number, context, kind in where_each_number_comes_from() if kind is None]
    assert not loose, ("numbers in the chapter's Markdown that no test checks against a stored figure and that "
                       "neither NOT_STORED nor SETTINGS in tests/test_lab_chapter_figures.py names:\n"
                       + "\n".join(loose))
