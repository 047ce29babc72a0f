"""Part 2: LoRA written by hand as forward hooks; the reference model is the same module with the hooks removed.

The reference solutions of `chapters/part2_lora.ipynb`, in the notebook's order. Run it as a script to train
Part 1's PPO with LoRA instead of full fine-tuning:

    python -m solutions.part2_lora                    # the embedded tiny model on CPU
    python -m solutions.part2_lora --preset gpt2      # GPT-2 small on a GPU (e.g. Colab)
    python -m solutions.part2_lora --json             # ... ending with a JSON line of the figures

LoRA (Hu et al. 2021): a frozen weight W gets a trainable low-rank update, W + (alpha / r) * B A, with A of shape
[r, d_in] initialised Kaiming-uniform and B of shape [d_out, r] initialised to zeros, so that training starts
from the unchanged model. The initialisation and the alpha / r scaling are those of the `peft` library's LoRA.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, no_type_check

import torch
import torch.nn as nn
from jaxtyping import Float
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor

from solutions.part0_warmup import completion_logprobs
from solutions.part1_ppo import PPOConfig, PPOTrainer
from utils.models import count_parameters, load_model
from utils.logger import print_figures
from utils.plotting import plot_curves
from utils import cli
from utils.contracts import LORA_ALPHA, PHASES, at_least, contract, nonempty, not_a_folder
from utils.files import why_unreadable
from utils.sampling import Samples

# Not exercises: the notebook shows them in full for the learner to read and run.
PROVIDED = ("available_targets", "make_adapters", "base_weight", "LoRAModel", "ppo_with_lora")

# Where each adaptable projection reads its input and writes its output, per block (TransformerLens 4 names): every
# projection the bridge wraps has a hook point on its input and one on its output. q, k and v write per-head
# [batch, pos, head, d_head] (on a model with grouped-query attention, k and v have fewer heads than q); o reads the
# per-head z. "mlp_gate" exists only on a gated MLP (Llama-style: down(silu(gate(x)) * up(x)), with "mlp_in" the up
# projection and "mlp_out" the down one).
TARGETS = {
    "q": ("attn.q.hook_in", "attn.q.hook_out"),
    "k": ("attn.k.hook_in", "attn.k.hook_out"),
    "v": ("attn.v.hook_in", "attn.v.hook_out"),
    "o": ("attn.o.hook_in", "attn.o.hook_out"),
    "mlp_gate": ("mlp.gate.hook_in", "mlp.gate.hook_out"),
    "mlp_in": ("mlp.in.hook_in", "mlp.in.hook_out"),
    "mlp_out": ("mlp.out.hook_in", "mlp.out.hook_out"),
}


def available_targets(model) -> tuple[str, ...]:
    """The targets of TARGETS that `model` has: all but "mlp_gate" on GPT-2, all of them on a Llama-style model."""
    return tuple(t for t in TARGETS if f"blocks.0.{TARGETS[t][1]}" in model.hook_dict)


# --- 1. The LoRA module --------------------------------------------------------------------------------------

class LoRA(nn.Module):
    """A low-rank update of one linear map. Attributes A: [rank, d_in], Kaiming-uniform (nn.Linear's init,
    a=math.sqrt(5)); B: [d_out, rank], zeros; scale = alpha / rank.

    Returns (forward): scale * x A^T B^T, [..., d_in] -> [..., d_out].
    """

    @contract(rank=at_least(1), alpha=LORA_ALPHA)
    def __init__(self, d_in: int, d_out: int, rank: int = 8, alpha: float = 16.0):
        super().__init__()
        self.A = nn.Parameter(torch.empty(rank, d_in))
        self.B = nn.Parameter(torch.zeros(d_out, rank))
        nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))
        self.scale = alpha / rank

    def forward(self, x: Float[Tensor, "... d_in"]) -> Float[Tensor, "... d_out"]:
        return (x @ self.A.T) @ self.B.T * self.scale


@contract(rank=at_least(1), alpha=LORA_ALPHA, targets=nonempty("with no target there is nothing to train"))
def make_adapters(model, rank: int = 8, alpha: float = 16.0, targets: tuple[str, ...] = ("q", "k", "v", "o"),
                  ) -> nn.ModuleDict:
    """One LoRA per block and target, keyed "L{layer}_{target}" (e.g. "L0_q"), on the model's device. Each one's
    d_in and d_out are those of the projection it updates: with grouped-query attention k and v are narrower than q."""
    unknown = set(targets) - set(TARGETS)
    if unknown:
        raise ValueError(f"unknown LoRA targets {sorted(unknown)}; choose from {list(available_targets(model))}")
    missing = set(targets) - set(available_targets(model))
    if missing:
        raise ValueError(f"this model has no {', '.join(sorted(missing))} projection (its MLP is not gated); choose "
                         f"from {list(available_targets(model))}")
    adapters = nn.ModuleDict()
    for layer in range(model.cfg.n_layers):
        for t in targets:
            module = model.blocks[layer].get_submodule(TARGETS[t][0].removesuffix(".hook_in")).original_component
            # nn.Linear stores its weight [d_out, d_in]; GPT-2's Conv1D stores [d_in, d_out]
            d_in, d_out = ((module.in_features, module.out_features) if isinstance(module, nn.Linear)
                           else module.weight.shape)
            adapters[f"L{layer}_{t}"] = LoRA(d_in, d_out, rank=rank, alpha=alpha)
    return adapters.to(model.cfg.device)


# --- 2. LoRA as forward hooks --------------------------------------------------------------------------------

def lora_hooks(model, adapters: nn.ModuleDict) -> list[tuple[str, Callable]]:
    """For adapter "L{layer}_{target}": a hook on blocks.{layer}.{TARGETS[target][0]} (the projection's input) keeps
    the input, and one on blocks.{layer}.{TARGETS[target][1]} (its output) adds adapter(input); per-head inputs are
    flattened to [..., n_heads * d_head] for the adapter, and its update is reshaped to the output's shape.

    Returns: the (hook_name, hook_fn) pairs, two per adapter.
    """
    hooks = []
    for key, adapter in adapters.items():
        layer, target = key[1:].split("_", 1)
        in_name, out_name = (f"blocks.{layer}.{suffix}" for suffix in TARGETS[target])
        stash: dict[str, Tensor] = {}

        @no_type_check  # called twice per adapter per forward pass: too hot for run-time shape checks
        def keep_input(x: Tensor, hook, stash=stash) -> None:
            stash["x"] = x.flatten(-2) if x.dim() == 4 else x  # [batch, pos, head, d_head] -> [batch, pos, d]

        @no_type_check
        def add_update(out: Tensor, hook, stash=stash, adapter=adapter) -> Tensor:
            return out + adapter(stash.pop("x")).view(out.shape)

        hooks += [(in_name, keep_input), (out_name, add_update)]
    return hooks


class LoRAModel(nn.Module):
    """The base model with its LoRA adapters applied by hooks on every forward pass and in `generate`.

    It holds no copy of the weights: `self.base` is the base model itself, so the reference model is
    `self.base` called directly, with no hooks. It quacks like the base model (cfg, tokenizer, hooks, generate),
    so that Part 1's PolicyWithValueHead, `sample` and PPOTrainer take it as it is.
    """

    def __init__(self, base, adapters: nn.ModuleDict):
        super().__init__()
        for key in adapters:
            base_weight(base, key)  # refuses a key that names no weight of this model
        self.base, self.adapters = base, adapters

    @property
    def cfg(self):
        return self.base.cfg

    @property
    def tokenizer(self):
        return self.base.tokenizer

    def adapted(self):
        """A context manager in which the base model runs with the LoRA hooks."""
        return self.base.hooks(fwd_hooks=lora_hooks(self.base, self.adapters))

    def forward(self, tokens, attention_mask=None):
        with self.adapted():
            return self.base(tokens, attention_mask=attention_mask)

    def generate(self, *args, **kwargs):
        with self.adapted():
            return self.base.generate(*args, **kwargs)

    def weight_updates(self) -> dict[str, Tensor]:
        """What the hooks add to each adapted weight, as {"blocks.{layer}.{module}": [d_in, d_out] matrix}.

        An adapter is linear, so its matrix is its output on the identity (row i: the image of basis vector i).
        `utils.sampling.sample` merges these into a copy of the weights and decodes without hooks, which is the
        same function, in far fewer operations per token.
        """
        updates = {}
        for key, adapter in self.adapters.items():
            layer, target = key[1:].split("_", 1)
            module = TARGETS[target][0].removesuffix(".hook_in")  # "attn.q.hook_in" -> "attn.q"
            eye = torch.eye(adapter.A.shape[1], device=adapter.A.device, dtype=adapter.A.dtype)
            updates[f"blocks.{layer}.{module}"] = adapter(eye).detach()
        return updates

    def hooks(self, *args, **kwargs):
        return self.base.hooks(*args, **kwargs)  # more hooks (e.g. a value head's); forward adds the LoRA ones

    def reset_hooks(self):
        self.base.reset_hooks()


# --- 3. The reference model: the same module, without the hooks --------------------------------------------------

def policy_and_reference_logprobs(
    lora_model: LoRAModel,
    samples: Samples,
) -> tuple[Float[Tensor, "batch gen"], Float[Tensor, "batch gen"]]:
    """Returns: (policy, reference) completion log-probs (completion_logprobs): under lora_model, and under
    lora_model.base run with no hooks (the reference: the same weights, no second copy).
    """
    logprobs = completion_logprobs(lora_model, samples)
    ref_logprobs = completion_logprobs(lora_model.base, samples)
    return logprobs, ref_logprobs


# --- 4. Freezing ------------------------------------------------------------------------------------------------

def freeze_base(model, adapters: nn.ModuleDict) -> tuple[int, int]:
    """Sets requires_grad=False on every base-model parameter and requires_grad=True on every adapter parameter.

    Returns: (trainable parameters, total parameters of the base model), as utils.models.count_parameters counts.
    """
    model.requires_grad_(False)
    adapters.requires_grad_(True)
    return count_parameters(adapters), count_parameters(model)


# --- 5. Merge and unmerge ---------------------------------------------------------------------------------------

def base_weight(model, key: str) -> tuple[nn.Parameter, bool]:
    """The base weight that adapter `key` updates, and whether it is stored [d_in, d_out] (GPT-2's Conv1D)
    rather than [d_out, d_in] (nn.Linear). Raises a ValueError for a key that names no weight of this model."""
    layer, _, target = key[1:].partition("_")
    if not (key.startswith("L") and layer.isdigit() and int(layer) < model.cfg.n_layers and target in TARGETS):
        raise ValueError(f"adapter key {key!r} names no weight of this model: keys are 'L<layer>_<target>' with a "
                         f"layer from 0 to {model.cfg.n_layers - 1} and a target in {list(TARGETS)}, as "
                         "make_adapters(model, ...) names them")
    if target not in available_targets(model):
        raise ValueError(f"adapter key {key!r} names a {target} projection, which this model does not have: its "
                         f"targets are {list(available_targets(model))}")
    module = model.blocks[int(layer)].get_submodule(TARGETS[target][0].removesuffix(".hook_in")).original_component
    return module.weight, not isinstance(module, nn.Linear)


@torch.no_grad()
def merge_lora(model, adapters: nn.ModuleDict, sign: float = 1.0) -> None:
    """Fold each adapter into its base weight (base_weight(model, key)), in place: W <- W + sign * scale * (B A),
    transposed for a weight stored [d_in, d_out]. sign=-1 takes the update out again.

    Returns: None.
    Raises: ValueError (from base_weight) for an adapter key that names no weight of the model.
    """
    for key, adapter in adapters.items():
        weight, in_out = base_weight(model, key)
        delta = adapter.scale * (adapter.B @ adapter.A)  # [d_out, d_in]
        weight += sign * (delta.T if in_out else delta)


def unmerge_lora(model, adapters: nn.ModuleDict) -> None:
    """Returns: None; takes the adapters' updates out of the base weights again (to float rounding)."""
    merge_lora(model, adapters, sign=-1.0)


# --- 6. Saving and loading an adapter ---------------------------------------------------------------------------

@contract(path=not_a_folder("save_adapter writes one file: name it inside the folder, e.g. folder/adapter.safetensors"))
def save_adapter(adapters: nn.ModuleDict, path: str | Path) -> None:
    """Writes the adapters' state_dict (A and B tensors) to a safetensors file, with "rank" and "alpha" (= scale *
    rank, as strings) in its metadata, creating the missing folders of `path`.

    Returns: None.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    first = next(iter(adapters.values()))
    rank = first.A.shape[0]
    tensors = {name: p.detach().cpu().contiguous() for name, p in adapters.state_dict().items()}
    save_file(tensors, str(path), metadata={"rank": str(rank), "alpha": str(first.scale * rank)})


def load_adapter(adapters: nn.ModuleDict, path: str | Path) -> nn.ModuleDict:
    """Load a file written by save_adapter into `adapters`; nothing is loaded if it raises. Open it with safe_open
    inside a try, never with torch.load (which unpickles, so can run code).

    Returns: `adapters`.
    Raises: FileNotFoundError if nothing is at `path`; IsADirectoryError if it is a folder; a ValueError naming the
    file if it is not a safetensors file (empty, truncated, random bytes, torch.save), if its metadata lacks rank or
    alpha or they differ from the adapters', or if its tensors do not fit (missing, unexpected, wrong shapes).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no adapter file at {path}: check the path (relative paths start from "
                                f"{Path.cwd()}), or write one first with save_adapter(adapters, path)")
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a folder, not an adapter file: pass the path of the .safetensors file "
                                "that save_adapter wrote, inside it")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as error:  # safetensors' own messages ("header too large") name neither the file nor the cause
        raise ValueError(f"adapter file {path} cannot be read as a safetensors file: "
                         f"{why_unreadable(path, error)}") from error
    if "rank" not in meta or "alpha" not in meta:
        raise ValueError(f"adapter file {path} has no rank and alpha in its metadata, so its scale is unknown: "
                         "load files written by save_adapter")
    rank, alpha = int(meta["rank"]), float(meta["alpha"])
    for key, adapter in adapters.items():
        own_rank = adapter.A.shape[0]
        if own_rank != rank or not math.isclose(adapter.scale * own_rank, alpha):
            raise ValueError(f"adapter file {path} was saved with rank {rank} and alpha {alpha:g}, but adapter {key} "
                             f"has rank {own_rank} and alpha {adapter.scale * own_rank:g}: build the adapters with "
                             f"make_adapters(model, rank={rank}, alpha={alpha:g}, ...) before loading")
    tensors = load_file(str(path), device=str(next(adapters.parameters()).device))
    expected = {name: tuple(p.shape) for name, p in adapters.state_dict().items()}
    found = {name: tuple(t.shape) for name, t in tensors.items()}
    if expected != found:
        missing, extra = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
        wrong = sorted(n for n in set(expected) & set(found) if expected[n] != found[n])
        raise ValueError(f"adapter file {path} does not fit these adapters: missing {missing}, unexpected {extra}, "
                         f"wrong shapes {wrong}. Build the adapters with the same targets and rank.")
    adapters.load_state_dict(tensors)
    return adapters


# --- 7. PPO with LoRA --------------------------------------------------------------------------------------------

def ppo_with_lora(cfg: PPOConfig, rank: int = 8, alpha: float = 16.0, targets: tuple[str, ...] = ("q", "k", "v", "o"),
                  model=None) -> tuple[PPOTrainer, LoRAModel]:
    """Part 1's trainer, unchanged, given a LoRA model as the policy and its own base model as the reference.

    The base is frozen, so make_optimizer's "model" group holds only the adapters (at cfg.lr_model).
    """
    base = model if model is not None else load_model(cfg.model, cfg.device)
    adapters = make_adapters(base, rank, alpha, targets)
    freeze_base(base, adapters)
    lora_model = LoRAModel(base, adapters)
    return PPOTrainer(cfg, model=lora_model, reference=base), lora_model


def main(argv: list[str] | None = None) -> dict:
    parser = cli.ArgumentParser(
        description="PPO with a hand-written LoRA; the reference is the base model.",
        epilog="--phases 0 trains nothing: one rollout of the starting model gives reward_start, and reward_end "
               "and kl_end are null.")
    parser.add_argument("--preset", choices=["tiny", "gpt2"], default="tiny",
                        help="tiny: the embedded model on CPU; gpt2: GPT-2 small on a GPU (PPOConfig.gpt2())")
    parser.add_argument("--rank", type=cli.at_least(1), default=8)
    parser.add_argument("--alpha", type=cli.above(0.0, LORA_ALPHA.why), default=16.0)
    parser.add_argument("--phases", type=cli.at_least(0, PHASES.why), help="default 60 (3 with RLHF_SMOKE=1)")
    parser.add_argument("--save", default="", help="save the trained adapter to this .safetensors file")
    parser.add_argument("--wandb", action="store_true")
    parser.add_argument("--plot", default="lora_ppo_curves.png", help="where to save the curves ('' for none)")
    parser.add_argument("--json", action="store_true", help="end with one line: a JSON object of the figures")
    args = parser.parse_args(argv)

    phases = args.phases if args.phases is not None else 3 if os.environ.get("RLHF_SMOKE") else 60
    cfg = PPOConfig.gpt2() if args.preset == "gpt2" else PPOConfig()
    # The adapters start from zero and have few parameters: they take a far higher learning rate than full
    # fine-tuning of the same model.
    cfg = replace(cfg, phases=phases, lr_model=1e-4 if args.preset == "gpt2" else 3e-3, wandb=args.wandb)
    start = time.perf_counter()
    trainer, lora_model = ppo_with_lora(cfg, args.rank, args.alpha)
    if cfg.phases == 0:  # nothing to train: one rollout measures the starting model
        trainer.phase = 0
        trainer.rollout_phase()
    logger = trainer.train()
    seconds = time.perf_counter() - start
    if args.save:
        save_adapter(lora_model.adapters, args.save)
    _, rewards = logger.curve("reward")
    _, kls = logger.curve("kl")
    k = max(1, min(5, len(rewards) // 4))
    trained = cfg.phases > 0
    figures = {"model": cfg.model, "rank": args.rank, "phases": cfg.phases,
               "reward_start": round(rewards[0], 4),
               "reward_end": round(sum(rewards[-k:]) / k, 4) if trained else None,
               "kl_end": round(sum(kls[-k:]) / k, 4) if trained else None,
               "trainable_params": count_parameters(lora_model.adapters),
               "total_params": count_parameters(lora_model.base), "seconds": round(seconds, 1)}
    if args.plot:
        keys = [key for key in ["reward", "kl", "entropy", "clip_fraction"] if logger.curve(key)[1]]
        plot_curves(logger.history, keys, title=f"PPO with LoRA (rank {args.rank}) on {cfg.model}", path=args.plot,
                    xlabel="phase")
    print_figures(figures, args.json)
    return figures


if __name__ == "__main__":
    main()
