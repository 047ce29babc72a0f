"""The numbers docs/lab.md quotes, held to the figures they come from.

Each run the page quotes is stored once, as the `--json` output of its command (docs/figures/*.json): lab.json the
default run (`python -m solutions.part6_lab --json`), lab_leash.json the matched-KL experiment (`--leash`),
lab_rm_sweep.json the data sweep (`--rm-pairs-per-prompt 1 2 4`). For each part of the page a function below builds
the page's phrases from those figures, {what: phrase}, and a test asserts every phrase is in the page's prose.

Some numbers the page quotes are not in any stored file (a longer variant, another seed set, another date, wall
time): NOT_STORED lists them with the run they come from. It also lists the few that lab.json gives otherwise (the
page quotes an earlier run there), each with a reason that starts "disagrees with lab.json". SETTINGS lists the
numbers that are not results (a seed list, a step count, a paper's year). The last test reads every number in the
page's prose and fails on one that is in none of these, so that a number added to the page must say where it comes
from."""

import functools
import json
import math
import re
import statistics
from decimal import ROUND_FLOOR, ROUND_HALF_UP, Decimal
from pathlib import Path

import pytest

from solutions.part6_lab.hacking import leash_table

ROOT = Path(__file__).resolve().parent.parent
PAGE = (ROOT / "docs" / "lab.md").read_text()
PROSE = " ".join(PAGE.split())  # a sentence's words, wherever the page breaks its lines


@functools.cache
def _stored(name: str, command: str) -> dict:
    """docs/figures/<name>.json, the `--json` output of `command`."""
    figures = json.loads((ROOT / "docs" / "figures" / f"{name}.json").read_text())
    assert figures["command"] == command, f"docs/figures/{name}.json is not the output of {command}"
    return figures


def _lab() -> dict:
    return _stored("lab", "python -m solutions.part6_lab --json")


def _leash() -> dict:
    return _stored("lab_leash", "python -m solutions.part6_lab --leash --json")


def _rm_sweep() -> dict:
    return _stored("lab_rm_sweep", "python -m solutions.part6_lab --rm-pairs-per-prompt 1 2 4 --json")


# How the page writes a figure. The JSON stores each figure rounded (most to 4 decimals) and the page rounds that
# stored decimal again, half up: the helpers go through Decimal(str(x)), not through binary floating point, whose
# 0.3245 is a little under 0.3245.

# Stored figures that sit exactly half-way at the page's precision. The page rounded the unrounded figure, which the
# JSON does not keep, so at a tie it may have gone either way; these went down.
ROUNDED_DOWN_TIES = {0.5185, 0.5105}  # off_policy.sweep: lag 0's lowest seed, and tis_token_cap2's at lag 2


def _fixed(x: float, places: int, sign: bool = False, scale: int = 1) -> str:
    """scale × x with `places` decimals, rounded half up; a sign when asked; the minus sign typeset (−)."""
    exact, step = Decimal(str(x)) * scale, Decimal(1).scaleb(-places)
    value = exact.quantize(step, rounding=ROUND_HALF_UP)
    if x in ROUNDED_DOWN_TIES:
        assert value - exact == step / 2, f"{x} is no tie at {places} decimals: take it out of ROUNDED_DOWN_TIES"
        value -= step
    return (f"{value:+f}" if sign else f"{value:f}").replace("-", "−")


def _pct(x: float, places: int = 1) -> str:
    """A fraction as a percentage: 0.2555 -> '25.6%'."""
    return _fixed(x, places, scale=100) + "%"


def _pts(x: float, sign: bool = False) -> str:
    """A difference of fractions in points (100 × the difference), one decimal: 0.0728 -> '7.3' ('+7.3' signed)."""
    return _fixed(x, 1, sign, scale=100)


def _pm(difference: float, standard_error: float, sign: bool = False) -> str:
    """A difference ± its standard error, in points: '+7.3 ± 1.3'."""
    return f"{_pts(difference, sign)} ± {_pts(standard_error)}"


def _span(values: list[float], places: int, scale: int = 1) -> str:
    """The smallest and the largest of `values`: '0.52–1.00'."""
    return f"{_fixed(min(values), places, scale=scale)}–{_fixed(max(values), places, scale=scale)}"


def _pct_span(values: list[float]) -> str:
    """The smallest and the largest of `values`, in whole percent: '86–90%'."""
    return _span(values, 0, scale=100) + "%"


def _two_digits(x: float) -> str:
    """Two significant digits, at most two decimals: 1.698 -> '1.7', 0.2865 -> '0.29', 0.0367 -> '0.04'."""
    return _fixed(x, min(2, 1 - math.floor(math.log10(abs(x)))))


def _sci(x: float, decimals: int = 1) -> str:
    """Scientific notation as the page writes it: 5.48e-06 -> '5.5e-6'."""
    mantissa, exponent = f"{x:.{decimals}e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def _at_most(x: float) -> str:
    """A bound: x rounded up to one significant digit, 4.33e-07 -> '5e-7'."""
    exponent = math.floor(math.log10(x))
    return f"{math.ceil(round(x / 10 ** exponent, 9))}e{exponent}"


def _at_least(x: float, places: int) -> str:
    """A bound from below: x rounded down, 0.9971 -> '0.997'."""
    return f"{Decimal(str(x)).quantize(Decimal(1).scaleb(-places), rounding=ROUND_FLOOR):f}"


def _seconds(x: float) -> str:
    return f"{_fixed(x, 0)} s"


def _slashes(items) -> str:
    """'a / b / c'."""
    return " / ".join(str(item) for item in items)


def _and(items) -> str:
    """'a, b and c'."""
    items = [str(item) for item in items]
    return ", ".join(items[:-1]) + " and " + items[-1]


def _if(condition: bool, phrase: str) -> str:
    """A verdict the page states: the phrase when the figures bear it out, else a marker the page does not hold."""
    return phrase if condition else f"(the figures do not say: {phrase})"


def _took(figures: dict) -> str:
    """The note each stored run keeps of its machine: how long the main job's training took there."""
    return re.search(r"the main job's training took [\d.]+ s", figures["machine"])[0]


def _assert_the_page_says(claims: dict, source: str):
    wrong = {what: phrase for what, phrase in claims.items() if phrase not in PROSE}
    assert not wrong, f"docs/lab.md does not say what {source} says: {wrong}"


# --- the default run (docs/figures/lab.json), part by part of the page ---------------------------------------------

def run_claims() -> dict:
    """The opening paragraph: when and where the stored run ran, and how long each experiment took by its own clock."""
    stored = _lab()
    names = {"KL gradients": "kl_gradients", "hacking": "hacking", "length bias": "length_bias",
             "policy shift": "policy_shift", "off-policy": "off_policy"}
    took = ", ".join(f"{name} {_seconds(stored[key + '_seconds'])}" for name, key in names.items())
    return {
        "the seeds": f"each over seeds {_and(stored['seeds'])}",
        "the date and the machine": f"On {stored['date']}, on a machine where {_took(stored)}",
        "each experiment's time": f"(by its own clock {took};",
    }


def kl_gradients_claims() -> dict:
    figures = _lab()["kl_gradients"]

    def row(kind: str, label: str, reverse_places: int = 3, norm_places: int = 2, seed_range: bool = False) -> str:
        """A row of the table: the cosines with the reverse and the forward KL's gradients, the norm ratio."""
        entry = figures[kind]
        reverse, forward, norm = entry["cosine_reverse"], entry["cosine_forward"], entry["norm_ratio"]
        reverse = "– (zero)" if reverse is None else _fixed(reverse, reverse_places)
        if seed_range:
            reverse += f" ({_span(entry['per_seed']['cosine_reverse'], 2)})"
        forward = "– (zero)" if forward is None else _fixed(forward, 3)
        norm = f"{_sci(norm, 0)} (float rounding)" if norm < 1e-6 else _fixed(norm, norm_places)
        return f"| {label} | {reverse} | {forward} | {norm} |"

    near, noise = figures["scale_sweep"][0], figures["noise"]
    nearest = min(c for key, c in near.items() if key.startswith("cosine_") and c is not None)
    k3_from_16 = [c for n, c in zip(noise["n"], noise["k3_loss"]["cosine_reverse"]) if n >= 16]
    bound = _at_most(max(figures["k3_equals_per_token_forward_kl_on_policy_states"]["max_relative_error"],
                         figures["k3_times_ratio_equals_exact_per_token_kl"]["max_relative_error"]))
    return {
        "the policy's distance from its reference": f"a LoRA policy {_fixed(figures['reverse_kl']['mean'], 1)} nats",
        "k1 in the loss": row("k1_loss", "k1 in the loss"),
        "k2 in the loss": row("k2_loss", "k2 in the loss (½ log-ratio²)"),
        "k3 in the loss": row("k3_loss", "k3 in the loss (Part 3's `beta` term; TRL's with "
                                         "`use_bias_correction_kl=False`)", seed_range=True),
        "the exact per-token KL": row("exact_token_loss", "exact per-token KL in the loss (Part 1)"),
        "k1 in the reward": row("k1_reward", "k1 in the reward, as a score function (REINFORCE, RLOO)", 6, 3),
        "k3 × ratio in the loss": row("k3_ratio_loss", "k3 × ratio in the loss (TRL 1.16's default `beta` term, "
                                                       "`use_bias_correction_kl=True`)"),
        "the k3 identity (one bound for both)": f"states (to {bound} relative error)",
        "the k3 × ratio identity": f"KL's (to {bound} relative error;",
        "one sample's noise": f"(cosine with its own expectation {_fixed(noise['k3_ratio_loss']['cosine_own'][0], 2)}"
                              f" at N = {noise['n'][0]}, against the exact per-token KL's "
                              f"{_fixed(noise['exact_token_loss']['cosine_own'][0], 2)})",
        "near the reference": f"(every cosine ≥ {_at_least(nearest, 3)} at {near['reverse_kl']:g} nats)",
        "k3's bias, the median from N = 16 on": f"stays near {_fixed(statistics.median(k3_from_16), 2)} "
                                                f"from N = 16 to {noise['n'][-1]}",
    }


def hacking_claims() -> dict:
    seeds, h = _lab()["seeds"], _lab()["hacking"]
    model, best, peak = h["reward_model"], h["best_of_n"], h["best_of_n_peak"]
    at_peak = next(p for p in best if p["n"] == peak["n"])
    rise, fall = h["best_of_n_rise"], h["best_of_n_fall"]
    likelihood = h["likelihood_only"]["best_of_n_rise"]
    head_only = h["head_only"]
    curve = h["rl_curve"]["peak"]["per_seed"]  # each seed's GRPO run at beta 0: its start, peak, far end, end
    errors = [s[change]["standard_error"] for s in curve for change in ("rise", "fall")]
    back = next(i for i, s in enumerate(curve) if s["far"]["step"] != s["end"]["step"])  # the seed that came back
    unleashed, leashed, tight = h["beta_sweep"]  # beta 0, 0.5, 2
    largest = _slashes(f"{_two_digits(min(b['max_kl_per_seed']))}–{_two_digits(max(b['max_kl_per_seed']))}"
                       for b in h["beta_sweep"])
    below = [100 * (g - t) for g, t in zip(leashed["gold_per_seed"], tight["gold_per_seed"])]
    fraction = {2: "a half", 3: "a third", 4: "a quarter", 5: "a fifth"}.get(round(unleashed["kl"] / leashed["kl"]))
    buggy = h["buggy_verifier"]
    return {
        "the reward model's pairs, their mean to the nearest 5":
            f"about {5 * round(statistics.fmean(model['pairs']) / 5)} pairs",
        "its accuracy": f"it ranks {_pct_span(model['held_out_accuracy'])} of held-out pairs right "
                        f"({_pct_span(model['train_accuracy'])} of its training pairs)",
        "best-of-n's curve": f"Gold {_pct(best[0]['gold'])} at n = {best[0]['n']}, a peak of {_pct(peak['gold'])} at "
                             f"n = {peak['n']} (KL {_fixed(peak['kl'], 2)}, the formula says "
                             f"{_fixed(at_peak['kl_formula'], 2)}), {_pct(best[-1]['gold'])} at n = {best[-1]['n']} "
                             f"(KL {_fixed(best[-1]['kl'], 2)}, the formula {_fixed(best[-1]['kl_formula'], 2)})",
        "its rise and fall": f"the rise is {_pm(rise['diff'], rise['se'])} points and the fall "
                             f"{_pm(fall['diff'], fall['se'])} (`best_of_n_fall`), "
                             + _if(rise["resolved"] and fall["resolved"] and fall["margin"] == 2,
                                   "each resolved (more than twice its standard error, `resolved` in the JSON), ")
                             + _if(all(s["diff"] > fall["margin"] * s["se"] for s in fall["per_seed"]),
                                   "the fall in every seed"),
        "the frozen likelihood": f"likelihood rises {_pm(likelihood['diff'], likelihood['se'])} points "
                                 + _if(not h["likelihood_only"]["best_of_n_fall"]["resolved"], "and stays"),
        "the head-only model's accuracy": f"({_pct_span(head_only['held_out_accuracy'])} of held-out pairs right)",
        "best-of-n against it": f"(`head_only`: gold {_pct(head_only['best_of_n'][-1]['gold'])} at "
                                f"n = {head_only['best_of_n'][-1]['n']})",
        "the synthetic control's peaks": ", ".join(f"n = {c['peak']['n']} ({_pct(c['peak']['gold'], 0)}) at "
                                                   f"σ = {c['sigma']:g}" for c in h["control"]),
        "the standard errors of GRPO's rises and falls": f"is {_span(errors, 3)}. " + _if(
            h["rl_curve"]["peak"]["peak_in_every_seed"], "**Gold rises, peaks and falls in every seed**"),
        "GRPO's peaks": f"from {_pct(h['gold_start'])} to a peak of {_slashes(_pct(s['peak']['gold']) for s in curve)} "
                        f"(seeds {_slashes(seeds)}; "
                        f"at √KL {_slashes(_fixed(s['peak']['sqrt_kl'], 2) for s in curve)}, "
                        f"steps {_slashes(s['peak']['step'] for s in curve)}), rises of "
                        f"{_and(_pm(s['rise']['gold'], s['rise']['standard_error'], sign=True) for s in curve)} points",
        "GRPO's falls": f"down to {_slashes(_pct(s['far']['gold']) for s in curve)} at the furthest the run went from "
                        f"its reference (√KL {_slashes(_fixed(s['far']['sqrt_kl'], 2) for s in curve)}), falls of "
                        f"{_and(_pm(s['fall']['gold'], s['fall']['standard_error']) for s in curve)} points, while "
                        f"the proxy climbed ({_fixed(h['proxy_start'], 1)} to {_fixed(h['proxy_end'], 1)})",
        "the seed that came back": f"(seed {seeds[back]} reached √KL {_fixed(curve[back]['far']['sqrt_kl'], 2)} at "
                                   f"step {curve[back]['far']['step']} and came back to "
                                   f"{_fixed(curve[back]['end']['sqrt_kl'], 2)})",
        "the leash's ends": f"`beta` {_slashes(format(b['beta'], 'g') for b in h['beta_sweep'])} ended at KL "
                            f"{_slashes(_fixed(b['kl'], 2) for b in h['beta_sweep'])} (the largest along the run "
                            f"{largest}) with gold {_pct(unleashed['gold'])} "
                            f"({_pct_span(unleashed['gold_per_seed'])} by seed) / {_pct(leashed['gold'])} "
                            f"({_pct_span(leashed['gold_per_seed'])}) / {_pct(tight['gold'])} "
                            f"({_pct_span(tight['gold_per_seed'])})",
        "beta 0.5 against beta 0, by seed": "`beta` 0.5 ended " + _and(
            _pm(d["gold"], d["standard_error"], sign=True) for d in leashed["gold_minus_beta0_per_seed"])
            + " points higher",
        "beta 0.5's KL against beta 0's": f"at {fraction} of its KL",
        "beta 2": f"(KL {_fixed(tight['kl'], 2)}) that it gained less: {_fixed(min(below), 0)} to "
                  f"{_fixed(max(below), 0)} points below `beta` 0.5 in each seed (against `beta` 0's end "
                  + ", ".join(_pm(d["gold"], d["standard_error"], sign=True)
                              for d in tight["gold_minus_beta0_per_seed"])
                  + ")",
        "the buggy verifier": f"went from {_pct(buggy['buggy_start'])} to {_pct(buggy['buggy_end'], 0)}, gold to "
                              f"{_pct(buggy['gold_end'], 0)} " + _if(not any(buggy["gold_end_per_seed"]),
                                                                     "in every seed"),
    }


def length_bias_claims() -> dict:
    figures = _lab()["length_bias"]
    settings, control = figures["settings"], figures["positive_control"]

    def cell(stats: dict) -> str:  # the table's seeds 0-9 column: mean ± standard error, 95% interval, seeds > 0
        low, high = stats["ci95"]
        return (f"{_fixed(stats['mean'], 4, sign=True)} ± {_fixed(stats['standard_error'], 4)}, "
                f"{_fixed(low, 4, sign=True)} to {_fixed(high, 4, sign=True)}, "
                f"{stats['positive']} of {len(stats['seeds'])} |")

    gap, stop = figures["training"]["grpo"]["eos_gap"], figures["training"]["grpo"]["stop_rate_gap"]

    def length(name: str, when: str) -> str:  # the mean length of wrong and right answers, one decimal
        return _fixed((figures[name][f"wrong_{when}"] + figures[name][f"right_{when}"]) / 2, 1)

    control_t = statistics.fmean(control["seeds"]) / statistics.stdev(control["seeds"]) * len(control["seeds"]) ** 0.5
    return {
        "the answers' length": f"(up to {settings['max_new_tokens']} tokens;",
        "the one-update batch": f"on the same {settings['push_completions']} completions, "
                                f"{len(settings['push_seeds'])} seeds;",
        "the default run's seeds": f"(seeds {settings['seeds'][0]}–{settings['seeds'][-1]} trained, "
                                   f"{settings['push_seeds'][0]}–{settings['push_seeds'][-1]} measured)",
        "the primary result": "| `grpo` — the primary result | " + cell(figures["paired"]),
        "grpo's raw gap": "| `grpo`, raw gap (uniform stopping left in) | " + cell(figures["paired_raw_gap"]["grpo"]),
        "the positive control": "| positive control: `dr_grpo`, reward + 1·(2r−1)·3/L | " + cell(control),
        "the control's raw gap": "| control, raw gap | " + cell(figures["paired_raw_gap"]["control"]),
        "dapo": _if(not any(figures["paired_all"]["dapo"]["seeds"]), "(`dapo` − `dr_grpo` is 0 exactly)"),
        "grpo's push over the control's, seeds 0–9": f"–{_fixed(figures['paired']['mean'] / control['mean'], 1)} "
                                                     "times the control's",
        "the control's t, seeds 0–9": f"against {_fixed(control_t, 1)} for the 3/L term",
        "training": f"after {settings['steps']} steps with shared random numbers ({len(settings['seeds'])} seeds)",
        "the control in training": _if(not control["training_detected"], "the control is not detected in training"),
        "grpo against dr_grpo in training": f"is {_fixed(gap['mean'], 3, sign=True)} ± "
                                            f"{_fixed(gap['standard_error'], 3)} in the stored run (seeds 0–2, "
                                            f"interval {_fixed(gap['ci95'][0], 3, sign=True)} to "
                                            f"{_fixed(gap['ci95'][1], 3, sign=True)})",
        "the stop rates in training": f"{_fixed(stop['mean'], 3, sign=True)} in the stored run "
                                      f"({_if(stop['positive'] == len(stop['seeds']), 'all three seeds positive')}, "
                                      f"interval {_fixed(stop['ci95'][0], 3, sign=True)} to "
                                      f"{_fixed(stop['ci95'][1], 3, sign=True)})",
        "grpo's lengths in training": f"under `grpo` {length('grpo', 'start')} → {length('grpo', 'end')} in the "
                                      "stored run",
        "the control's lengths in training": f"under the control {length('control', 'start')} → "
                                             f"{length('control', 'end')} in the stored run",
    }


def policy_shift_claims() -> dict:
    ablation, shift = _lab()["layer_ablation"], _lab()["policy_shift"]
    by_role = shift["right_answer_log_ratio_by_role"]
    blocks = range(len(ablation["without"]))
    most = min(blocks, key=lambda b: ablation["without"][b])  # the block whose loss costs most
    return {
        "the run": f"After {ablation['steps']} GRPO steps",
        "the held-out additions": f"on all {ablation['held_out_pairs']} additions",
        "the table": f"| {_pct(ablation['all'])} ({_span(ablation['per_seed']['all'], 1, scale=100)}) | "
                     f"{_pct(ablation['none'])} | {_slashes(_fixed(a, 1, scale=100) for a in ablation['without'])}% | "
                     f"{_slashes(_fixed(a, 1, scale=100) for a in ablation['only'])}% |",
        "the block that matters": _if(most == max(blocks, key=lambda b: ablation["only"][b]),
                                      f"Block {most} carries most of the gain"),
        "the digits RL raised": f"units and tens digits ({_fixed(by_role['units'], 2, sign=True)} and "
                                f"{_fixed(by_role['tens'], 2, sign=True)} nats)",
        "attention on the operands": f"from {_pct(shift['operand_attention_before'])} to "
                                     f"{_pct(shift['operand_attention_after'])}",
    }


def off_policy_claims() -> dict:
    figures = _lab()["off_policy"]
    clip, gap, settings = figures["clip_fraction"], figures["gap"], figures["sweep_settings"]
    cells = {(e["lag"], e["correction"]): e for e in figures["sweep"]}
    lags = sorted({lag for lag, _ in cells})
    late = lags[1:]  # the lags behind the trainer
    corrections = list(dict.fromkeys(c for _, c in cells))  # "none" first
    labels = {"sequence_mask_cap3": "`sequence_mask_cap3` (TRL 1.16's default)",
              "sampler_as_old": "`sampler_as_old` (π_θ/π_sampler in the clip)"}

    def auc(lag: int, correction: str) -> str:  # a cell of the table: the mean (the seeds' range), lag 0's range once
        e = cells[lag, correction]
        with_range = lag > 0 or correction == corrections[0]
        return _fixed(e["auc"], 3) + (f" ({_span(e['auc_per_seed'], 3)})" if with_range else "")

    rows = {f"the row of {c}": f"| {labels.get(c, f'`{c}`')} | " + " | ".join(auc(lag, c) for lag in lags) + " |"
            for c in corrections}
    none = [cells[lag, "none"]["auc_per_seed"] for lag in lags]
    corrected = [cells[lag, c] for lag in late for c in corrections if c != "none"]
    resolved = [c for c in corrections if c != "none" and all(cells[lag, c]["minus_none"]["resolved"] for lag in late)]
    caps = [p for p in figures["paired"] if p["a"].startswith("tis_token") and p["b"].startswith("tis_token")]
    cap5_cap2 = {p["lag"]: p for p in caps if (p["a"], p["b"]) == ("tis_token_cap5", "tis_token_cap2")}
    weights_at_the_end = [cells[lags[-1], c]["auc"] for c in corrections if c not in ("none", "sampler_as_old")]
    seeds = range(len(figures["seeds"]))
    old_highest = all(cells[lag, "sampler_as_old"]["auc_per_seed"][i] > cells[lag, c]["auc_per_seed"][i]
                      for lag in late for c in corrections if c != "sampler_as_old" for i in seeds)
    old_level = all(cells[lag, "sampler_as_old"]["minus_on_policy"]["positive"] == 2
                    and not cells[lag, "sampler_as_old"]["minus_on_policy"]["resolved"] for lag in late)
    exact = {e["correction"]: e for e in figures["exact"]}
    tis = [e for name, e in exact.items() if name.startswith("tis_token")]
    unbounded = figures["exact_sampler_as_old"][-1]  # at the largest gap
    return {
        "the clip fraction": _if(clip["1"]["mean"] == 0, "exactly 0 with `num_iterations` 1")
                             + f" (the ratio is 1), {_pct(clip['2']['mean'])} with 2 and {_pct(clip['4']['mean'])}"
                               " with 4",
        "the sampler against the trainer": f"(lean decoder {_sci(gap['lean float32']['max'])} at most in log-prob, "
                                           f"TransformerLens's `generate` {_sci(gap['bridge float32']['max'])}); in "
                                           f"bfloat16 it is {gap['lean bfloat16']['max']:g} off at worst, and weights "
                                           f"{figures['gap_lag']} steps stale {gap['lean, 4 steps stale']['max']:g}",
        "the sweep": f"GRPO ({settings['steps']} steps) on samples from weights {', '.join(map(str, lags[:-1]))} or "
                     f"{lags[-1]} steps behind the trainer",
        "its evaluations": f"at steps 0, {settings['eval_every']}, ..., {settings['steps']}, divided by the "
                           f"{settings['steps']} steps",
        "its seeds": f"Mean over seeds {', '.join(map(str, figures['seeds']))} (range):",
        "the table's lags": "| correction | " + " | ".join(f"lag {lag}" for lag in lags) + " |",
        **rows,
        "uncorrected, each lag below the one before": _if(
            all(max(later) < min(earlier) for earlier, later in zip(none, none[1:])),
            "each lag's seed range below the one before"),
        "every correction raised the AUC": _if(all(d > 0 for e in corrected for d in e["auc_minus_none"]),
                                               f"raised it at every lag from {late[0]} to {late[-1]} in every seed"),
        "the corrections resolved at every lag": "for TIS capped at " + _and(
            c.removeprefix("tis_token_cap") for c in resolved if c.startswith("tis_token_cap"))
            + _if("sampler_as_old" in resolved, " and the sampler as old") + " at every lag",
        "no difference between caps": _if(not any(p["resolved"] for p in caps),
                                          "no difference between caps is resolved"),
        "cap 5 minus cap 2": "(cap 5 minus cap 2: " + ", ".join(
            f"{_fixed(cap5_cap2[lag]['mean'], 3, sign=True)} ± {_fixed(cap5_cap2[lag]['standard_error'], 3)} at "
            f"lag {lag}" for lag in (late[0], late[-1])) + ")",
        "the weights at the largest lag": _if(max(weights_at_the_end) < cells[0, "none"]["auc"],
                                              f"none of the weights reached the on-policy AUC at lag {lags[-1]}"),
        "the sampler as old, the highest": _if(old_highest, f"had the highest AUC of the six at every lag from "
                                                            f"{late[0]} to {late[-1]} in every seed"),
        "the sampler as old against on-policy": _if(old_level, "(above it in two seeds, below in one; no difference "
                                                               "with it resolved)"),
        "the stale sampler of the exact gradients": f"that of lag {lags[-1]}, "
                                                    f"{_fixed(cells[lags[-1], 'none']['gap_mean'], 2)})",
        "the exact gradients' cosines": f"none {_fixed(exact['none']['cosine'], 2)}, token TIS capped at "
                                        + _slashes("uncapped" if e["cap"] is None else format(e["cap"], "g")
                                                   for e in tis)
                                        + f" {_slashes(_fixed(e['cosine'], 2) for e in tis)}, the sequence ratio "
                                          f"{_fixed(exact['sequence_ratio']['cosine'], 1)} (unbiased), TRL's sequence "
                                          f"mask {_fixed(exact['sequence_mask_cap3']['cosine'], 2)}, the sampler as "
                                          f"old {_fixed(exact['sampler_as_old']['cosine'], 2)}",
        "the tokens no clip bounds": f"({_pct(unbounded['above_with_negative_advantage'])} of the tokens there, whose "
                                     f"part of the expected gradient had {_fixed(unbounded['above_part_norm'], 2)} of "
                                     "its norm)",
    }


# --- the longer runs (lab_leash.json, lab_rm_sweep.json) and the proxy's terms ------------------------------------

def matched_kl_claims() -> dict:
    """The sentences after the matched-KL table (the table itself is leash_table's, from the same figures)."""
    figures = _leash()["leash"]
    matched = figures["matched_kl"]
    means = [m["mean"] for m in matched]

    def beta_2_kl(place: str) -> str:  # the KL at the end with beta 2, over both learning rates and every seed
        return _span([p["kl"] for m in matched if m["place"] == place and m["beta"] == 2 for p in m["per_seed"]], 2)

    claims = {
        "the machine": f"2-core machine where {_took(_leash())}",
        "the seeds": f"each seed ({figures['seeds'][0]} to {figures['seeds'][-1]})",
        "the reward models' held-out accuracy": _pct_span(figures["held_accuracy"]),
        "the range of the differences": f"by {_pts(min(means))} to {_pts(max(means))} points",
        "every seed above in every setting": _if(all(m["positive"] == len(m["per_seed"]) for m in matched),
                                                 "in every seed"),
        "every interval above 0": _if(all(m["ci95"] and m["ci95"][0] > 0 for m in matched),
                                      "every interval clear of 0"),
        "beta 2's KL, k3 in the loss": f"held the policy at KL {beta_2_kl('loss_k3')}",
        "beta 2's KL, k1 in the reward": f"it held it at {beta_2_kl('reward_k1')}",
    }
    for versus in figures["beta_against_beta"]:
        low, high = versus["ci95"]
        claims[f"beta {versus['high']:g} minus beta {versus['low']:g}, {versus['place']}, lr {versus['lr']:g}"] = \
            f"{_pts(versus['mean'], sign=True)} [{_pts(low, sign=True)}, {_pts(high, sign=True)}]"

    # the stricter reading: against the unleashed run's best evaluation at that KL or less
    loose = [m for m in matched if m["place"] == "reward_k1" and m["beta"] == 0.5]  # the loosest leash tried
    held = [m for m in matched if m not in loose]
    paths = figures["unleashed_paths"]
    evaluations = {len(path) for runs in paths.values() for path in runs}
    assert len(evaluations) == 1, f"the unleashed runs differ in their number of evaluations: {evaluations}"

    def beyond_the_best(m: dict) -> int:  # seeds whose end KL is beyond the KL of the unleashed run's best evaluation
        best = [max(path, key=lambda e: e[2]) for path in paths[f"{m['lr']:g}"]]  # [step, kl, gold]
        return sum(p["kl"] > b[1] for p, b in zip(m["per_seed"], best))

    def paired(stats: dict) -> str:
        return (f"{_pts(stats['mean'], sign=True)} [{_pts(stats['ci95'][0], sign=True)}, "
                f"{_pts(stats['ci95'][1], sign=True)}]")

    claims |= {
        "the evaluations of an unleashed run": f"any of its {evaluations.pop()} evaluations with no more KL",
        "the held leashes against the best": f"still ended higher, by "
                                             f"{_pts(min(m['versus_best']['mean'] for m in held))} to "
                                             f"{_pts(max(m['versus_best']['mean'] for m in held))} points, "
                                             + _if(all(m["versus_best"]["ci95"][0] > 0 for m in held),
                                                   "every interval clear of 0"),
        "the loosest leash's KL": f"(KL {_span([p['kl'] for m in loose for p in m['per_seed']], 2)} at the end",
        "the loosest leash past the best": f"in {' and '.join(str(beyond_the_best(m)) for m in loose)} seeds of "
                                           f"{len(figures['seeds'])} at the two learning rates",
        "the loosest leash against the best": _if(all(m["versus_best"]["ci95"][0] < 0 < m["versus_best"]["ci95"][1]
                                                      for m in loose), "it ended level with that best (")
                                              + " and ".join(paired(m["versus_best"]) for m in loose) + ")",
    }
    return claims


def proxy_terms_claims() -> dict:
    hacking = _lab()["hacking"]
    likelihood, head = hacking["proxy_terms"]["likelihood_term"], hacking["proxy_terms"]["head_term"]
    same = (likelihood["held_out_accuracy"] == hacking["reward_model"]["held_out_accuracy"]
            and [p["gold"] for p in likelihood["best_of_n"]] == [p["gold"] for p in hacking["best_of_n"]])
    return {
        "the likelihood term ranks as the proxy does": _if(same, "ranks the held-out pairs as the whole proxy does, "
                                                                 "to four decimals"),
        "the head term's accuracy": f"its head term alone ranks {_pct_span(head['held_out_accuracy'])}",
        "best-of-n against the head term at the largest n": f"gold {_pct(head['best_of_n'][-1]['gold'])} at "
                                                           f"n = {head['best_of_n'][-1]['n']}",
    }


def data_sweep_claims() -> dict:
    stored = _rm_sweep()
    sizes = [stored[f"rm_pairs_per_prompt_{k}"] for k in (1, 2, 4)]
    assert all(len(set(s["prompts"])) == 1 and s["prompts"] == sizes[0]["prompts"] for s in sizes), "the same prompts"
    steps, peaks = {s["rm_steps"] for s in sizes}, {s["peak"]["n"] for s in sizes}
    assert len(steps) == 1, "the same number of steps"
    return {
        "the machine": f"where {_took(stored)}; the figures are in",
        "the pairs": f"({_and(format(s['pairs'][0], ',') for s in sizes)} pairs)",
        "the steps": f"the same {steps.pop()} optimizer steps",
        "the held-out accuracy": f"Held-out pair accuracy {_and(_pct_span(s['held_accuracy']) for s in sizes)}",
        "best-of-n's peak": _if(len(peaks) == 1, f"peaked at n = {min(peaks)} in all three"),
        "best-of-n's peaks": "(" + ", ".join(_pct(s["peak"]["gold"]) for s in sizes) + ")",
        "best-of-n's falls": _and(_pm(s["best_of_n_fall"]["diff"], s["best_of_n_fall"]["se"]) for s in sizes)
                             + " points",
        "every fall resolved": _if(all(s["best_of_n_fall"]["resolved"] and s["best_of_n_fall"]["margin"] == 2
                                       for s in sizes), "each resolved (more than twice its standard error)"),
        "a real GRPO peak in every seed": _if(all(s["rl_peak"]["peak_in_every_seed"] for s in sizes),
                                              "a real peak in every seed of every size"),
        "GRPO's peaks": _and(_pct_span([p["peak"]["gold"] for p in s["rl_peak"]["per_seed"]]) for s in sizes),
    }


CLAIMS = (run_claims, kl_gradients_claims, hacking_claims, proxy_terms_claims, matched_kl_claims, data_sweep_claims,
          length_bias_claims, policy_shift_claims, off_policy_claims)


# --- numbers no stored file holds -----------------------------------------------------------------------------------

# {the phrase as the page has it: the run it comes from}. An entry whose reason starts "disagrees with lab.json" is a
# number that docs/figures/lab.json, the default run's output, gives otherwise: the page quotes an earlier run there.
NOT_STORED = {
    # the opening paragraph
    "about 5 to 9 minutes": "an estimate across machines, from the two runs the paragraph times",
    "4 min 45 s of wall time": "/usr/bin/time on the stored run (lab.json's `seconds`, 281.2, is the run's own clock)",
    "on another, 543 s": "the run of 2026-11-26, on another machine (not stored)",
    "by its own clock KL gradients 19 s, hacking 135 s, length bias 79 s, policy shift 33 s, off-policy 268 s":
        "the run of 2026-11-26 (not stored)",
    "623 s": "a run of 2026-11-26 that trained the lag-0 cell once per correction (not stored)",
    # reward hacking
    "a standard error of 0.04": "arithmetic: √(p(1 − p)/128) at gold ≈ 0.25, not a figure of the run",
    # the matched-KL and data-sweep commands: wall time (their JSON keeps the run's own clock)
    "9 min 13 s": "the wall time of `--leash --json` (lab_leash.json's leash_seconds, 548.7, is its own clock)",
    "2 min 32 s": "the wall time of `--rm-pairs-per-prompt 1 2 4 --json` (lab_rm_sweep.json's rm_sizes_seconds, 148.3, "
                  "is its own clock)",
    # length bias: the table's seeds 10-19 column, and the training runs on 1 and on 2 threads
    "+0.0045 ± 0.0007, +0.0029 to +0.0060, 10 of 10": "`--only length_bias` from seed 10 (seeds 10–19 measured)",
    "+0.0017 ± 0.0002, +0.0012 to +0.0023, 10 of 10": "`--only length_bias` from seed 10 (seeds 10–19 measured)",
    "+0.0050 ± 0.0007, +0.0033 to +0.0067, 10 of 10": "`--only length_bias` from seed 10 (seeds 10–19 measured)",
    "+0.0031 ± 0.0006, +0.0018 to +0.0044, 10 of 10": "`--only length_bias` from seed 10 (seeds 10–19 measured)",
    "2.6–2.8 times": "2.6 is seeds 10–19's ratio (not stored); seeds 0–9's 2.8 is checked",
    "a t of 1.1 on the raw read-out and 1.7 on the differential one":
        "a side measurement of the (1 − L/24) control with _stop_push's pieces, not a command of the repository",
    "about 2.7 times": "both seed sets' ratios together; seeds 10–19's is not stored",
    "+0.015 / −0.001 (1 / 2 threads, seeds 0–2)": "the earlier run's training, on another machine (not stored)",
    "+0.19 / −0.005 (seeds 10–12)": "the training runs from seed 10, on 1 and on 2 threads (not stored)",
    "(−0.78 to +1.17 at the widest)": "the widest interval of the training runs on 1 and 2 threads, both seed sets",
    "+0.027 / +0.032 on seeds 0–2 of the earlier run": "the earlier run's training, on another machine (not stored)",
    "+0.008 / −0.003 on seeds 10–12": "the training runs from seed 10, on 1 and on 2 threads (not stored)",
    "16.0 → 12.5 on seeds 0–2 of the earlier run": "the earlier run's training, on another machine (not stored)",
    "13.4 → 17.3 on seeds 10–12": "the training runs from seed 10 (not stored)",
    "two of its interval ends were 0.0001 lower": "the earlier run's one-update table (not stored)",
    "to 0.0001": "the one-update figures of the earlier run against the stored one",
    "takes about 8 minutes of one CPU thread": "an estimate from its parts; LengthBiasConfig.long() was not run whole",
    "12 s per one-update seed, 16 s per training run": "timed parts of LengthBiasConfig.long() (not stored)",
    # on- and off-policy
    "(weights and ratios are 1 to about 1e-6)": "the earlier run that trained the lag-0 cell once per correction",
    "The same numbers with 1 and 2 threads": "the sweep run on 1 and on 2 torch threads (not stored)",
}

# Numbers that are not results: seed lists, run settings, dates, thread counts, papers and software versions, a
# formula's constants, t quantiles, the page's references to its own parts.
SETTINGS = (
    # the opening paragraph
    "Part 6", "seeds 0, 1 and 2", "on 2 idle CPU cores", "on 2026-11-26", "10-minute budget", "its lag-0 cell",
    # KL gradients
    "(356² of them", "356 rows", "Part 1", "Part 3", "section 4", "TRL 1.16", "trl 1.16", "TRL 1.12", "TRL 1.10",
    "λ < 1", "λ = 0.95", "Tang & Munos 2025",
    # reward hacking
    "(Seeds 0, 1, 2;", "a pool of 256 answers to each of 64 held-out additions", "log n − (n−1)/n",
    "Gao, Schulman & Hilton 2022", "Beirami et al. 2024", "arXiv:2401.01879", "the run of 2026-11-30",
    "(lr 1.5e-3, 40 steps, `beta` 0,", "every 4 steps", "128 held-out additions", "1,500 samples", "128 completions",
    "the 128 prompts", "`beta` 0", "`beta` 0.5", "`beta` 2", "`beta` 0 / 0.5 / 2",
    # matched KL and the data sweep
    "over 10 seeds", "2-core machine", "Gao et al. (2022)", "`beta` 0.5 and 2", "experiment 1",
    "95% t-interval, t(9) = 2.26", "95% interval | seeds above", "40-step GRPO runs", "all 40 at it", "95% intervals",
    "seeds 0–2", "set of 300 training additions", "at least 4 distinct right-wrong pairs among 64 samples",
    "on 1, 2 and 4 of each prompt's pairs", "fig. 1", "down to n = 256", "a factor of 4",
    # length bias
    "Liu et al. 2025, arXiv:2503.20783, section 3.1", "A(w)·∇E[1/L | w]", "update of norm 1", "seeds 10–12",
    "(10–19 measured)", "95% interval, seeds > 0) | seeds 0–9 | seeds 10–19 |", "1·(2r−1)·3/L",
    "(t(2) = 4.30)",
    "(2r−1)(1 − L/24)", "seeds 0–9", "seeds 10–19", "(1 / 2 threads", "interval across 0", "over 30 steps",
    "and 30 steps of sampling",
    "(20 seeds of 1,024 completions, every configuration, 60 training",
    # the policy shift
    "block 0 / 1 / 2 / 3", "the leading 1",
    # on- and off-policy
    "At lag 0", "trains lag 0 once", "95% t-interval", "4.30 standard errors", "excluding 0,",
    "356² two-token", "1 + ε_high", "c > 1", "above 3 (no lower", "Yao et al. 2025",
    "Three seeds of 24 steps",
)


# --- the tests ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("claims", [run_claims, kl_gradients_claims, hacking_claims, length_bias_claims,
                                    policy_shift_claims, off_policy_claims],
                         ids=["the default run's times", "kl_gradients", "reward hacking", "length bias",
                              "policy shift", "off-policy"])
def test_each_sections_tables_and_sentences_are_the_stored_figures(claims):
    _assert_the_page_says(claims(), "docs/figures/lab.json")


def test_the_matched_kl_table_and_its_sentences_are_the_stored_figures():
    figures = _leash()["leash"]
    missing = [row for row in leash_table(figures) if row not in PAGE]
    assert not missing, "docs/lab.md's matched-KL table differs from docs/figures/lab_leash.json; rows the figures " \
                        "make that the page lacks:\n" + "\n".join(missing)
    _assert_the_page_says(matched_kl_claims(), "docs/figures/lab_leash.json")


def test_the_proxy_terms_sentences_are_the_stored_figures():
    _assert_the_page_says(proxy_terms_claims(), "docs/figures/lab.json")


def test_the_data_sweep_sentences_are_the_stored_figures():
    _assert_the_page_says(data_sweep_claims(), "docs/figures/lab_rm_sweep.json")


def test_the_numbers_not_stored_are_still_on_the_page():
    gone = [phrase for phrase in [*NOT_STORED, *SETTINGS] if phrase not in PROSE]
    assert not gone, f"NOT_STORED or SETTINGS name phrases docs/lab.md no longer has (drop or update them): {gone}"


# A number of the page: a date, or digits with thousands commas, decimals, an exponent, a percent sign; not a digit
# inside a name (k3, part6_lab) or after a decimal point.
NUMBER = re.compile(r"(?<![\w.])(?:\d{4}-\d\d-\d\d|\d+(?:,\d{3})*(?:\.\d+)?(?:e-\d+)?%?)")


def numbers_by_source(prose: str, phrases: dict[str, list[str]]) -> list[tuple[str, str, str | None]]:
    """Each number of `prose` outside code spans: (the number, its context, the first kind of `phrases` ({kind: the
    phrases}, in order) that has a phrase it lies in; None when it lies in none)."""
    found = {kind: [m.span() for phrase in those for m in re.finditer(re.escape(phrase), prose)]
             for kind, those in phrases.items()}
    code = [m.span() for m in re.finditer(r"`[^`]*`", prose)]

    def inside(span: tuple[int, int], spans: list[tuple[int, int]]) -> bool:
        return any(start <= span[0] and span[1] <= end for start, end in spans)

    numbers = []
    for m in NUMBER.finditer(prose):
        if not inside(m.span(), code):
            kind = next((kind for kind, spans in found.items() if inside(m.span(), spans)), None)
            numbers.append((m[0], prose[max(0, m.start() - 50):m.end() + 30], kind))
    return numbers


def where_each_number_comes_from() -> list[tuple[str, str, str | None]]:
    """Each number of the page's prose: "setting", "checked" (a phrase a test builds from the stored figures, or a
    row of the matched-KL table), "not stored", or None (numbers_by_source)."""
    return numbers_by_source(PROSE, {"setting": SETTINGS,
                                     "checked": [phrase for claims in CLAIMS for phrase in claims().values()]
                                                + leash_table(_leash()["leash"]),
                                     "not stored": list(NOT_STORED)})


def test_every_number_on_the_page_says_where_it_comes_from():
    loose = [f"  {number!r} in …{context}…"
             for number, context, kind in where_each_number_comes_from() if kind is None]
    assert not loose, ("numbers in docs/lab.md that no test checks against a stored figure and that neither "
                       "NOT_STORED nor SETTINGS in tests/test_lab_figures.py names:\n" + "\n".join(loose))
