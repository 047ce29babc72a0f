"""The lab's figures that docs/lab.md quotes from its longer runs, stored once (docs/figures/*.json, each the `--json`
output of the command it names) and held to the page: the page's table is what the figures make, and the numbers its
sentences draw from them are theirs."""

import json
from pathlib import Path

from solutions.part6_lab.hacking import leash_table

ROOT = Path(__file__).resolve().parent.parent
PAGE = (ROOT / "docs" / "lab.md").read_text()
PROSE = " ".join(PAGE.split())  # a sentence's words, wherever the page breaks its lines


def _points(x: float) -> str:
    """A fraction as the page writes a difference in points: a sign always, the minus sign typeset."""
    return f"{100 * x:+.1f}".replace("-", "−")


def test_the_matched_kl_table_and_its_sentences_are_the_stored_figures():
    stored = json.loads((ROOT / "docs" / "figures" / "lab_leash.json").read_text())
    assert stored["command"] == "python -m solutions.part6_lab --leash --json"
    figures = stored["leash"]
    missing = [row for row in leash_table(figures) if row not in PAGE]
    assert not missing, "docs/lab.md's matched-KL table differs from docs/figures/lab_leash.json; rows the figures " \
                        "make that the page lacks:\n" + "\n".join(missing)
    means = [m["mean"] for m in figures["matched_kl"]]
    accuracy = figures["held_accuracy"]
    claims = {
        "the range of the differences": f"by {100 * min(means):.1f} to {100 * max(means):.1f} points",
        "every seed above in every setting": "in every seed" if all(
            m["positive"] == len(m["per_seed"]) for m in figures["matched_kl"]) else "(not every seed)",
        "every interval above 0": "every interval clear of 0" if all(
            m["ci95"] and m["ci95"][0] > 0 for m in figures["matched_kl"]) else "(an interval reaches 0)",
        "the reward models' held-out accuracy": f"{100 * min(accuracy):.0f}–{100 * max(accuracy):.0f}%",
        "the seeds": f"each seed ({figures['seeds'][0]} to {figures['seeds'][-1]})",
    }
    for versus in figures["beta_against_beta"]:
        low, high = versus["ci95"]
        claims[f"beta {versus['high']:g} minus beta {versus['low']:g}, {versus['place']}, lr {versus['lr']:g}"] = \
            f"{_points(versus['mean'])} [{_points(low)}, {_points(high)}]"
    wrong = {what: phrase for what, phrase in claims.items() if phrase not in PROSE}
    assert not wrong, f"docs/lab.md does not say what docs/figures/lab_leash.json says: {wrong}"


def test_the_proxy_terms_sentences_are_the_stored_figures():
    stored = json.loads((ROOT / "docs" / "figures" / "lab.json").read_text())
    assert stored["command"] == "python -m solutions.part6_lab --json"
    hacking = stored["hacking"]
    likelihood, head = hacking["proxy_terms"]["likelihood_term"], hacking["proxy_terms"]["head_term"]
    same = (likelihood["held_out_accuracy"] == hacking["reward_model"]["held_out_accuracy"]
            and [p["gold"] for p in likelihood["best_of_n"]] == [p["gold"] for p in hacking["best_of_n"]])
    accuracy = head["held_out_accuracy"]
    claims = {
        "the likelihood term ranks as the proxy does": ("ranks the held-out pairs as the whole proxy does, to four "
                                                        "decimals" if same else "(they differ)"),
        "the head term's accuracy": f"its head term alone ranks {100 * min(accuracy):.0f}–{100 * max(accuracy):.0f}%",
        "best-of-n against the head term at the largest n": f"gold {100 * head['best_of_n'][-1]['gold']:.1f}% at n = "
                                                           f"{head['best_of_n'][-1]['n']}",
    }
    wrong = {what: phrase for what, phrase in claims.items() if phrase not in PROSE}
    assert not wrong, f"docs/lab.md does not say what docs/figures/lab.json says: {wrong}"


def test_the_data_sweep_sentences_are_the_stored_figures():
    stored = json.loads((ROOT / "docs" / "figures" / "lab_rm_sweep.json").read_text())
    assert stored["command"] == "python -m solutions.part6_lab --rm-pairs-per-prompt 1 2 4 --json"
    sizes = [stored[f"rm_pairs_per_prompt_{k}"] for k in (1, 2, 4)]
    assert all(len(set(s["prompts"])) == 1 and s["prompts"] == sizes[0]["prompts"] for s in sizes), "the same prompts"
    assert {s["rm_steps"] for s in sizes} == {150}, "the same number of steps"

    def span(values):
        return f"{100 * min(values):.0f}–{100 * max(values):.0f}%"

    claims = {
        "the pairs": "(" + ", ".join(format(s["pairs"][0], ",") for s in sizes[:-1])
                     + f" and {sizes[-1]['pairs'][0]:,} pairs)",
        "the held-out accuracy": f"Held-out pair accuracy {span(sizes[0]['held_accuracy'])}, "
                                f"{span(sizes[1]['held_accuracy'])} and {span(sizes[2]['held_accuracy'])}",
        "best-of-n's peaks": "(" + ", ".join(f"{100 * s['peak']['gold']:.1f}%" for s in sizes) + ")",
        "best-of-n's falls": ", ".join(f"{100 * s['best_of_n_fall']['diff']:.1f} ± {100 * s['best_of_n_fall']['se']:.1f}"
                                       for s in sizes[:-1]) + f" and {100 * sizes[-1]['best_of_n_fall']['diff']:.1f} ± "
                                                              f"{100 * sizes[-1]['best_of_n_fall']['se']:.1f} points",
        "every fall resolved": "each resolved" if all(s["best_of_n_fall"]["resolved"] for s in sizes) else "(not all)",
        "a real GRPO peak in every seed": "a real peak in every seed of every size" if all(
            s["rl_peak"]["peak_in_every_seed"] for s in sizes) else "(not every seed)",
        "GRPO's peaks": ", ".join(span([p["peak"]["gold"] for p in s["rl_peak"]["per_seed"]]) for s in sizes[:-1])
                        + f" and {span([p['peak']['gold'] for p in sizes[-1]['rl_peak']['per_seed']])}",
    }
    assert {s["peak"]["n"] for s in sizes} == {16} and "peaked at n = 16 in all three" in PROSE
    wrong = {what: phrase for what, phrase in claims.items() if phrase not in PROSE}
    assert not wrong, f"docs/lab.md does not say what docs/figures/lab_rm_sweep.json says: {wrong}"
