"""Part 6: the lab. Experiments, small enough for a laptop, that show why the knobs of RLHF exist.

The reference solutions of `chapters/part6_lab.ipynb`, one module per experiment, in the notebook's order. A module
holds its experiment's exercises (and the short pieces the notebook shows as provided), then the experiment itself,
which runs on them:

    kl_gradients     exact KL gradients over every two-token completion, against each estimator used as a loss
    hacking          a learned reward model over-optimised against the exact verifier; a buggy verifier; the
                     beta sweep
    length_bias      completion lengths of right and wrong answers under each loss aggregation
    policy_shift     what RL changed, seen through hooks: per-token log-ratios, the LoRA block by block, attention
    off_policy       num_iterations and the clip; sampler-vs-trainer log-probs; a sweep of sampler lag x
                     correction (none, token-level TIS, TRL's sequence mask, the sampler as PPO's old policy)

Each experiment module has the same three entry points:

    run(seeds, smoke=False, *, <each exercise it runs on>=<the module's own>, <its settings>=None) -> result
    summarize(result) -> dict        the figures (JSON-ready) that `python -m solutions.part6_lab` prints
    plot(result, path=None) -> Figure

The notebook passes the learner's exercises to run() by name (a misspelt name is a TypeError, never a silent run of
the reference). Every exercise and provided piece is importable from here too (solutions.part6_lab.two_token_logprobs).
Run the package as a script for every experiment with its defaults (at most 10 minutes on 2 CPU cores):

    python -m solutions.part6_lab                 # all five experiments, 3 seeds each, plots in lab_*.png
    python -m solutions.part6_lab --json          # ... ending with a JSON line of the figures
    python -m solutions.part6_lab --only kl_gradients hacking
    python -m solutions.part6_lab --rm-pairs-per-prompt 1 2 4   # hacking's data sweep: 3 reward models, trained
                                                                # on 1, 2, 4 pairs of each of the same 300 prompts
    python -m solutions.part6_lab --leash         # beta against early stopping at matched KL, over 10 seeds
"""

from __future__ import annotations

import importlib
import os
import time
from dataclasses import replace

from solutions.part6_lab.hacking import (bradley_terry_loss, last_token_scores,  # noqa: F401 (re-exported)
                                         reward_every_number_right, reward_model_batch, reward_model_scores)
from solutions.part6_lab.kl_gradients import (FIRST_TOKENS_IN_RANGE, FIRST_TOKENS_IN_VOCABULARY,  # noqa: F401
                                              KL_ESTIMATORS, KL_LOSSES, ROOM_FOR_TWO_TOKENS, estimator_surrogate,
                                              exact_sequence_kls, token_kl_estimate, two_token_logprobs)
from solutions.part6_lab.length_bias import (LOSS_TYPES, loss_token_weights,  # noqa: F401 (re-exported)
                                             mean_length_by_outcome, reward_positive_answer)
from solutions.part6_lab.off_policy import (clip_fraction, expected_grpo_objective,  # noqa: F401 (re-exported)
                                            sequence_mask_weights, tis_grpo_loss, truncated_importance_weights)
from solutions.part6_lab.policy_shift import (answer_attention, lora_on_blocks,  # noqa: F401 (re-exported)
                                              token_log_ratios)
from utils import cli
from utils.contracts import SEEDS
from utils.logger import print_figures

# What the notebook shows as [provided] code; every other function here is an exercise
PROVIDED = ("exact_sequence_kls", "reward_model_batch", "reward_every_number_right", "reward_positive_answer",
            "sequence_mask_weights")

EXPERIMENTS = ("kl_gradients", "hacking", "length_bias", "policy_shift", "off_policy")


def main(argv: list[str] | None = None) -> dict:
    parser = cli.ArgumentParser(
        prog="python -m solutions.part6_lab",
        description="The lab: exact KL gradients, reward over-optimisation, length bias, the policy shift seen "
                    "through hooks, and on- vs off-policy updates, each over several seeds.")
    parser.add_argument("--only", nargs="+", choices=EXPERIMENTS, help="run only these experiments")
    parser.add_argument("--seeds", type=cli.at_least(1, SEEDS.why),
                        help="how many seeds (0, 1, ...): default 3 (2 with RLHF_SMOKE=1)")
    parser.add_argument("--plots", default="lab", help="prefix of the saved figures, e.g. lab_hacking.png "
                                                       "('' for none)")
    parser.add_argument("--json", action="store_true", help="end with one line: a JSON object of the figures")
    parser.add_argument("--rm-pairs-per-prompt", type=cli.at_least(1), nargs="+", metavar="PAIRS",
                        help="instead of the experiments: best-of-n and GRPO against reward models trained on this "
                             "many pairs per prompt each, e.g. 1 2 4, of the same prompts for the same number of "
                             "steps (hacking's data sweep: several minutes)")
    parser.add_argument("--leash", action="store_true",
                        help="instead of the experiments: beta against early stopping at matched KL, the KL term in "
                             "the loss and in the reward, at two learning rates, over 10 seeds (--seeds to change; "
                             "about 10 minutes on 2 cores)")
    args = parser.parse_args(argv)
    instead = [flag for flag, given in (("--leash", args.leash), ("--rm-pairs-per-prompt", args.rm_pairs_per_prompt),
                                        ("--only", args.only)) if given]
    if len(instead) > 1:
        parser.error(f"{' and '.join(instead)} choose different runs: give one of them")

    smoke = bool(os.environ.get("RLHF_SMOKE"))
    if args.leash:
        from solutions.part6_lab.hacking import HackingConfig, LeashConfig, leash_figures, run_leash
        leash = LeashConfig.smoke() if smoke else LeashConfig()
        leash = replace(leash, seeds=args.seeds) if args.seeds is not None else leash
        start = time.perf_counter()
        figures = {"smoke": smoke, "leash": leash_figures(run_leash(leash, HackingConfig.smoke() if smoke else None))}
        figures["leash_seconds"] = round(time.perf_counter() - start, 1)
        print_figures(figures, args.json)
        return figures
    seeds = list(range(args.seeds if args.seeds is not None else 2 if smoke else 3))
    figures: dict = {"seeds": seeds, "smoke": smoke}
    if args.rm_pairs_per_prompt:
        from solutions.part6_lab.hacking import HackingConfig, SweepConfig, rm_sizes_figures
        figures.update(rm_sizes_figures(seeds, args.rm_pairs_per_prompt, HackingConfig.smoke() if smoke else None,
                                        SweepConfig.smoke() if smoke else None))
        print_figures(figures, args.json)
        return figures
    start = time.perf_counter()
    for name in args.only or EXPERIMENTS:
        experiment = importlib.import_module(f"{__name__}.{name}")
        began = time.perf_counter()
        result = experiment.run(seeds, smoke)
        summary = experiment.summarize(result)
        # an experiment that reports under several top-level keys (policy_shift: also "layer_ablation") names itself
        figures.update(summary if name in summary else {name: summary})
        figures[f"{name}_seconds"] = round(time.perf_counter() - began, 1)
        if args.plots:
            experiment.plot(result, path=f"{args.plots}_{name}.png")
    figures["seconds"] = round(time.perf_counter() - start, 1)
    print_figures(figures, args.json)
    return figures
