"""Part 4: the reference model in every form, decided in one place.

The reference solutions of `chapters/part4_reference.ipynb`, in the notebook's order. Run it as a script for the
experiment of the chapter: a static reference, a reference synced every tau steps by merging into the base (which
also restarts the LoRA), and the control, synced by moving a frozen adapter copy (the reference alone), each over
several seeds, with the KL to the original model logged in every run:

    python -m solutions.part4_reference            # GRPO + LoRA with beta > 0 on additions, 3 runs x 3 seeds
    python -m solutions.part4_reference --json     # ... ending with a JSON line of the figures

The cases (the table of ../shared/CURRICULUM.md):

    beta == 0                 no reference and no reference forward pass
    LoRA (hooks)              the same module with the LoRA hooks removed
    full fine-tuning          a frozen copy of the starting weights
    re-training an adapter    the base with a frozen copy of the *old* adapter's hooks
    precomputed               any of the three above, its log-probs computed once over a fixed dataset before
                              training; no reference model (no copy, no old adapter) after that
    synced (TR-DPO style)     every tau steps ref <- alpha * policy + (1 - alpha) * ref (Gorbatovski et al. 2024);
                              with hook-LoRA either merged into the base (lora_sync="merge") or, moving the
                              reference alone, base + a frozen adapter copy that the syncs move ("reference_only")

`reference_kind` decides, in one place, which model the reference is and whether it is precomputed; `Reference`
builds what that answer needs, and every trainer asks it (Part 5's too).
"""

from __future__ import annotations

import copy
import os
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn as nn
from jaxtyping import Float
from torch import Tensor

from solutions.part0_warmup import completion_logprobs
from solutions.part1_ppo import completion_slice, kl_exact
from solutions.part2_lora import LoRAModel, base_weight, load_adapter, lora_hooks, make_adapters, save_adapter
from solutions.part3_grpo import GRPOConfig, GRPOTrainer
from utils.contracts import SEEDS, STEPS, SYNC_ALPHA, a_number, at_least, check_fields, contract
from utils.data import addition_accuracy
from utils.logger import print_figures
from utils.masks import masked_mean
from utils.models import load_model
from utils import cli
from utils.sampling import Samples

# Not exercises: the notebook shows them in full for the learner to read and run.
PROVIDED = ("ReferenceSettings", "sync_old_adapter", "Reference", "SyncedGRPOTrainer", "kl_to_original",
            "saved_adapter_accuracy", "run_sync_experiment", "last_mean", "summarize_sync_experiment",
            "plot_sync_experiment")

KINDS = ("none", "hooks_removed", "frozen_copy", "old_adapter")  # which model the reference is
LORA_SYNCS = ("merge", "reference_only")  # how a hook-LoRA run moves its reference (section 4)


# --- 1. One function decides ---------------------------------------------------------------------------------

@dataclass
class ReferenceSettings:
    """What a training run says about its reference."""

    beta: float                       # KL weight; 0 turns the KL term off
    lora: bool = True                 # hook-LoRA (True) or full fine-tuning (False)
    retraining_adapter: bool = False  # the LoRA starts from an adapter that was already trained
    precomputed: bool = False         # a fixed dataset: reference log-probs computed once, before training
    sync_every: int = 0               # tau: sync the reference every tau steps (0: never)
    sync_alpha: float = 0.0           # alpha: how far each sync moves the reference towards the policy
    lora_sync: str = "merge"          # how a LoRA run syncs (one of LORA_SYNCS): "merge" alpha of the update into the
                                      # base (the reference) and shrink B, or "reference_only": the reference is the
                                      # base + a frozen adapter copy, and a sync moves that copy alone

    # beta and sync_alpha are checked, with how they combine, by reference_kind, the one function that decides
    RULES = {"beta": a_number(), "sync_every": at_least(0, "0 never syncs"), "sync_alpha": a_number()}

    def __post_init__(self):
        check_fields(self)


def reference_kind(settings: ReferenceSettings) -> tuple[str, bool]:
    """The one decision: which model the reference is, and whether its log-probs are computed once, before training,
    over a fixed dataset (precomputed) instead of at every step. kind is "none" when beta == 0 (whatever else is
    set); else "old_adapter" when re-training an adapter, and for a LoRA run with sync_every > 0 and
    lora_sync="reference_only" (its reference is base + a frozen copy of the adapter, which the syncs move); else
    "hooks_removed" for LoRA and "frozen_copy" for full fine-tuning (whose syncs move the reference alone: lora_sync
    does not apply). Precomputing changes when the reference runs, not which model it is.

    Returns: (kind, precomputed): kind one of KINDS; precomputed = settings.precomputed, False for "none".
    Raises: ValueError for a negative beta and, when beta > 0, for settings that contradict each other:
    retraining_adapter without lora; a lora_sync not in LORA_SYNCS; sync_every > 0 with precomputed, or with
    sync_alpha outside (0, 1].
    """
    s = settings
    if s.beta < 0:
        raise ValueError(f"beta must be >= 0, got {s.beta}")
    if s.beta == 0:
        return "none", False
    if s.retraining_adapter and not s.lora:
        raise ValueError("retraining_adapter needs lora=True: an adapter is a LoRA")
    if s.lora_sync not in LORA_SYNCS:
        raise ValueError(f"lora_sync must be one of {LORA_SYNCS}, got {s.lora_sync!r}")
    if s.sync_every:
        if s.precomputed:
            raise ValueError("precomputed reference log-probs cannot be synced: they come from a model that is gone")
        if not 0 < s.sync_alpha <= 1:
            raise ValueError(f"sync_alpha must be in (0, 1] when sync_every > 0, got {s.sync_alpha}")
    if s.retraining_adapter or (s.lora and s.sync_every and s.lora_sync == "reference_only"):
        return "old_adapter", s.precomputed
    return ("hooks_removed" if s.lora else "frozen_copy"), s.precomputed


# --- 2. Re-training an adapter: the reference keeps the old adapter ----------------------------------------------

def frozen_adapter_copy(adapters: nn.ModuleDict) -> nn.ModuleDict:
    """Returns: a copy of the adapters as they are now, with requires_grad=False, sharing no tensor with `adapters`."""
    frozen = copy.deepcopy(adapters)
    frozen.requires_grad_(False)
    return frozen


@torch.no_grad()
def old_adapter_logprobs(lora_model: LoRAModel, old_adapters: nn.ModuleDict, samples: Samples
                         ) -> Float[Tensor, "batch gen"]:
    """Returns: completion log-probs under lora_model.base with the hooks of `old_adapters` on (not the training
    adapters').
    """
    with lora_model.base.hooks(fwd_hooks=lora_hooks(lora_model.base, old_adapters)):
        return completion_logprobs(lora_model.base, samples)


# --- 3. Precomputed reference log-probs ---------------------------------------------------------------------------

@torch.no_grad()
def precompute_reference_logprobs(model, kind: str, dataset: list[Samples]) -> list[Float[Tensor, "batch gen"]]:
    """Before the first update each reference is at hand without a copy: "hooks_removed" is model.base with no hooks;
    "old_adapter" is the base with model.adapters as they are now (old_adapter_logprobs); "frozen_copy" is `model`
    itself (a plain model, not fine-tuned yet).

    Returns: the completion log-probs of each batch of `dataset` under the reference of `kind`, without gradients.
    Raises: ValueError for a kind that is not one of KINDS but "none" ("none" included).
    """
    if kind == "hooks_removed":
        return [completion_logprobs(model.base, batch) for batch in dataset]
    if kind == "old_adapter":
        return [old_adapter_logprobs(model, model.adapters, batch) for batch in dataset]
    if kind == "frozen_copy":
        return [completion_logprobs(model, batch) for batch in dataset]
    raise ValueError(f"kind must be one of {KINDS[1:]} to precompute a reference, got {kind!r}")


# --- 4. Syncing the reference -------------------------------------------------------------------------------------

@torch.no_grad()
@contract(alpha=SYNC_ALPHA)
def sync_full(policy: nn.Module, reference: nn.Module, alpha: float) -> None:
    """Full fine-tuning: move every reference weight alpha of the way to the policy's, in place:
    ref <- alpha * policy + (1 - alpha) * ref. The policy is not changed.

    Returns: None.
    """
    for p_ref, p_pol in zip(reference.parameters(), policy.parameters()):
        p_ref.lerp_(p_pol, alpha)


@torch.no_grad()
@contract(alpha=SYNC_ALPHA)
def sync_lora(lora_model: LoRAModel, alpha: float) -> None:
    """Hook-LoRA, in place: merge alpha * scale * B A into the base weights (base_weight), and shrink B to
    (1 - alpha) B, so that the policy, base + scale * B A, computes exactly what it did before.

    Returns: None.
    """
    for key, adapter in lora_model.adapters.items():
        weight, in_out = base_weight(lora_model.base, key)
        delta = alpha * adapter.scale * (adapter.B @ adapter.A)
        weight += delta.T if in_out else delta
        adapter.B.mul_(1 - alpha)


@torch.no_grad()
@contract(alpha=SYNC_ALPHA)
def sync_old_adapter(old_adapters: nn.ModuleDict, adapters: nn.ModuleDict, alpha: float) -> nn.ModuleDict:
    """Re-training an adapter: the reference is base + old adapter, so move the *old adapter* alpha of the way to
    the policy's adapters, exactly. Its update must become alpha * s B A + (1 - alpha) * s_old B_old A_old, and
    mixing A and B separately would not give that (B A is not linear in A and B together). It is one LoRA of
    rank r + r_old: A = [A; A_old] stacked, B = [alpha * s * B, (1 - alpha) * s_old * B_old] side by side, scale 1.
    So each sync with alpha < 1 adds r to the old adapter's rank (still tiny next to a model); alpha = 1 makes it
    a plain frozen copy of the policy's adapters. Returns the new old adapters, frozen; changes neither input."""
    if alpha == 1:
        return frozen_adapter_copy(adapters)
    mixed = nn.ModuleDict()
    for key, new in adapters.items():
        old = old_adapters[key]
        lora = copy.deepcopy(new)  # a LoRA of the right class and dimensions; its tensors are replaced below
        lora.A = nn.Parameter(torch.cat([new.A, old.A], dim=0))                                  # [r + r_old, d_in]
        lora.B = nn.Parameter(torch.cat([alpha * new.scale * new.B, (1 - alpha) * old.scale * old.B], dim=1))
        lora.scale = 1.0                                                                          # in B already
        mixed[key] = lora
    return mixed.requires_grad_(False)


# --- 5. Everything downstream asks one object -----------------------------------------------------------------------

class Reference:
    """The reference a run decided on (by reference_kind), serving log-probs and counting its forward passes.

    Build it at the start of training, before the first update: for "frozen_copy" it copies the model's weights,
    for "old_adapter" the adapter's; precomputed, it computes the table for `dataset` under the reference of its
    kind and keeps nothing else. The table is looked up by the batch's position in `dataset`.
    """

    def __init__(self, settings: ReferenceSettings, model, dataset: list[Samples] | None = None):
        self.settings = settings
        self.kind, self.precomputed = reference_kind(settings)
        self.model, self.forward_passes = model, 0
        self.copy = self.old_adapters = self.table = self.table_ids = None
        if self.precomputed:
            if dataset is None:
                raise ValueError("a precomputed reference needs the dataset it will be asked about")
            self.table = precompute_reference_logprobs(model, self.kind, dataset)
            self.table_ids = [batch.ids for batch in dataset]  # to refuse a batch that is not the one at its index
        elif self.kind == "frozen_copy":
            self.copy = copy.deepcopy(model).requires_grad_(False)
        elif self.kind == "old_adapter":
            self.old_adapters = frozen_adapter_copy(model.adapters)

    def logprobs(self, samples: Samples, index: int | None = None) -> Tensor | None:
        """Reference log-probs of the samples' completions, or None when there is no reference. A precomputed
        reference needs `index`, the batch's position in the dataset it was built with."""
        if self.kind == "none":
            return None
        if self.precomputed:
            if index is None or not 0 <= index < len(self.table):
                raise ValueError(f"a precomputed reference is looked up by the batch's index in the dataset given at "
                                 f"the start (0 to {len(self.table) - 1}): call logprobs(samples, index=i)")
            if not torch.equal(samples.ids, self.table_ids[index]):
                raise ValueError(f"these samples are not batch {index} of the dataset the table was computed for")
            return self.table[index]
        self.forward_passes += 1
        with torch.no_grad():
            if self.kind == "hooks_removed":
                return completion_logprobs(self.model.base, samples)
            if self.kind == "frozen_copy":
                return completion_logprobs(self.copy, samples)
            return old_adapter_logprobs(self.model, self.old_adapters, samples)

    def maybe_sync(self, step: int) -> bool:
        """Sync after `step` (0-based) if the settings ask for it now; True if it synced."""
        tau, alpha = self.settings.sync_every, self.settings.sync_alpha
        if self.kind == "none" or not tau or (step + 1) % tau:
            return False
        if self.kind == "hooks_removed":
            sync_lora(self.model, alpha)
        elif self.kind == "frozen_copy":
            sync_full(self.model, self.copy, alpha)
        else:  # the reference is base + old adapter: move the old adapter
            self.old_adapters = sync_old_adapter(self.old_adapters, self.model.adapters, alpha)
        return True


class SyncedGRPOTrainer(GRPOTrainer):
    """Part 3's trainer, with its reference decided by `Reference` and synced as the settings say.

    It trains a LoRA, so settings.lora must be True. To re-train an adapter (retraining_adapter=True), pass it as
    `adapters` (an nn.ModuleDict, or a file written by Part 2's save_adapter): it is loaded before the Reference
    is built, so that the reference keeps a frozen copy of it. Precomputed log-probs need a fixed dataset, and
    GRPO samples new completions at every step, so they are refused here (Part 5's DPO precomputes).

    track_original=True keeps a frozen copy of the policy as it starts (base and adapters: 2x the memory) and logs
    "kl_original" at every step: kl_to_original on the step's samples, before its update. The "kl" of Part 3 is to
    the reference of the moment, which a sync moves; this one is to the model the run started from.
    """

    def __init__(self, cfg: GRPOConfig, settings: ReferenceSettings | None = None, model=None,
                 adapters: nn.ModuleDict | str | Path | None = None, track_original: bool = False):
        settings = settings if settings is not None else ReferenceSettings(beta=cfg.beta)
        if not settings.lora:
            raise ValueError("SyncedGRPOTrainer trains a LoRA, so lora=False (full fine-tuning) does not apply: "
                             "Part 1's PPOTrainer fine-tunes every weight, and Reference(settings, model) serves a "
                             "frozen copy for a model of your own")
        if settings.retraining_adapter and adapters is None:
            raise ValueError("retraining_adapter=True needs the adapter to re-train: pass adapters= (a ModuleDict or "
                             "a save_adapter file). Fresh adapters have B = 0, so their 'old adapter' is the bare base")
        if reference_kind(settings)[1]:
            raise ValueError("a precomputed reference needs a fixed dataset, and GRPO samples new completions at "
                             "every step: there is nothing to precompute")
        super().__init__(replace(cfg, beta=settings.beta), model=model, adapters=adapters)
        self.ref = Reference(settings, self.model)
        self.original = copy.deepcopy(self.model).requires_grad_(False) if track_original else None
        self.kl_original = None

    def reference(self, samples: Samples) -> Tensor | None:
        if self.original is not None:  # the step's samples, before its update: where Part 3 measures "kl" too
            self.kl_original = kl_to_original(self.model, self.original, samples)
        return self.ref.logprobs(samples)

    def step(self, step: int) -> dict:
        metrics = super().step(step)
        if self.kl_original is not None:
            metrics["kl_original"], self.kl_original = self.kl_original, None
        metrics["synced"] = float(self.ref.maybe_sync(step))
        return metrics


@torch.no_grad()
def kl_to_original(policy, original, samples: Samples) -> float:
    """The drift from the starting model: the exact KL(policy || original) of the next-token distributions,
    summed over the whole vocabulary (Part 1's kl_exact) at each completion token where samples.completion_mask
    is True, averaged over those tokens. Exact, not k3: no sampling noise, and 0 exactly while the two agree."""
    logits = completion_slice(policy(samples.ids, attention_mask=samples.attention_mask), samples.prompt_len)
    original_logits = completion_slice(original(samples.ids, attention_mask=samples.attention_mask),
                                       samples.prompt_len)
    mask = samples.completion_mask
    return masked_mean(kl_exact(logits, original_logits, mask), mask).item() if mask.any() else 0.0


# --- 6. The experiment: what moving the reference changes, with a control -----------------------------------------
# A merge-sync (sync_lora) moves the reference *and* restarts the LoRA (B shrinks, to 0 with alpha = 1; the merged
# part leaves the adapter; Adam's moments were built for the old B). The control moves the reference alone: the
# reference is the base + a frozen adapter copy, and a sync moves that copy (sync_old_adapter); the policy's
# parameters and the optimizer are not touched. Same tau and alpha in both.

SYNC_RUNS = {"static": dict(),  # ReferenceSettings' fields besides beta, per run; the same tau and alpha in both syncs
             "merge-sync": dict(sync_every=10, sync_alpha=1.0, lora_sync="merge"),
             "reference-only sync": dict(sync_every=10, sync_alpha=1.0, lora_sync="reference_only")}


def saved_adapter_accuracy(trainer: SyncedGRPOTrainer) -> float:
    """Held-out accuracy of the trained adapter saved with save_adapter and loaded onto a fresh copy of the starting
    model: what someone who receives the adapter file gets. It is the policy's accuracy unless a merge-sync moved
    part of the update into the base weights, which the file does not hold."""
    cfg = trainer.cfg
    with tempfile.TemporaryDirectory() as folder:
        save_adapter(trainer.model.adapters, Path(folder) / "adapter.safetensors")
        base = load_model(cfg.model, cfg.device)
        adapters = load_adapter(make_adapters(base, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets),
                                Path(folder) / "adapter.safetensors")
    return addition_accuracy(LoRAModel(base, adapters), trainer.held_out)


def run_sync_experiment(cfg: GRPOConfig, beta: float, seeds: list[int], runs: dict[str, dict] = SYNC_RUNS
                        ) -> dict[str, list[dict]]:
    """Train each run of `runs` (ReferenceSettings fields besides beta) once per seed, from the same model, with
    the KL to the original model tracked. Returns {run: [one result per seed]}, a result being {"seed", "history"
    (the RunLogger's), "saved_adapter_accuracy"}."""
    results = {name: [] for name in runs}
    for seed in seeds:
        for name, fields in runs.items():
            trainer = SyncedGRPOTrainer(replace(cfg, seed=seed), ReferenceSettings(beta=beta, **fields),
                                        track_original=True)
            history = trainer.train().history
            results[name].append({"seed": seed, "history": history,
                                  "saved_adapter_accuracy": saved_adapter_accuracy(trainer)})
    return results


def last_mean(history: list[dict], key: str, k: int = 5) -> float | None:
    """The mean of the last k values of `key` in a history (None if it has none): training batches are noisy."""
    values = [h[key] for h in history if key in h][-k:]
    return sum(values) / len(values) if values else None


def summarize_sync_experiment(results: dict[str, list[dict]]) -> dict:
    """For each run, each figure per seed (in seed order) and its mean: the held-out accuracy at the end, the KL to
    the original model and to the current reference (means of the last 5 steps), and the saved adapter's accuracy
    on a fresh base."""
    def spread(values):
        if any(v is None for v in values):
            return {"seeds": values}
        return {"mean": round(sum(values) / len(values), 4), "min": round(min(values), 4),
                "max": round(max(values), 4), "seeds": [round(v, 4) for v in values]}

    figures = {}
    for name, per_seed in results.items():
        figures[name] = {
            "accuracy_end": spread([[h["accuracy"] for h in r["history"] if "accuracy" in h][-1] for r in per_seed]),
            "kl_original_end": spread([last_mean(r["history"], "kl_original") for r in per_seed]),
            "kl_end": spread([last_mean(r["history"], "kl") for r in per_seed]),
            "saved_adapter_accuracy": spread([r["saved_adapter_accuracy"] for r in per_seed])}
    return figures


def plot_sync_experiment(results: dict[str, list[dict]], path=None):
    """Held-out accuracy, KL to the original model and KL to the current reference of each run: the mean over
    seeds as a line, the band from the lowest to the highest seed around it."""
    import matplotlib.pyplot as plt

    titles = {"accuracy": "held-out accuracy", "kl_original": "KL to the original model, per token (exact)",
              "kl": "KL to the current reference, per token (k3)"}
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.4))
    for (name, per_seed), color in zip(results.items(), plt.rcParams["axes.prop_cycle"].by_key()["color"]):
        for ax, key in zip(axes, titles):
            curves = [dict((h["step"], h[key]) for h in r["history"] if key in h) for r in per_seed]
            steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
            if not steps:
                continue
            values = torch.tensor([[c[s] for s in steps] for c in curves])  # [seeds, steps]
            ax.plot(steps, values.mean(0), color=color, label=f"{name} ({len(per_seed)} seeds)")
            ax.fill_between(steps, values.min(0).values, values.max(0).values, color=color, alpha=0.2)
    for ax, title in zip(axes, titles.values()):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=100)
    return fig


# --- The script -----------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> dict:
    tau, alpha = SYNC_RUNS["merge-sync"]["sync_every"], SYNC_RUNS["merge-sync"]["sync_alpha"]
    parser = cli.ArgumentParser(
        description="GRPO with beta > 0: a static reference, a merge-sync, and a sync that moves only the reference "
                    f"(tau = {tau}, alpha = {alpha:g}), over several seeds.",
        epilog="--steps 0 trains nothing: each run measures the starting model's held-out accuracy, and its "
               "kl_end and kl_original_end, means over training batches, are null.")
    parser.add_argument("--steps", type=cli.at_least(0, STEPS.why),
                        help="default 100 (1 with RLHF_SMOKE=1)")
    parser.add_argument("--beta", type=cli.above(0.0, "with beta 0 there is no reference to sync"), default=0.1)
    parser.add_argument("--seeds", type=cli.at_least(1, SEEDS.why),
                        help="how many seeds (0, 1, ...): default 3 (2 with RLHF_SMOKE=1)")
    parser.add_argument("--plot", default="reference_sync_curves.png", help="where to save the curves ('' for none)")
    parser.add_argument("--json", action="store_true", help="end with one line: a JSON object of the figures")
    args = parser.parse_args(argv)

    smoke = bool(os.environ.get("RLHF_SMOKE"))
    steps = args.steps if args.steps is not None else 1 if smoke else 100
    seeds = list(range(args.seeds if args.seeds is not None else 2 if smoke else 3))
    cfg = GRPOConfig(steps=steps, eval_every=max(1, steps if smoke else steps // 5), table_every=10**9,
                     **(dict(n_prompts=4, group_size=4) if smoke else {}))
    start = time.perf_counter()
    results = run_sync_experiment(cfg, args.beta, seeds)
    figures = {"beta": args.beta, "steps": steps, "seeds": seeds, "tau": tau, "alpha": alpha,
               **summarize_sync_experiment(results), "seconds": round(time.perf_counter() - start, 1)}
    if args.plot:
        plot_sync_experiment(results, path=args.plot)
    print_figures(figures, args.json)
    return figures


if __name__ == "__main__":
    main()
