# %% [markdown]
# # Part 2 — LoRA written by hand, as hooks
#
# {colab_badge}
#
# Part 1 fine-tuned every weight of the model, and so needed a second, frozen copy of it as the reference for the
# KL penalty. LoRA (Hu et al. 2021) trains a small low-rank update instead:
#
# $$W x \;\longrightarrow\; W x + \frac{\alpha}{r} B A x, \qquad A \in \mathbb{R}^{r \times d_\text{in}},\ B \in \mathbb{R}^{d_\text{out} \times r},\ r \ll d.$$
#
# We write it **as forward hooks**: the base model's weights are never touched; a hook on a projection's output
# adds $\frac{\alpha}{r} B A x$. That gives RLHF something precious for free: **the reference model is the same
# module with the hooks removed**. No second copy of the weights, no syncing — just run the model without hooks.
#
# You will write the LoRA module (`LoRA`), its hooks (`lora_hooks`), the policy's and the reference's log-probs
# (`policy_and_reference_logprobs`), freezing (`freeze_base`), merging the update into the weights and taking it out
# again (`merge_lora`, `unmerge_lora`), and saving an adapter and loading it back with its checks (`save_adapter`,
# `load_adapter`); then Part 1's trainer runs unchanged with LoRA.

# %% [colab]

# %% [preamble]

# %% [setup]
import math
from typing import Callable

import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from solutions.part0_warmup import completion_logprobs  # Part 0, solved
from solutions.part1_ppo import PPOConfig, PPOTrainer    # Part 1, solved
from utils.files import why_unreadable  # says why a file is not a safetensors file
from utils.logger import samples_table
from utils.models import count_parameters, load_model
from utils.plotting import plot_curves
from utils.sampling import Samples, sample


# %% [markdown]
# ## 1. The LoRA module
#
# `A` starts Kaiming-uniform, exactly as `nn.Linear` initialises a weight (`nn.init.kaiming_uniform_(A,
# a=math.sqrt(5))`), and `B` starts at **zero**, so $BA = 0$ and the adapted model starts as the base model;
# the gradient of $B$ is not zero (it is proportional to $A x$), so training gets going at once.
#
# The update is scaled by $\alpha / r$ (Hu et al.'s convention, and the `peft` library's). The reason cannot be the
# update's size at initialisation: $BA = 0$ then, whatever the rank. It is about training. With Adam, a step
# moves each entry of $B$ by about the learning rate whatever the gradient's scale, so a constant factor on the
# update acts much like a factor on the learning rate. Hu et al. (2021, section 4.1) fix $\alpha$ (to the first
# $r$ they try) and divide by $r$, so that a learning rate tuned at one rank needs less re-tuning at another. It
# is a convention, not a law: rsLoRA (Kalajdzievski 2023) argues that dividing by $r$ shrinks the update too much
# as $r$ grows, so that large ranks learn more slowly and gain nothing, and that $\alpha / \sqrt{r}$ keeps the
# update's scale stable in $r$ (`peft`'s `use_rslora=True`). We keep $\alpha / r$.
#
# `forward` maps `[..., d_in]` to `[..., d_out]`. Keep `A`, `B` and `scale` as attributes with those names.

# %% [exercise] LoRA
# marks: difficulty 2 · importance 3 · 20 minutes
# hint: `A` and `B` are `nn.Parameter`s, `A` of shape `[rank, d_in]` and `B` of shape `[d_out, rank]`; `B` starts at
#       zero so that the adapted model starts as the base model; `scale` is a plain float, `alpha / rank`.
# hint: Create `A` empty, then initialise it in place with `nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))`, as
#       `nn.Linear` initialises its weight.
# hint: `forward` is two thin matmuls and the scale, `(x @ self.A.T) @ self.B.T * self.scale`: going through the rank
#       first never builds the `[d_out, d_in]` matrix.

# %% [markdown]
# ## 2. LoRA as forward hooks
#
# Which activations does a LoRA on, say, the query projection need? Its *input* $x$ (the output of `ln1`, going
# into $W_Q$) and its *output* (the queries, which we change). TransformerLens 4 wraps every projection with a hook
# point on each side: `blocks.{L}.attn.q.hook_in` is the input, `[batch, pos, d_model]`, and
# `blocks.{L}.attn.q.hook_out` the output, per head: `[batch, pos, head, d_head]` (the same hook point as the
# familiar `attn.hook_q`). The table `TARGETS` below lists the pair for each projection we adapt.
#
# **Two architectures.** GPT-2 computes q, k and v with one fused matrix (`c_attn`), which the bridge splits into
# `attn.q`, `attn.k` and `attn.v` for us; its MLP is `out(gelu(in(x)))`. The Llama-style model (`"tiny-llama"`, and
# Llama 3, Qwen2.5, SmolLM2) has separate `q_proj`, `k_proj`, `v_proj` and `o_proj` already, and two differences
# matter here. Grouped-query attention: its 4 query heads share 2 key/value heads, so `k` and `v` write
# `[batch, pos, 2, d_head]`, half as wide as `q`; `make_adapters` reads each adapter's `d_in` and `d_out` off the
# weight it updates, so `view(out.shape)` fits. And a gated MLP, `down(silu(gate(x)) * up(x))`: one more projection
# (`"mlp_gate"`, which GPT-2 lacks: `available_targets(model)` says which a model has), with `"mlp_in"` the up
# projection and `"mlp_out"` the down one. The rotary position embedding rotates q and k *after* `attn.q.hook_out`
# and `attn.k.hook_out` (at `attn.hook_rot_q`, `attn.hook_rot_k`), so a LoRA on q changes the projection, as peft's
# LoRA on `q_proj` does, and RoPE then rotates the adapted queries. Your `lora_hooks` needs no branch for either
# architecture.
#
# So each adapter needs **two hooks**: one on the input that keeps $x$ (return nothing: the activation is left as
# it is), and one on the output that returns `output + adapter(x)`, reshaped to the output's shape. The output
# projection `o` reads the per-head `z`, `[batch, pos, head, d_head]`: flatten the last two dimensions to
# `n_heads * d_head` before the adapter.
#
# `make_adapters` (below) builds one `LoRA` per block and target, keyed `"L{layer}_{target}"`. Write
# `lora_hooks(model, adapters)`: it returns the list of `(hook_name, hook_fn)` pairs and adds nothing to the
# model. Closures in a loop are a classic trap: bind the loop's variables as default arguments.

# %% [provided] TARGETS

# %% [provided] available_targets

# %% [provided] make_adapters

# %% [exercise] lora_hooks
# marks: difficulty 3 · importance 3 · 30 minutes
# hint: For each key `"L{layer}_{target}"` of `adapters`, recover the layer and the target (`key[1:].split("_", 1)`),
#       then the two hook names `f"blocks.{layer}.{TARGETS[target][0]}"` (the input) and `...[1]` (the output).
# hint: The two hooks share a small store made inside the loop (a dict): the input hook saves `x` there and returns
#       `None` (flatten a 4-d per-head input with `x.flatten(-2)`); the output hook returns `out + adapter(saved x)`,
#       reshaped with `.view(out.shape)`.
# hint: A function defined in a loop sees the loop variables' *last* values when it runs: bind them as default
#       arguments, `def add_update(out, hook, stash=stash, adapter=adapter)`. Return the list of `(name, fn)` pairs, two
#       per adapter, and add nothing to the model.

# %% [markdown]
# Three ways to use the hooks, as in Part 0: `model.run_with_hooks(tokens, fwd_hooks=hooks)` for one forward pass;
# `with model.hooks(fwd_hooks=hooks):` for a block of code — `generate` samples from the adapted model inside it;
# and `model.add_hook` for hooks that stay until `model.reset_hooks()`. We never use the last one for LoRA.
#
# With `B = 0` the adapted model *is* the base model. Check it, then give `B` random values and watch the greedy
# samples change inside the context manager only (the base column is sampled after the `with` block, from the same
# module). The values must be large enough: with a standard deviation of 0.05 the logits move by less than 2 (1.7 on
# the GPT-2-style model, 0.8 on the Llama-style one) and every greedy token stays the same (a LoRA can change the
# distribution without changing its most likely token); with 0.2, used here, they move by up to about 9 on the
# GPT-2-style model and about 11 on the Llama-style one (the cell's last line), and all three completions change.

# %%
model = load_model(MODEL)
torch.manual_seed(0)
adapters = make_adapters(model, rank=8, alpha=16.0)
tokens = sample(model, ["This is"], max_new_tokens=8).ids
with torch.no_grad():
    same = torch.allclose(model.run_with_hooks(tokens, fwd_hooks=lora_hooks(model, adapters)), model(tokens))
print("B = 0: adapted logits equal the base model's:", same)

with torch.no_grad():
    for a in adapters.values():
        a.B.normal_(0, 0.2)
prompts = ["This is", "The", "My friend"]
with model.hooks(fwd_hooks=lora_hooks(model, adapters)):
    adapted = sample(model, prompts, max_new_tokens=12, temperature=0)
plain = sample(model, prompts, max_new_tokens=12, temperature=0)
print(samples_table([{"prompt": p, "base": b, "with random B": a}
                     for p, b, a in zip(prompts, plain.texts, adapted.texts)]))
with torch.no_grad():
    moved = (model.run_with_hooks(plain.ids, fwd_hooks=lora_hooks(model, adapters)) - model(plain.ids)).abs().max()
print(f"on the base completions, the random B moves the logits by up to {moved:.1f}")

# %% [markdown]
# ## 3. The reference model is the same module, without the hooks
#
# `LoRAModel` (below) bundles the base model and its adapters: its `forward` and `generate` run the base model
# inside `with base.hooks(lora_hooks(...))`, and it passes `cfg`, `tokenizer` and `hooks` through, so Part 1's
# `PolicyWithValueHead`, `sample` and `PPOTrainer` accept it as a model. It holds no copy of anything: `self.base`
# *is* the base model.
#
# One more method, `weight_updates`, is for speed. A LoRA is linear, so what it adds to a projection is a matrix
# (its output on the identity matrix: row $i$ is the image of basis vector $i$). `sample` merges those matrices into
# a copy of the weights once per call and decodes without any hook (`utils/decoder.py`): the same model, in far
# fewer operations per token. Training still runs through your hooks.
#
# Write `policy_and_reference_logprobs`: the completion log-probs of `samples` under the adapted model and under
# the reference — `lora_model.base`, called with no hooks. (Part 0's `completion_logprobs` does the work.)

# %% [provided] LoRAModel

# %% [exercise] policy_and_reference_logprobs
# marks: difficulty 1 · importance 3 · 10 minutes
# hint: Both come from Part 0's `completion_logprobs`; only the model you hand it changes.
# hint: `lora_model` itself is the policy (its `forward` adds the hooks); `lora_model.base`, called directly, runs with
#       no hooks and is the reference.

# %% [markdown]
# ## 4. Freezing
#
# Only the adapters (and, in PPO, the value head) should learn. Write `freeze_base`: every base parameter gets
# `requires_grad=False`, every adapter parameter `requires_grad=True` (an adapter loaded from disk may arrive
# frozen), and it returns the trainable and total parameter counts (`count_parameters`).

# %% [exercise] freeze_base
# marks: difficulty 1 · importance 2 · 5 minutes
# hint: `nn.Module.requires_grad_(flag)` sets the flag on every parameter of a module at once.
# hint: `model.requires_grad_(False)`, then `adapters.requires_grad_(True)`; return `(count_parameters(adapters),
#       count_parameters(model))`.

# %%
trainable, total = freeze_base(model, adapters)
print(f"trainable: {trainable:,} of {total:,} parameters ({trainable / total:.1%})")

# %% [markdown]
# ## 5. Merging and unmerging
#
# For fast inference, fold the update into the weights: $W \leftarrow W + \frac{\alpha}{r} BA$. Then the plain
# model computes what the hooked one did, with no hooks and no extra matmuls. `base_weight(model, key)` (below)
# finds the weight an adapter updates. Watch the layout: the bridge's q/k/v are `nn.Linear`s, whose weight is
# `[d_out, d_in]` (like $BA$), but `o` and the MLP are GPT-2's `Conv1D`, whose weight is `[d_in, d_out]` — there
# the update goes in transposed. (Careful: `o` is square, so forgetting the transpose raises no error.) On the
# Llama-style model every projection is an `nn.Linear`, `o` and the gated MLP's three included (`base_weight` says
# `False` for each), so the transpose never happens there: a merge that forgets it is right on that model and wrong on
# GPT-2's. `check()` tests your `merge_lora` on both, so a failure on the GPT-2-style model alone points here.
#
# `unmerge_lora` takes the update out again; it restores the weights up to float rounding, not bit for bit.

# %% [provided] base_weight

# %% [exercise] merge_lora
# marks: difficulty 2 · importance 2 · 10 minutes
# hint: For each adapter, `base_weight(model, key)` gives the weight to change and whether it is stored `[d_in, d_out]`
#       (GPT-2's Conv1D).
# hint: The update is `adapter.scale * (adapter.B @ adapter.A)`, of shape `[d_out, d_in]`: transpose it for a weight
#       stored `[d_in, d_out]`.
# hint: Change the weight in place, `weight += sign * delta`: the same Parameter object stays in the model (the stub's
#       `@torch.no_grad()` allows the in-place add).

# %% [exercise] unmerge_lora
# marks: difficulty 1 · importance 1 · 5 minutes
# hint: Taking an update out is merging it with the opposite sign.
# hint: `merge_lora` already has a `sign` argument: call it with `sign=-1.0`.

# %% [markdown]
# ## 6. Saving and loading an adapter
#
# An adapter is small: the one you train at the end of this part (rank 8 on `q`, `k`, `v` and `o` of the tiny model's
# 4 blocks) is saved in 130 KiB, 32,768 parameters next to the model's 847,104 (3.2 MiB) on the GPT-2-style model,
# and in 114 KiB, 28,672 parameters next to 784,000 (3.0 MiB) on the Llama-style one, whose `k` and `v` are half as
# wide (the last cell of this part prints yours). It is all you need to share a fine-tune of a model everyone has.
# Save it with **safetensors** — a plain tensor format that, unlike a pickle, cannot run code when loaded — with
# `rank` and `alpha` in its metadata. Loading checks that the file fits the adapters (same keys, same shapes) and
# says what does not fit otherwise. It also compares the metadata's rank and alpha with the adapters': an adapter
# trained with alpha 16 and loaded into adapters built with alpha 8 has the right shapes, but its update is
# scaled by half, so it would silently compute another model. (`safe_open(path, framework="pt").metadata()`
# reads the metadata.)

# %% [exercise] save_adapter
# marks: difficulty 2 · importance 2 · 15 minutes
# hint: `safetensors.torch.save_file(tensors, path, metadata=...)` writes a dict of tensors; its metadata is a dict of
#       strings.
# hint: The tensors are `adapters.state_dict()`, each detached, on the CPU and contiguous. The rank is any adapter's
#       `A.shape[0]` and alpha is `scale * rank`, both written with `str(...)`.
# hint: Make the missing folders first: `Path(path).parent.mkdir(parents=True, exist_ok=True)`.

# %% [exercise] load_adapter
# marks: difficulty 3 · importance 2 · 55 minutes
# hint: Check in the order things can fail, and change nothing until every check has passed: the path exists and is a
#       file; it opens as safetensors; its metadata has rank and alpha equal to the adapters'; its tensors have the
#       adapters' names and shapes.
# hint: Open it inside a `try`: `with safe_open(str(path), framework="pt") as f: meta = f.metadata() or {}`, and turn
#       any failure into a `ValueError` naming the file (`why_unreadable(path, error)` says why). Compare
#       `int(meta["rank"])` with `A.shape[0]` and `float(meta["alpha"])` with `scale * rank` (`math.isclose`).
# hint: `load_file(str(path), device=...)` gives the tensors; compare `{name: shape}` with the adapters' `state_dict()`
#       and list the missing, unexpected and wrongly shaped names in the error. Only then
#       `adapters.load_state_dict(tensors)`, and return `adapters`.

# %% [markdown]
# ## 7. PPO with LoRA
#
# `ppo_with_lora` is the whole change from Part 1: freeze the base, wrap it in a `LoRAModel`, and hand Part 1's
# **unchanged** `PPOTrainer` the LoRA model as the policy and its own base as the reference. `make_optimizer`'s
# "model" group picks up only parameters with `requires_grad`, i.e. the adapters; the value head, in its own group,
# trains as in Part 1, and no gradient reaches the base weights. The learning rate is higher than for full
# fine-tuning: the adapters start from zero and have few parameters. (As a script: `python -m solutions.part2_lora`,
# or `--preset gpt2` for GPT-2 small on a GPU.)
#
# The training cell runs 60 phases and prints a table of samples every 20 (`table_every=20`: phases 0, 20, 40 and
# the last). Expect about a minute on two free CPU cores (61 s: docs/numbers.md, "Part 2 in numbers"), and several times
# that when other work shares the cores (3 minutes on two threads of a 2-core machine that other jobs kept busy
# throughout). The progress bar shows the rate. The Llama-style model takes no longer: 72 s against the GPT-2-style
# model's 87 s when we ran the two one after the other, each on one thread of a 2-core machine that another job kept
# busy.

# %% [provided] ppo_with_lora

# %%
cfg = PPOConfig(model=MODEL, phases=3 if SMOKE else 60, lr_model=3e-3, table_every=20)
trainer, lora_model = ppo_with_lora(cfg, rank=8, alpha=16.0)
logger = trainer.train()
plot_curves(logger.history, ["reward", "kl", "entropy", "clip_fraction"], title="PPO with LoRA, rank 8",
            xlabel="phase");

# %% [markdown]
# Now the claim of this chapter, checked: after training, the reference log-probs — the base module, run with no
# hooks — equal those of a freshly loaded, untouched model **exactly**, while the adapted model's differ; and the
# reference owns no weights the policy doesn't.

# %%
untouched = load_model(MODEL, device=lora_model.cfg.device)
torch.manual_seed(0)
samples = sample(lora_model, ["This is", "The", "We"], max_new_tokens=16)
with torch.no_grad():
    policy_lp, ref_lp = policy_and_reference_logprobs(lora_model, samples)
    fresh_lp = completion_logprobs(untouched, samples)
print("reference == untouched model, bit for bit:", torch.equal(ref_lp, fresh_lp))
print(f"adapted model differs from it by up to {(policy_lp - fresh_lp).abs().max():.3f} nats per token")
shared = {p.data_ptr() for p in lora_model.parameters()}
print("reference weights that the policy does not share:",
      sum(p.data_ptr() not in shared for p in trainer.reference.parameters()))

path = Path("lora_adapter.safetensors")
save_adapter(lora_model.adapters, path)
print(f"adapter saved: {path.stat().st_size / 1024:.0f} KiB for {count_parameters(lora_model.adapters):,} "
      f"parameters, next to a model of {count_parameters(lora_model.base):,}")

# %% [markdown]
# ### Memory
#
# The reference costs nothing here, where Part 1 needed a full copy. `bench/reference_memory.py` measures the
# peak memory of one training step both ways, on the tiny model and on a GPT-2-small-sized model built from a
# config:
#
# ```bash
# python bench/reference_memory.py
# ```
#
# ## Summary, and testing your whole notebook
#
# Save the notebook, then from the repository's root:
#
# ```bash
# pytest tests/part2_lora --impl chapters/part2_lora.ipynb
# ```
