# %% [markdown]
# # Part 4 — The reference model, in every form
#
# {colab_badge}
#
# Every method so far penalised the distance to a **reference model** with a KL term. "The reference" has taken
# several forms already; this chapter lists them all, puts the choice **in one function**, and measures what
# moving the reference during training (syncing it, as TR-DPO does) changes.
#
# | case | reference is | memory |
# |---|---|---|
# | `beta == 0` | none: no reference forward pass at all | 1× |
# | LoRA (hooks) | the same module with the LoRA hooks removed | 1× |
# | full fine-tuning | a frozen copy of the starting weights | 2× |
# | re-training an existing adapter | the base with a frozen copy of the *old* adapter's hooks | 1× + adapter |
# | precomputed | the log-probs of one of the three above, computed once before training; then no reference model | 1× |
# | periodically synced (TR-DPO) | every τ steps `ref ← α·policy + (1−α)·ref` | as its base case |

# %% [colab]

# %% [setup]
import copy
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn as nn
from jaxtyping import Float
from torch import Tensor

ROOT = Path.cwd().parent if Path.cwd().name == "chapters" else Path.cwd()
if not (ROOT / "utils" / "harness.py").exists():
    raise RuntimeError(f"The course's code (utils/, solutions/) is not in {ROOT}. On Colab, run the first cell: it "
                       "fetches the course, or says why it could not. Elsewhere, start Jupyter in the repository: "
                       "jupyter lab chapters/")
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from solutions.part0_warmup import completion_logprobs                              # Part 0, solved
from solutions.part2_lora import LoRAModel, base_weight, lora_hooks, make_adapters  # Part 2, solved
from solutions.part3_grpo import GRPOConfig, GRPOTrainer                           # Part 3, solved
from utils.harness import check
from utils.logger import samples_table
from utils.models import load_model
from utils.sampling import Samples, sample

SMOKE = bool(os.environ.get("RLHF_SMOKE"))  # set by the test suite: keeps the training cells short

# %% [markdown]
# ## 1. One function decides
#
# A run's settings say what it needs: `beta`, LoRA or full fine-tuning, whether it re-trains an adapter, whether
# the reference log-probs are precomputed, whether (and how) the reference is synced. `reference_kind` turns them
# into one answer, `(kind, precomputed)`, and nothing downstream decides again. `kind`, one of `KINDS`, is *which
# model* the reference is; `precomputed` is *when* it runs: at every step, or once over a fixed dataset before
# training. The two are separate questions — a precomputed table is still the log-probs of some model, and it must
# be the right one. The order of the questions matters:
#
# 1. `beta == 0`: `("none", False)`, whatever else is set — there is no KL term, so any reference computation
#    (a precomputed table included) is waste.
# 2. Re-training an adapter: `"old_adapter"` (below: why not the bare base).
# 3. Otherwise `"hooks_removed"` for LoRA, `"frozen_copy"` for full fine-tuning.
# 4. `precomputed` is what the settings ask for.
#
# And it refuses settings that contradict each other, with a `ValueError` that says which: syncing precomputed
# log-probs (the model they came from is gone), re-training an adapter without LoRA, a sync with `alpha` outside
# (0, 1], a negative `beta`.

# %% [provided] KINDS

# %% [provided] ReferenceSettings

# %% [exercise] reference_kind

# %% [markdown]
# ## 2. Re-training an adapter
#
# Say an adapter was trained yesterday (SFT, or an earlier RL run), and today's RL run continues training it.
# The KL term's job is to keep *this run* near where *this run* started: base **plus the old adapter**. Using the
# bare base instead would pull the policy back towards the model before the adapter — undoing yesterday's
# training, and charging a large KL from step 0 for behaviour that was the starting point.
#
# So at the start, take a **frozen copy** of the adapter (`frozen_adapter_copy`: it must not share tensors with
# the adapter that trains on), and compute reference log-probs with *its* hooks on the base
# (`old_adapter_logprobs`). It costs one adapter's memory, not a model's.

# %% [exercise] frozen_adapter_copy

# %% [exercise] old_adapter_logprobs

# %% [markdown]
# ## 3. Precomputed reference log-probs
#
# When the data is fixed — DPO's preference pairs, a supervised dataset — the reference log-probs of every example
# can be computed **once**, before training, and the reference model then need not exist at all (TRL's
# `precompute_ref_log_probs`): no frozen copy, no old adapter, just a table.
#
# The table must hold the log-probs of the reference the run would otherwise use — the `kind` decided above. Before
# the first update, each is at hand without making a copy: for `"hooks_removed"` the base with the adapter
# **off**; for `"old_adapter"` the base with the adapter as it is now (until training starts it *is* the old
# adapter; computing it from the bare base instead would make the KL pull the policy away from where it starts);
# for `"frozen_copy"` the plain model itself, not yet fine-tuned. Compute them without gradients.

# %% [exercise] precompute_reference_logprobs

# %% [markdown]
# ## 4. Syncing the reference
#
# TR-DPO (Gorbatovski et al. 2024, "Learn your reference model for real good alignment") updates the reference
# during training: every τ steps, `ref ← α·policy + (1−α)·ref` (α = 1 replaces it). The policy may then drift
# further from the *original* model, while staying near a recent version of itself.
#
# With full fine-tuning that is a weight mix, `sync_full` (`Tensor.lerp_` does it in place). The policy must not
# change.
#
# With hook-LoRA the reference *is* the base, and the policy is base + `scale·B·A`. Moving the base α of the way
# means adding `α·scale·B·A` to the base weights (Part 2's merge, of a fraction). For the policy not to change, the
# adapter must now carry only the rest: `B ← (1−α)·B`. Check: base + α·s·BA + s·(1−α)BA = base + s·BA.
#
# When re-training an adapter, the reference is base + old adapter, and a sync moves the *old adapter* instead
# (`sync_old_adapter`, provided). Mixing its `A` and `B` with the policy's one by one would not do: α·B + (1−α)·B_old
# times α·A + (1−α)·A_old is not α·BA + (1−α)·B_old·A_old. The exact mix is a LoRA of twice the rank — `A` and
# `A_old` stacked, `α·s·B` and `(1−α)·s_old·B_old` side by side — so the old adapter grows by one rank-r adapter
# per sync (α = 1 simply copies the policy's adapter).

# %% [exercise] sync_full

# %% [exercise] sync_lora

# %% [provided] sync_old_adapter

# %% [markdown]
# ## 5. Everything downstream asks one object
#
# `Reference` is built once from the settings: it calls `reference_kind`, prepares what the answer needs (a copy, a
# frozen old adapter, or a table and nothing else), serves `logprobs(samples)` (or `None`; a table is looked up by
# the batch's index in its dataset, and refuses a batch that is not the one at that index), syncs when the
# settings say so, and counts its forward passes. `SyncedGRPOTrainer` is Part 3's trainer with its one
# `reference(samples)` method pointed at it. It trains a LoRA, so it refuses `lora=False`; to re-train an adapter,
# give it the adapter (`adapters=`, a `ModuleDict` or a `save_adapter` file), which it loads *before* the
# `Reference` takes its frozen copy. Part 5's trainers ask the same `Reference`.

# %% [provided] Reference

# %% [provided] SyncedGRPOTrainer

# %%
model = load_model("tiny")
torch.manual_seed(0)
adapters = make_adapters(model, rank=4, alpha=8.0)
with torch.no_grad():
    for a in adapters.values():
        a.B.normal_(0, 0.1)  # as if trained
lora_model = LoRAModel(model, adapters)
batch = sample(lora_model, ["12+34=", "This is", "The"], max_new_tokens=8)
rows = []
for settings, policy in [(ReferenceSettings(beta=0.0), lora_model), (ReferenceSettings(beta=0.1), lora_model),
                         (ReferenceSettings(beta=0.1, retraining_adapter=True), lora_model),
                         (ReferenceSettings(beta=0.1, precomputed=True), lora_model),
                         (ReferenceSettings(beta=0.1, precomputed=True, retraining_adapter=True), lora_model),
                         (ReferenceSettings(beta=0.1, lora=False), model)]:  # full fine-tuning: the plain model
    r = Reference(settings, policy, dataset=[batch])
    lp = r.logprobs(batch, index=0)
    rows.append({"settings": str({k: v for k, v in vars(settings).items() if v}), "kind": r.kind,
                 "precomputed": r.precomputed, "ref log-prob of the batch": None if lp is None else lp.sum().item(),
                 "forward passes": r.forward_passes})
print(samples_table(rows, max_chars=70))

# %% [markdown]
# The precomputed rows match the live ones of the same kind: the old-adapter reference gives the same numbers
# whether it runs every step or once before training, and neither is the bare base's.

# %% [markdown]
# ## 6. The experiment: a static reference against synced ones
#
# GRPO with `beta = 0.1` on the additions of Part 3, four runs of the same seed: a static reference, and references
# synced every τ steps with α = 0.5 or 1. The KL plotted is to the reference *of the moment*. Each run takes about
# a minute on 2 CPU cores.

# %% [provided] plot_sync_experiment

# %%
steps = 4 if SMOKE else 120
cfg = GRPOConfig(steps=steps, eval_every=max(1, steps // 6), table_every=10**9)
runs = {"static": (0, 0.0), "tau=10, alpha=0.5": (10, 0.5), "tau=10, alpha=1": (10, 1.0)}
histories = {}
for name, (tau, alpha) in runs.items():
    trainer = SyncedGRPOTrainer(cfg, ReferenceSettings(beta=0.1, sync_every=tau, sync_alpha=alpha))
    histories[name] = trainer.train().history
plot_sync_experiment(histories)
print(samples_table([{"run": name, "final accuracy": [h["accuracy"] for h in hist if "accuracy" in h][-1],
                      "mean KL, last 10 steps": sum(h["kl"] for h in hist[-11:-1]) / 10 if not SMOKE else float("nan")}
                     for name, hist in histories.items()]))

# %% [markdown]
# What to conclude. Measured with `python -m solutions.part4_reference` (one seed, 120 steps, `beta = 0.1`; the
# script also runs τ = 30, α = 1):
#
# | reference | held-out accuracy at the end | KL to the current reference, last 5 steps |
# |---|---|---|
# | static | 85.7% | 0.202 per token |
# | τ = 10, α = 0.5 | 86.7% | 0.005 |
# | τ = 10, α = 1 | 88.0% | 0.005 |
# | τ = 30, α = 1 | 88.0% | 0.012 |
#
# - With a static reference, the KL grows as the policy improves and the penalty holds it back: in the middle of
#   the run (step 80) it was at 74% where the synced runs were at 84–86%, and it ended a point or two behind:
#   `beta = 0.1` is a mild brake on this task.
# - A synced reference resets the distance every τ steps, so the KL *it* reports stays 17–41× smaller. That number
#   no longer says how far the policy is from the model you started with: syncing regularises each stretch of
#   training, not the total drift. If drift from the original matters to you (fluency, safety), keep a static
#   reference, or log the KL to the original model separately.
# - One seed, one task: rerun with `--seed 1`, `2` before trusting a difference of a point or two.
#
# ## Summary, and testing your whole notebook
#
# Save the notebook, then from the repository's root:
#
# ```bash
# pytest tests/test_part4_reference.py --impl chapters/part4_reference.ipynb
# ```
