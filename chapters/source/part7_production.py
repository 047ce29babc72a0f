# %% [markdown]
# # Part 7 — The bridge to production
#
# {colab_badge}
#
# You wrote LoRA as hooks, GRPO as a loop, and every form of the reference model. At work you will use
# [peft](https://github.com/huggingface/peft), [TRL](https://github.com/huggingface/trl) and
# [accelerate](https://github.com/huggingface/accelerate). This chapter takes what you trained, and what you
# understood, there: your adapter as a peft adapter folder (and back), the main job as a TRL run with every knob
# mapped, and what to do when one machine is no longer enough.

# %% [colab]

# %% [preamble]

# %% [setup]
from utils.models import load_model


# %% [markdown]
# ## 1. Your adapter in peft's format
#
# At work, a LoRA adapter is a [peft](https://github.com/huggingface/peft) folder: it is what
# `PeftModel.from_pretrained` and `AutoPeftModelForCausalLM` load, what the Hub stores, what `merge_and_unload()`
# folds into a model for deployment, and what servers such as vLLM load next to a base model. The folder holds
# two files:
#
# - `adapter_config.json`: `peft_type` `"LORA"`, the base model (`base_model_name_or_path`), the rank `r`,
#   `lora_alpha`, the `target_modules` (module names of the Hugging Face model), `fan_in_fan_out`, ...;
# - `adapter_model.safetensors`: for each targeted module, `base_model.model.<module>.lora_A.weight` of shape
#   `[r, d_in]` and `...lora_B.weight` of shape `[d_out, r]`.
#
# On each module, peft computes `out + (lora_alpha / r) · B A x` — exactly Part 2's LoRA, so for most targets an
# export is a renaming: our `o` is GPT-2's `attn.c_proj`, `mlp_in` is `mlp.c_fc`, `mlp_out` is `mlp.c_proj`
# (`model.original_model` is the Hugging Face GPT-2 under the bridge). GPT-2 stores these weights in `Conv1D`
# layers, `[d_in, d_out]`, the transpose of `nn.Linear`'s; peft's `lora_A` and `lora_B` are `nn.Linear` all the
# same, and `fan_in_fan_out: true` only tells peft to transpose the update when it merges it into the weight.
#
# On the Llama-style model (`load_model("tiny-llama")`, a `LlamaForCausalLM` under the bridge) every target is a
# renaming. Each projection is its own `nn.Linear` without bias, under `model.layers.{i}`: q, k, v and o are
# `self_attn.q_proj`, `k_proj`, `v_proj`, `o_proj`, and the gated MLP's `mlp_gate`, `mlp_in`, `mlp_out` are
# `mlp.gate_proj`, `up_proj`, `down_proj`. k and v are narrower than q there (2 key/value heads for 4 query heads:
# 64 outputs, not 128), and so are their adapters and peft's `lora_B`. `fan_in_fan_out` is false (peft itself turns
# it off, with a warning, on an `nn.Linear`). The exercises below are GPT-2's: only GPT-2 fuses anything.
#
# One thing is not a renaming. GPT-2 computes q, k and v with **one** matrix, `attn.c_attn`, whose output is
# `[q | k | v]` (each `n_heads × d_head` wide, head after head — the order of our `hook_q`'s `[head, d_head]`
# flattened). The main job trains two adapters there, q and v; peft wants one LoRA on `c_attn`. Stack the A's and
# lay the B's out in blocks:
#
# $$A = \begin{bmatrix} A_q \\ A_v \end{bmatrix}, \qquad
#   B = \begin{bmatrix} B_q & 0 \\ 0 & 0 \\ 0 & B_v \end{bmatrix}
#   \quad\Rightarrow\quad s \, B A x = \begin{bmatrix} s \, B_q A_q x \\ 0 \\ s \, B_v A_v x \end{bmatrix}$$
#
# (rows: q, k, v; columns: the rank of each adapter). This is exact, at rank 2r (3r with k). The scale $s = \alpha / r$
# stays out of B: peft applies it as `lora_alpha / r`, so `c_attn` gets rank 2r and alpha 2α (the same s), and every
# other module the course's r and α. Why not fold s into B and set peft's scaling to 1? It computes the same logits, but
# not the adapter a peft user rebuilds: `LoraConfig(r=4, lora_alpha=8)`, written from the course's numbers, would apply
# s twice, and training in peft would take 1/s of our step through B (Adam moves each entry of B by about the learning
# rate, and B's update reaches the output times peft's scaling). The zero rows keep k as it is. (c_attn has one scale;
# if q's and v's scales differed, v's block would carry $s_v / s_q$.)

# %% [setup]
import json
import math
import re

import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file

from solutions.part2_lora import TARGETS, LoRA, LoRAModel, base_weight, make_adapters   # Part 2, solved
from solutions.part3_grpo import GRPOConfig, GRPOTrainer                              # Part 3, solved
# where each target lives in GPT-2 (solutions/part7_production.py), and how import_peft_adapter reads a peft folder's
# adapter_config.json: refused unless it is a plain LoRA, and peft's rules for what it adapts (utils/peft_config.py)
# and in a Llama-style model (LLAMA_MODULES), by architecture (BLOCKS, MODULES, COURSE_TARGET, NO_HOOK)
from solutions.part7_production import (BLOCKS, COURSE_TARGET, HF_MODULES, LLAMA_MODULES, MODULES, NO_HOOK,
                                        PEFT_PREFIX, QKV)
from utils.peft_config import pattern_value, read_peft_config, refuse, targeted
from utils.data import addition_accuracy, addition_pairs, addition_prompt
from utils.files import why_unreadable
from utils.models import TINY_DIR, architecture
from utils.sampling import tokenize_prompts

# %% [markdown]
# Write `fuse_qkv`: the (A, B, scale) of the one `c_attn` LoRA that computes what a block's q, k and v adapters
# compute (any of them: the main job has q and v only). A stacks the A's in the order q, k, v; B has the 3 ×
# `n_heads × d_head` rows of `c_attn`'s output; scale is the first adapter's; return A and B detached (they are
# going to a file).

# %% [exercise] fuse_qkv
# marks: difficulty 3 · importance 1 · 35 minutes
# hint: Go through the targets in `c_attn`'s order, `QKV`, keeping those present (refuse any other key first). `A` is
#       the `torch.cat` of their A's, detached: `[R, d_model]`.
# hint: `B` starts as zeros of `[3 * d_out, R]`. Adapter `t` writes the rows from `QKV.index(t) * d_out`, `d_out` of
#       them, and reads the columns of its own A: keep a column offset that grows by each adapter's rank.
# hint: `B[row:row + d_out, column:column + rank] = adapters[t].B.detach() * (adapters[t].scale / scale)`, `scale` being
#       the first present adapter's; return `(A, B, scale)`.

# %% [markdown]
# And back. A `c_attn` LoRA that peft trained has **one** A, read by q, k and v alike, and a dense B: it has no
# block structure to undo, and no smaller rank is exact in general. So each of q, k and v gets a LoRA of the full
# rank R, with its own copy of A, the rows of B that write its third of the output, and the same scale. The copy
# matters: three course adapters are three independent LoRAs, and training q must not move k's A.

# %% [exercise] split_qkv
# marks: difficulty 2 · importance 1 · 30 minutes
# hint: Each of q, k, v gets the whole rank `R`: its own copy of `A`, and the third of `B`'s rows that writes its output
#       (q first). Refuse a `B` whose number of rows is not a multiple of 3.
# hint: Build each with `LoRA(d_model, d_out, rank=R, alpha=scale * R)`, moved to `A`'s device and dtype, and fill it
#       under `torch.no_grad()` with `lora.A.copy_(A)` and `lora.B.copy_(B[i * d_out:(i + 1) * d_out])`.
# hint: `copy_` gives each adapter its own tensor (assigning `A` itself would share it). Then set `lora.scale = scale`:
#       `alpha / rank` recomputed can differ in the last bit.

# %% [markdown]
# ## 2. The folder, both ways
#
# `peft_state_dict`: the tensors of `adapter_model.safetensors`, under peft's names. For each Hugging Face module
# an adapter updates (`HF_MODULES` maps our targets to them: q, k and v to `attn.c_attn`, o to `attn.c_proj`,
# `mlp_in` to `mlp.c_fc`, `mlp_out` to `mlp.c_proj`), the keys
# `base_model.model.transformer.h.{layer}.{module}.lora_A.weight` and `....lora_B.weight`: `base_model.model.`
# because a `PeftModel` wraps your model twice, and no adapter name (`default`), which is chosen when the adapter
# is loaded. A block's q, k and v go through your `fuse_qkv`; the other adapters keep their A and B as they are
# (the config carries the scale).

# %% [exercise] peft_state_dict
# marks: difficulty 2 · importance 1 · 30 minutes
# hint: Group the adapters by the Hugging Face module they update first: key `"L{layer}_{target}"` goes to
#       `f"transformer.h.{layer}.{HF_MODULES[target]}"`, collecting `{target: adapter}` per module (q, k and v all land
#       on `attn.c_attn`).
# hint: A `c_attn` module's dict goes through `fuse_qkv`; any other module holds one adapter, whose `A` and `B` go as
#       they are, detached.
# hint: The keys are `f"{PEFT_PREFIX}{module}.lora_A.weight"` and `....lora_B.weight`; store the tensors
#       `.cpu().contiguous()`.

# %% [markdown]
# The rest is bookkeeping, provided. `export_peft_adapter` writes your `peft_state_dict` and the config: `r` and
# `lora_alpha` are the course's (4 and 8 for the main job), and `rank_pattern` / `alpha_pattern` name the modules whose
# rank or alpha differ (with q, k, v and o, `c_attn` has rank 3r and alpha 3α, `c_proj` r and α). It also names, in the
# safetensors metadata (which peft ignores), the targets each `c_attn` fuses. peft needs a plain Hugging Face model to
# find its modules by name, and the bridge has rewired `model.original_model` in place, so `hf_model_of` builds its
# plain twin.
#
# Both read the architecture from the model (`architecture(model)`). On the Llama-style model there is nothing to
# fuse: `export_peft_adapter` writes each adapter's A and B under its own module's name, with `fan_in_fan_out: false`
# and the course's r and alpha for every module, and `import_peft_adapter` reads each module back as its one target.
#
# `import_peft_adapter` reads a `c_attn` LoRA back as the adapters it was fused from when its B has the zero blocks that
# `fuse_qkv` writes (blocks of r columns, each writing one target's rows; a block of zeros, an untrained B, is named by
# the metadata): q and v at rank r for the main job, so that export → import → export writes the same files. Any other
# `c_attn` LoRA, peft's own, goes through your `split_qkv`. It refuses, saying what and what to do, what a course
# adapter cannot hold: a LoRA on a module the course has no hook for (the token and position embeddings, the unembedding
# `lm_head`), DoRA (it rescales each output by a trained magnitude) and the other variants, a bias other than `"none"`,
# `modules_to_save` (whole trained modules), initialisations that change the base weights (PiSSA, LoftQ, ...), another
# peft type, and tensors that do not match the config or the model. It follows peft's rules for `target_modules` (a list
# of names or suffixes, a regular expression, `"all-linear"`), `layers_to_transform`, `rank_pattern`, `alpha_pattern`
# and rsLoRA's scaling `lora_alpha / sqrt(r)`.

# %% [provided] hf_model_of

# %% [provided] export_peft_adapter

# %% [provided] import_peft_adapter

# %% [markdown]
# Now the main job's adapter, trained by Part 3's GRPO (60 steps here; 2 in the test suite's quick run), written
# with your `fuse_qkv`, and loaded by peft itself on the Hugging Face model. Compare the logits on the 810 held-out
# additions, and the held-out accuracy of both. `python -m solutions.part7_production` does the same after the main
# job's 150 steps.

# %%
import tempfile

from peft import PeftModel

model = load_model("tiny")
trainer = GRPOTrainer(GRPOConfig(steps=2 if SMOKE else 60, eval_every=0, table_every=1000), model=model)
trainer.train()
adapters = trainer.model.adapters   # rank 4 on q and v of every block
folder = export_peft_adapter(model, adapters, Path(tempfile.mkdtemp()) / "peft_adapter")
print(folder, sorted(p.name for p in folder.iterdir()))
print({k: v for k, v in json.loads((folder / "adapter_config.json").read_text()).items()
       if k in ("peft_type", "r", "lora_alpha", "target_modules", "fan_in_fan_out")})

peft_model = PeftModel.from_pretrained(hf_model_of(model), str(folder)).eval()
held_out = addition_pairs("held_out")
ids, mask = tokenize_prompts(model.tokenizer, [addition_prompt(a, b) for a, b in held_out], model.cfg.device)
back = LoRAModel(model, import_peft_adapter(model, folder))   # read back with your split_qkv
with torch.no_grad():
    ours, untrained = trainer.model(ids, attention_mask=mask), model(ids, attention_mask=mask)
    theirs = peft_model(input_ids=ids, attention_mask=mask).logits
    read_back = back(ids, attention_mask=mask)
print(f"what the adapter changes:        max |logit difference| {(ours - untrained).abs().max():.3f}")
print(f"peft's model against our hooks:  max |logit difference| {(ours - theirs).abs().max():.2e}")
print(f"read back, against peft's:       max |logit difference| {(read_back - theirs).abs().max():.2e}")
differ = (ours.argmax(-1) != theirs.argmax(-1)).sum().item()
print(f"greedy next tokens that differ:  {differ} of {ours.shape[0] * ours.shape[1]}")
print(f"the adapters read back: {list(back.adapters)[:3]} ..., rank {back.adapters['L0_q'].A.shape[0]}")
print(f"held-out accuracy with our hooks: {addition_accuracy(trainer.model, held_out):.1%}")

# %% [markdown]
# The differences are float rounding (the Hugging Face model and the bridge do not add in the same order), orders
# of magnitude below what the adapter changes. After the main job's 150 steps (seed 0,
# `python -m solutions.part7_production`), the largest of the 810 × 7 × 356 logit differences was 6.7e-06 on one
# torch thread and 6.2e-06 on two (6e-06 to 8e-06 over seeds 0, 1, 2), where the adapter itself moves logits by up
# to 4.4 (3.6 to 4.6: a trained adapter moves with the seed and the thread count), and peft's model answered as many
# of the held-out additions right as our hooked model did, greedy, in every run (seed 0: 88.3% on one thread, 90.4%
# on two). The read-back adapters are the trained ones, q and v at rank 4: import finds the zero blocks that
# `fuse_qkv` wrote. A `c_attn` that peft trained has none (its one A is read by q, k and v alike), so `split_qkv`
# gives each of q, k and v the whole rank.
#
# The same two calls on the Llama-style model, with an adapter on each of its seven projections (B random: an
# untrained B = 0 would show nothing). There, peft's LoRA is ours module for module; on a CPU the printed difference
# was exactly 0 when this was written.

# %%
llama = load_model("tiny-llama")
llama_adapters = make_adapters(llama, rank=4, alpha=8.0,
                               targets=("q", "k", "v", "o", "mlp_gate", "mlp_in", "mlp_out"))
for adapter in llama_adapters.values():
    nn.init.normal_(adapter.B, std=0.5)
llama_folder = export_peft_adapter(llama, llama_adapters, Path(tempfile.mkdtemp()) / "llama_adapter")
llama_config = json.loads((llama_folder / "adapter_config.json").read_text())
print("block 0:", [m for m in llama_config["target_modules"] if ".layers.0." in m])
print("fan_in_fan_out:", llama_config["fan_in_fan_out"])
llama_peft = PeftModel.from_pretrained(hf_model_of(llama), str(llama_folder)).eval()
with torch.no_grad():   # the same tokenizer as GPT-2's tiny model: the same ids
    ours = LoRAModel(llama, llama_adapters)(ids, attention_mask=mask)
    theirs = llama_peft(input_ids=ids, attention_mask=mask).logits
print(f"peft's Llama against our hooks: max |logit difference| {(ours - theirs).abs().max():.2e}")
print(f"read back: {list(import_peft_adapter(llama, llama_folder))[:7]}")

# %% [markdown]
# What a course adapter cannot hold is refused, not approximated. DoRA, for instance:

# %%
from peft import LoraConfig, get_peft_model

dora = get_peft_model(hf_model_of(model), LoraConfig(r=4, target_modules=["lm_head"], use_dora=True))
dora_folder = Path(tempfile.mkdtemp()) / "dora_adapter"
dora.save_pretrained(str(dora_folder))
try:
    import_peft_adapter(model, dora_folder)
except ValueError as error:
    print(error)

# %% [markdown]
# ## 3. The same run in TRL
#
# The main job of Part 3 (GRPO with a rank-4 LoRA on q and v, 2-digit additions, 150 steps of 16 prompts × 8
# completions) can be written with [TRL](https://github.com/huggingface/trl)'s `GRPOTrainer` and a peft `LoraConfig`
# in a few lines. What takes thought is the settings: every knob of our `GRPOConfig` has to land on the right
# `trl.GRPOConfig` field, with the right value, or the two runs are not the same run. The table below says where
# each one goes (it lives in `solutions/production/knobs.py`, and a test checks its names against the installed
# TRL and peft, so that it cannot rot).
#
# Three translations are not copies:
# - **TRL counts completions, per process.** Our `n_prompts` counts prompts per step; TRL's
#   `per_device_train_batch_size` counts *completions* on *each process*: `n_prompts × group_size / world_size`.
# - **TRL counts optimizer steps.** With `num_iterations` μ > 1, each batch of rollouts serves μ optimizer steps, so
#   `max_steps = steps × μ`.
# - **TRL's defaults are not ours.** Its learning rate decays linearly to 0, it trains in bfloat16 with activation
#   checkpointing, it shuffles the prompts, it saves checkpoints, it trains with the model's dropout on (GPT-2 small
#   has 0.1; ours trains in eval mode: `disable_dropout`), and (trl 1.16) it multiplies the KL term k3 by the ratio
#   (`use_bias_correction_kl`), which changes that term's gradient whenever `beta > 0`, to the per-token reverse KL's
#   (Part 3, section 5); `TRL_SETTINGS` turns each of these to what our trainer does, and also writes out every other
#   setting that changes TRL's loss or samples whose default is already ours (no entropy bonus, no two-sided clip,
#   one ratio per token, the whole vocabulary sampled, no reference sync, TRL's own vLLM correction), so that the run
#   does not depend on TRL's defaults. Part 4's synced references map only for full fine-tuning (`REFERENCE_TO_TRL`):
#   trl 1.16 refuses `sync_ref_model` with a peft model.
#
# And one that cannot be made the same: **the LoRA**. Hugging Face's GPT-2 computes q, k and v with one fused matrix
# (`attn.c_attn`, whose output is `[q | k | v]`), so peft can only adapt the three together: one rank-4 LoRA whose A
# is shared and whose B writes all three. It trains as many parameters as ours (8,192: 4 × 128 + 384 × 4 per block,
# against 2 × (4 × 128 + 128 × 4)), but not the same function: k is adapted too, and q and v share their A.
# (Section 1 shows how separate adapters still *export* exactly, as one LoRA of rank 8 on `c_attn` with a
# block-structured B; peft cannot keep B block-structured while it trains.) On the Llama-style model the LoRA is the
# same: `python -m solutions.production.trl_grpo --model tiny-llama` trains its preset (a LoRA on all seven
# projections) in both, and peft adapts `q_proj`, ..., `down_proj` one by one, as ours does: 37,376 parameters on
# each side.

# %% [setup]
from dataclasses import replace

from solutions.part3_grpo import GRPOConfig
from solutions.production.knobs import GRPO_TO_TRL, PEFT_SETTINGS, TRL_SETTINGS, knob_rows

# %%
from IPython.display import Markdown
from tabulate import tabulate

Markdown(tabulate(knob_rows(), headers="keys", tablefmt="github"))

# %% [markdown]
# Now write the translation: `to_trl_config(cfg, output_dir, world_size)` returns the keyword arguments of
# `trl.GRPOConfig` for the run `cfg` describes. Use `GRPO_TO_TRL` for the names, and add every setting of
# `TRL_SETTINGS` (`{name: (value, why)}`). It needs no TRL: it only makes a dict. The run below trains TRL with it.

# %% [exercise] to_trl_config
# marks: difficulty 2 · importance 2 · 20 minutes
# hint: Read the table above row by row: most knobs are copied under TRL's name (`learning_rate` is `cfg.lr`,
#       `num_generations` is `cfg.group_size`, `max_completion_length` is `cfg.max_new_tokens`, ...).
# hint: The ones that are not copies: `max_steps = steps * num_iterations`; `per_device_train_batch_size = n_prompts *
#       group_size // world_size` (refuse a `world_size` that does not divide it); `reward_weights` is `[1.0,
#       format_weight]` on `"addition"`, `[1.0]` on `"periods"`; `use_cpu`, `report_to`, `logging_steps=1`, and
#       `output_dir` as a `str`.
# hint: End the dict with every fixed setting: `**{name: value for name, (value, _) in TRL_SETTINGS.items()}`.

# %% [markdown]
# peft's side is shorter: the same rank and alpha, and the modules that hold our targets (GPT-2's names, or the
# Llama-style model's, as `cfg.model` says).

# %% [provided] to_lora_config

# %% [markdown]
# The run: TRL's `GRPOTrainer` with your `to_trl_config` and peft's LoRA, then our `GRPOTrainer`, both on the
# embedded model, the same prompts in the same order (`training_prompts`: the additions our trainer draws for this
# seed), the same reward functions (Part 3's `reward_exact_answer` and `reward_format`), the same seed. Held-out
# accuracy is measured the same way for both (`utils.data.addition_accuracy`, greedy, the 810 additions never
# trained on): for TRL, on a copy of its model with peft's LoRA merged in (`merge_and_unload`). The same as
# `python -m solutions.production.trl_grpo`. It needs the extras (`pip install -r requirements-bench.txt`); about
# two minutes on a CPU core for both runs.

# %%
from solutions.production.trl_grpo import MISSING, figures_of, plot_runs, run_ours, run_trl, trl_available

if not trl_available():
    print(f"skipped: {MISSING}")
else:
    cfg = replace(GRPOConfig(), steps=2 if SMOKE else 150, eval_every=2 if SMOKE else 10)
    if not torch.cuda.is_available():
        cfg = replace(cfg, device="cpu")
    runs = {"TRL + peft": run_trl(cfg, translate=to_trl_config), "ours": run_ours(cfg)}
    for name, run in runs.items():
        figures = figures_of("run", run)
        print(f"{name}: held-out accuracy {figures['run_accuracy_start']:.1%} -> {figures['run_accuracy_end']:.1%}"
              f" (best {figures['run_accuracy_max']:.1%}), {figures['run_seconds']:.0f} s of training")
    plot_runs(runs, title=f"GRPO on additions, seed {cfg.seed}: TRL + peft against ours");

# %% [markdown]
# What to look for: both start at 42.7% (the same model: B = 0 on both sides) and climb at about the same pace.
# Over three seeds (`RLHF_THREADS=1 python -m solutions.production.trl_grpo --seed s`), held-out accuracy after 150
# steps (the best of the 16 measurements in brackets):
#
# | seed | 0 | 1 | 2 | median |
# |---|---|---|---|---|
# | TRL + peft, LoRA on `c_attn` | 84.4% (88.1) | 86.3% (89.0) | 91.5% (91.5) | 86.3% |
# | ours, LoRA on q and v | 90.4% (90.4) | 89.3% (89.9) | 90.6% (90.6) | 90.4% |
#
# TRL ends below ours on two seeds and above on one. The curves cross several times (TRL is often ahead in the
# first 50 steps), and both dip between measurements (TRL by 14 points at step 90 of seed 0, ours by 9 at step 120
# of seed 2), so an end point is one sample of a noisy curve: TRL's spread over 84–92%, ours over 89–91%. Is the
# fused LoRA (k adapted too, one A for q, k and v) behind the gap, or the random numbers (TRL's sampler and peft's
# initial A draw their own from the same seed)? A control puts the *same* LoRA on both sides: `--targets o` adapts
# the attention output, which GPT-2 does not fuse (`attn.c_proj`; 4,096 parameters). After 150 steps, seeds 0, 1,
# 2: TRL 70.0%, 79.0%, 79.0%; ours 73.5%, 78.6%, 81.2%. The same kind of gap with the same LoRA, so the fused
# `c_attn` is not needed to explain it; three seeds show no consistent difference between the two trainers. The mean reward (right) is sampled at temperature 1 and rises far less than
# the greedy accuracy: more often than not the right answer becomes the *most likely* one without becoming a sure
# one. TRL's 150 steps took 42–64 CPU-seconds, ours 28–41 (one thread, evaluations excluded, over these six runs),
# mostly because of the sampler (BENCHMARKS.md profiles both).

# %% [markdown]
# ## 4. Beyond one machine
#
# A GRPO job outgrows one GPU in three ways, and each has its tool. None of them is ours: from here on you use
# [accelerate](https://github.com/huggingface/accelerate) (which TRL's trainers run on), DeepSpeed or PyTorch's FSDP,
# and [vLLM](https://github.com/vllm-project/vllm). The script of section 3 runs under all of them unchanged: it reads
# the number of processes from the environment `accelerate launch` sets, and `to_trl_config` divides each step's
# completions among them.
#
# **Too slow: data parallelism (DDP).** Each GPU holds a whole copy of the model, samples and scores its share of the
# step's completions, and the gradients are averaged across GPUs after each backward pass. The step's batch (here
# 16 prompts × 8 completions) is split, so the number of processes must divide it; TRL gathers every process's
# rewards before it computes the group advantages, so a group split across GPUs is still one group.
#
# **Too big: sharding (ZeRO-3 or FSDP).** When the weights, gradients and AdamW's two moments (16 bytes a parameter in
# mixed precision, before activations) no longer fit on one GPU, DeepSpeed's ZeRO stage 3 (Rajbhandari et al. 2020)
# and PyTorch's FSDP give each GPU a shard of every parameter, gradient and optimizer state, and gather a layer's
# weights just before it runs. With LoRA the optimizer state is small; what no longer fits is the base model.
# TRL gathers the whole model for generation unless `ds3_gather_for_generation=False`.
#
# **Generation dominates: vLLM.** In GRPO most of a step is sampling (on our CPU, BENCHMARKS.md profiles it). TRL can
# hand it to vLLM with `use_vllm=True`, in one of two `vllm_mode`s: `"colocate"`, vLLM inside each training process,
# sharing its GPU (`vllm_gpu_memory_utilization`, 0.3 by default; `vllm_tensor_parallel_size`;
# `vllm_enable_sleep_mode` to free vLLM's memory during the optimizer step), or `"server"`, vLLM on GPUs of its own,
# started with `trl vllm-serve` (`vllm_server_base_url`, or `vllm_server_host` and `vllm_server_port`;
# `vllm_server_timeout`). Either way the trainer pushes the new weights to vLLM after each step. vLLM samples with
# its own kernels, so its log-probs differ slightly from the trainer's; TRL corrects for it by importance sampling
# (`vllm_importance_sampling_correction`, on by default).
#
# The config files are in `solutions/production/accelerate_configs/`. On a CPU the same `accelerate launch` that
# starts eight GPUs starts one process (`cpu_1proc.yaml`, below) or two that train as one, gradients averaged over
# the gloo backend (`cpu_2proc.yaml`; `tests/part7_production/test_data_parallel.py` checks that 2 processes × 64
# completions take the same step as 1 process × 128). One process, here:

# %%
import subprocess

from solutions.production.trl_grpo import MISSING, trl_available

CONFIGS = ROOT / "solutions" / "production" / "accelerate_configs"
print((CONFIGS / "cpu_1proc.yaml").read_text())
if not trl_available():
    print(f"skipped: {MISSING}")
else:
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / "cpu_1proc.yaml"),
               "-m", "solutions.production.trl_grpo", "--trl-only", "--steps", "2", "--plot", ""]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "RLHF_THREADS": "1"})
    print(result.stdout[-1500:] if result.returncode == 0 else result.stderr[-3000:])

# %% [markdown]
# On GPUs, the commands are these. **They were not run for this course** (it has no GPU cluster): they are the
# documented way to start each setting with the installed TRL 1.16 and accelerate 1.15, whose flags and fields the
# test suite checks, not measured results. Set `num_processes` in the file (or `--num_processes N`) to your GPU count.
#
# ```bash
# # several GPUs, data parallel (DDP)
# accelerate launch --config_file solutions/production/accelerate_configs/multi_gpu_ddp.yaml \
#     -m solutions.production.trl_grpo --trl-only
# # a model too big for one GPU: DeepSpeed ZeRO-3 (pip install deepspeed), or FSDP2
# accelerate launch --config_file solutions/production/accelerate_configs/deepspeed_zero3.yaml \
#     -m solutions.production.trl_grpo --trl-only
# accelerate launch --config_file solutions/production/accelerate_configs/fsdp.yaml \
#     -m solutions.production.trl_grpo --trl-only
# # generation by vLLM (pip install vllm), inside the training processes
# accelerate launch --config_file solutions/production/accelerate_configs/multi_gpu_ddp.yaml \
#     -m solutions.production.trl_grpo --trl-only --vllm colocate
# # ... or on a GPU of its own: the server first (GPU 0), then training on four others (4 divides 128 completions)
# CUDA_VISIBLE_DEVICES=0 trl vllm-serve --model utils/tiny_model --port 8000
# CUDA_VISIBLE_DEVICES=1,2,3,4 accelerate launch --num_processes 4 \
#     --config_file solutions/production/accelerate_configs/multi_gpu_ddp.yaml \
#     -m solutions.production.trl_grpo --trl-only --vllm server
# ```
#
# Under ZeRO-3 and FSDP the script does not measure held-out accuracy while training (the weights are sharded, and a
# merged copy would first have to be gathered); it says so when it starts. On GPT-2-sized and larger models, change
# `mixed_precision` in the file and `bf16` in `TRL_SETTINGS` together.
