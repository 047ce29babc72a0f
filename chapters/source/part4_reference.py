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
# | synced, the reference alone (the control) | base + a frozen adapter copy, which each sync moves towards the policy | 1× + adapter |

# %% [colab]

# %% [preamble]

# %% [setup]
import copy
import tempfile
import time
from dataclasses import dataclass, replace

import torch.nn as nn

from solutions.part0_warmup import completion_logprobs                              # Part 0, solved
from solutions.part1_ppo import completion_slice, kl_exact                          # Part 1, solved
from solutions.part2_lora import (LoRAModel, base_weight, load_adapter, lora_hooks, make_adapters,  # Part 2, solved
                                  save_adapter)
from solutions.part3_grpo import GRPOConfig, GRPOTrainer                           # Part 3, solved
from utils.data import addition_accuracy
from utils.logger import samples_table
from utils.masks import masked_mean
from utils.models import load_model
from utils.sampling import Samples, sample


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
# 2. Re-training an adapter: `"old_adapter"` (below: why not the bare base). Also `"old_adapter"`: a LoRA run
#    synced with `lora_sync="reference_only"` (`sync_every > 0`), whose reference is the base + a frozen copy of
#    the adapter that only the syncs move (section 4 says why an experiment needs it).
# 3. Otherwise `"hooks_removed"` for LoRA, `"frozen_copy"` for full fine-tuning.
# 4. `precomputed` is what the settings ask for.
#
# And it refuses settings that contradict each other, with a `ValueError` that says which: syncing precomputed
# log-probs (the model they came from is gone), re-training an adapter without LoRA, a sync with `alpha` outside
# (0, 1], a negative `beta`, a `lora_sync` that is not one of `LORA_SYNCS`.

# %% [provided] KINDS

# %% [provided] LORA_SYNCS

# %% [provided] ReferenceSettings

# %% [exercise] reference_kind
# marks: difficulty 2 · importance 3 · 40 minutes
# hint: Ask the questions in the order the text gives and return as soon as one decides: a negative `beta` raises, and
#       `beta == 0` returns `("none", False)` before any other check.
# hint: With `beta > 0`, refuse the contradictions next: `retraining_adapter` without `lora`; a `lora_sync` not in
#       `LORA_SYNCS`; and when `sync_every > 0`, `precomputed`, or a `sync_alpha` outside `(0, 1]`.
# hint: Then the kind: `"old_adapter"` when re-training an adapter, or for `lora and sync_every and lora_sync ==
#       "reference_only"`; else `"hooks_removed"` for LoRA and `"frozen_copy"` without. The second element is
#       `settings.precomputed`, passed through.

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
# marks: difficulty 1 · importance 2 · 5 minutes
# hint: A copy that shares no tensor: `copy.deepcopy`, not a new `ModuleDict` around the same modules (that would share
#       every parameter).
# hint: `copy.deepcopy(adapters)`, then `.requires_grad_(False)` on the copy, and return the copy.

# %% [exercise] old_adapter_logprobs
# marks: difficulty 2 · importance 3 · 5 minutes
# hint: The reference is the base with the *old* adapters' hooks on: Part 2's `lora_hooks` builds hooks from any
#       `ModuleDict` of adapters, not only the training ones.
# hint: Inside `with lora_model.base.hooks(fwd_hooks=lora_hooks(lora_model.base, old_adapters)):`, call
#       `completion_logprobs` on `lora_model.base`, not on `lora_model` (whose forward would add the training adapters'
#       hooks as well).

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
# marks: difficulty 2 · importance 2 · 15 minutes
# hint: One list entry per batch of `dataset`, each one `completion_logprobs` call on the right model; the stub's
#       decorator keeps it free of gradients.
# hint: Which model per kind: `"hooks_removed"` is `model.base` (no hooks); `"old_adapter"` is
#       `old_adapter_logprobs(model, model.adapters, batch)` (before training, the current adapter is the old one);
#       `"frozen_copy"` is `model` itself. Any other kind, `"none"` included, raises a `ValueError`.

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
# The policy computes the same function after such a sync, but its LoRA is not the same: the merged part has left
# the adapter for good, so the total update is no longer of rank r and a saved adapter no longer holds the whole
# policy; `B` shrinks (α = 1 sets it to 0, where `A`'s gradient, which goes through `B`, is 0); and Adam's moments
# were built for the `B` before. A merge-sync moves the reference **and restarts the LoRA**. To know what moving the
# reference does on its own, an experiment needs a control that moves the reference alone: keep a frozen copy of
# the adapter as the reference (base + copy, the old-adapter path below) and move that copy at each sync, leaving
# the policy's parameters and the optimizer alone. That is `lora_sync="reference_only"`.
#
# When re-training an adapter, the reference is base + old adapter, and a sync moves the *old adapter* instead
# (`sync_old_adapter`, provided). Mixing its `A` and `B` with the policy's one by one would not do: α·B + (1−α)·B_old
# times α·A + (1−α)·A_old is not α·BA + (1−α)·B_old·A_old. The exact mix is a LoRA of twice the rank — `A` and
# `A_old` stacked, `α·s·B` and `(1−α)·s_old·B_old` side by side — so the old adapter grows by one rank-r adapter
# per sync (α = 1 simply copies the policy's adapter).

# %% [exercise] sync_full
# marks: difficulty 1 · importance 2 · 10 minutes
# hint: Walk the two models' parameters side by side: `zip(reference.parameters(), policy.parameters())` (the same
#       architecture, the same order).
# hint: `p_ref.lerp_(p_pol, alpha)` computes `p_ref + alpha * (p_pol - p_ref)` in place; only the reference's tensors
#       change.

# %% [exercise] sync_lora
# marks: difficulty 2 · importance 3 · 10 minutes
# hint: Per adapter: the base takes `alpha` of the update, `B` keeps the rest, so that base + update is unchanged.
# hint: `delta = alpha * adapter.scale * (adapter.B @ adapter.A)`, added in place to `base_weight(lora_model.base,
#       key)`'s weight, transposed for a weight stored `[d_in, d_out]` (as in Part 2's `merge_lora`).
# hint: Then shrink `B` in place, `adapter.B.mul_(1 - alpha)`, after `delta` was computed from the old `B`.

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
#
# With `track_original=True` it also logs `kl_original`, the KL to the model the run *started* from
# (`kl_to_original`): Part 3's `kl` is measured against the reference of the moment, which a sync moves, so it
# cannot say how far the policy has drifted. `kl_to_original` is the exact KL over the whole vocabulary, averaged
# over completion tokens, not a k3 estimate: no sampling noise, and exactly 0 while the two models agree.

# %% [provided] Reference

# %% [provided] SyncedGRPOTrainer

# %% [provided] kl_to_original

# %%
model = load_model(MODEL)
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
# ## 6. What a saved adapter is after a merge-sync
#
# After a merge-sync part of the update lives in the base weights, and an adapter file holds only `A` and `B`. So
# the saved adapter, loaded onto a fresh copy of the model (what anyone you send it to has), is no longer the
# policy. After a reference-only sync it still is: the policy's parameters were never touched.

# %%
for lora_sync in ("reference_only", "merge"):
    policy = LoRAModel(copy.deepcopy(model), copy.deepcopy(adapters))  # the demo's adapter, "as if trained"
    Reference(ReferenceSettings(beta=0.1, sync_every=1, sync_alpha=0.5, lora_sync=lora_sync), policy).maybe_sync(0)
    with tempfile.TemporaryDirectory() as folder:
        save_adapter(policy.adapters, Path(folder) / "adapter.safetensors")
        fresh = load_model(MODEL)
        reloaded = LoRAModel(fresh, load_adapter(make_adapters(fresh, rank=4, alpha=8.0),
                                                 Path(folder) / "adapter.safetensors"))
    with torch.no_grad():
        gap = (completion_logprobs(reloaded, batch) - completion_logprobs(policy, batch)).abs().max().item()
    print(f"after a {lora_sync} sync (alpha = 0.5), the saved adapter on a fresh model: log-probs off the policy's "
          f"by up to {gap:.3g} nats per token")

# %% [markdown]
# ## 7. The experiment: what moving the reference changes, with a control
#
# GRPO with `beta = 0.1` on the additions of Part 3, three runs from the same model, each over three seeds:
#
# - **static**: the reference is the base, never moved;
# - **merge-sync**: every τ = 10 steps, `sync_lora` with α = 1 (the reference becomes the policy; `B ← 0`);
# - **reference-only sync** (the control): the same τ and α, but the reference is base + a frozen adapter copy and
#   a sync moves only the copy (`sync_old_adapter`); the policy's parameters and Adam's moments are not touched.
#
# Every run logs its held-out accuracy, its KL to the reference of the moment (`kl`, k3, as Part 3 does) and its
# KL to the *original* model (`kl_original`, exact), and at the end the accuracy of its saved adapter on a fresh
# model. The plot shows the mean over seeds and the band from the lowest seed to the highest. The model is
# `GRPOConfig()`'s, the GPT-2-style `"tiny"`, whatever `MODEL` says in the first cell: the settings and every figure
# below are its.

# %% [provided] SYNC_RUNS

# %% [provided] saved_adapter_accuracy

# %% [provided] run_sync_experiment

# %% [provided] last_mean

# %% [provided] summarize_sync_experiment

# %% [provided] plot_sync_experiment

# %%
steps, seeds = (1, [0, 1]) if SMOKE else (100, [0, 1, 2])  # 9 runs: several minutes on a CPU; seeds=[0] for 3
cfg = GRPOConfig(steps=steps, eval_every=max(1, steps if SMOKE else steps // 5), table_every=10**9,
                 **(dict(n_prompts=4, group_size=4) if SMOKE else {}))
start = time.perf_counter()
results = run_sync_experiment(cfg, beta=0.1, seeds=seeds)
print(f"{len(SYNC_RUNS) * len(seeds)} runs in {time.perf_counter() - start:.0f} s")
plot_sync_experiment(results)
figures = summarize_sync_experiment(results)
print(samples_table([{"run": name, **{key: f[key]["seeds"] for key in f}} for name, f in figures.items()]))

# %% [markdown]
# What to conclude. Measured with `python -m solutions.part4_reference` (100 steps, `beta = 0.1`, τ = 10, α = 1,
# seeds 0, 1, 2; held-out accuracy starts at 42.7%; one and two torch threads gave the same figures to the last
# digit); each cell is the mean over the seeds, then the lowest and the highest seed:
#
# | reference | held-out accuracy at the end | KL to the original model (exact, last 5 steps) | KL to the current reference (k3, last 5 steps) | its saved adapter on a fresh model |
# |---|---|---|---|---|
# | static | 83.6% (79.9–85.8) | 0.134 (0.114–0.152) | 0.129 | 83.6% |
# | merge-sync | 87.2% (85.3–88.3) | 0.174 (0.140–0.217) | 0.005 | **42.7%** |
# | reference-only sync (control) | 87.7% (83.1–91.7) | 0.170 (0.136–0.190) | 0.035 | 87.7% |
#
# - **The control ends where the merge-sync ends** (87.7% against 87.2%, well inside each other's seed range), and
#   both end about 4 points above the static reference, which falls behind from step 60 on. So the gain is not an
#   artefact of the LoRA restart that a merge-sync brings with it: moving the reference alone gives it too. But
#   with three seeds it is a hint, not a result: the seed ranges overlap (the static run's best seed, 85.8%, beats
#   the control's worst, 83.1%). The seed alone moves this figure by 3 to 9 points here: do not hunt a bug in your
#   own run for a gap of that size.
# - **Syncing regularises each stretch, not the total drift.** The KL to the reference of the moment drops to
#   0.005–0.035 per token with a sync (0.129 static), while the KL to the *original* model ends higher, 0.17 against
#   0.13 (overlapping ranges again). If drift from the starting model matters to you (fluency, safety), measure it
#   against the starting model, as `kl_original` does here; the `kl` of a synced run does not tell it.
# - **The restart is real, even where the end accuracy hides it.** With the same τ and α, the KL to the current
#   reference climbs about 7× less between two merge-syncs (0.0046 against 0.035 over the last 5 steps; see the
#   sawtooth in the plot): after a merge with α = 1, `B` is 0 and `A`'s gradient with it, so the LoRA starts again
#   from a standstill every τ steps. That is why an experiment on references needs the control.
# - **A merge-sync's adapter file is not the policy.** With α = 1 and a sync after the last step, the whole update
#   sits in the base weights and the saved adapter is empty: on a fresh model it scores exactly the starting
#   model's 42.7%. Keep (or save) the merged base weights too, or sync through a frozen adapter copy.
#
# ## Summary, and testing your whole notebook
#
# Save the notebook, then from the repository's root:
#
# ```bash
# pytest tests/part4_reference --impl chapters/part4_reference.ipynb
# ```
