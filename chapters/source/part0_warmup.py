# %% [markdown]
# # Part 0 — Warm-up: log-probs, sampling and hooks on a TransformerLens model
#
# {colab_badge}
#
# Every RL method in this course — PPO, GRPO, DPO, RLOO — is built from three moves on a language model:
#
# 1. **Score** text: the log-probability the model gives to each token of a sequence it (or someone) wrote.
# 2. **Sample** text: draw completions token by token, with a temperature and a top-k.
# 3. **Change** the model without copying it: a *forward hook* edits an activation on its way through.
#
# This warm-up makes you write each of them once, on the course's **embedded tiny model** (a ~0.85M-parameter GPT-2,
# or with `MODEL = "tiny-llama"` a ~0.78M-parameter Llama-style model; both ship with the repository and run on a
# laptop CPU), through **TransformerLens 4**. Later parts import what you write here: `get_logprobs` becomes the
# heart of every loss, and the hook you write in section 5 is the same mechanism that will carry a value head (Part 1)
# and a LoRA adapter (Part 2).
#
# **How to work.** Each exercise is a function whose body raises `NotImplementedError`. Replace the body, run the cell,
# then run the `check(...)` line under it: it runs that exercise's tests against the reference solution in a few
# seconds and, if something is off, tells you what the test expected and (usually) which mistake it looks like.
# A test that needs a model runs once on each embedded model, whichever `MODEL` you picked: `[gpt2]` after its name
# (or "on the GPT-2-style model") means the run on `"tiny"`, `[llama]` the run on `"tiny-llama"` (section 0).
# Some stubs carry a `@contract(...)` line above them (from `utils/contracts.py`): it checks the *values* of the
# arguments before your body runs (a negative temperature, a token id past the vocabulary, a NaN), so that a bad
# call gets an error that names it. Keep it; your body only has to handle the inputs it lets through. A name in
# capitals there, such as `TEMPERATURE`, is a rule that several functions share, written once in that file. A
# stub's docstring says what to return (**Returns:**) and which errors your body raises itself (**Raises:**).

# %% [colab]

# %% [preamble]

# %% [setup]
from typing import Callable

from utils.sampling import Samples, sample


# %%
from utils.logger import samples_table
from utils.models import load_model

torch.manual_seed(0)
model = load_model(MODEL)  # MODEL is set in the first cell: "tiny" or "tiny-llama" (or "gpt2" on a GPU)
print(f"{model.cfg.n_layers} layers, d_model = {model.cfg.d_model}, a vocabulary of {model.cfg.d_vocab} tokens")

# %% [markdown]
# ## 0. Meet the model
#
# `load_model` returns a TransformerLens `TransformerBridge` — the class that replaced `HookedTransformer` in
# TransformerLens 4 — wrapping a Hugging Face model. Calling it on a `[batch, pos]` tensor of token ids returns logits
# `[batch, pos, vocab]`. The tokenizer is `model.tokenizer`; its `<|endoftext|>` token (the last id) serves as
# beginning-of-sequence (BOS), end-of-sequence (EOS) and padding, as in GPT-2.
#
# Two embedded models share that tokenizer and corpus, and the first cell's `MODEL` picks one. `"tiny"` is a GPT-2:
# LayerNorm, a learned table of position embeddings added to the token embeddings, q, k and v from one fused matrix,
# and an MLP `out(gelu(in(x)))`. `"tiny-llama"` has the architecture of the models people fine-tune with RL today
# (Llama 3, Qwen2.5, SmolLM2): RMSNorm (no mean subtracted, no bias), no position table (rotary embeddings turn q and
# k by an angle that grows with the position, inside attention), separate q, k, v and o projections, grouped-query
# attention (its 4 query heads share 2 key/value heads) and a gated MLP `down(silu(gate(x)) * up(x))`. The
# TransformerLens hook names are the same where both models have the part (`blocks.L.hook_resid_post`,
# `blocks.L.attn.hook_q`); what one lacks it has no hook for (`mlp.gate` on GPT-2). Everything you write in this
# course runs on both, and `check()` tests it on both.
#
# The tiny model was pretrained (by `python -m utils.pretrain_tiny`) on a synthetic corpus: simple sentences, and
# 2-digit additions such as `23+45=68`. We stopped it early, on purpose: it writes plausible sentences but gets only
# some additions right, which leaves RL something to improve. Let us look at what it writes. `sample` (from `utils`)
# batches prompts, uses the KV cache, and stops each row at its first EOS:

# %%
samples = sample(model, ["This is", "This is", "The", "My friend", "12+34=", "71+18="], max_new_tokens=20)
print(samples_table([{"prompt": p, "completion": t} for p, t in zip(samples.prompts, samples.texts)]))

# %% [markdown]
# ## 1. Log-probs of given tokens
#
# RL for language models needs, again and again, the number $\log \pi_\theta(x_t \mid x_{<t})$ for each token $x_t$
# of a sequence. The model's output at position $t$ is its prediction *for the next token*: `logits[:, t]` is computed
# from `tokens[:, :t+1]` and scores `tokens[:, t+1]`. Getting this offset wrong by one is the most common bug in RLHF
# code, and it fails silently: the numbers look like log-probs, just of the wrong tokens.
#
# ```
# tokens:   BOS   This   is    a    good
# logits:   →This →is    →a    →good →(next)
# ```
#
# Usually we only care about the tokens after a prompt: `prefix_len` is the number of leading tokens that are not
# scored (at least 1: nothing predicts the first token). Write `get_logprobs`; it returns
# `[batch, seq - prefix_len]`. Use `log_softmax` (stable) and `gather`.

# %% [exercise] get_logprobs
# marks: difficulty 2 · importance 3 · 15 minutes
# hint: `logits[:, t]` is the model's prediction for token `t + 1`, so the logits that score `tokens[:, prefix_len:]`
#       start one position earlier and stop one position before the end.
# hint: Cut the logits to `logits[:, prefix_len - 1:-1]`, turn them into log-probs with `log_softmax` over the
#       vocabulary, then pick out each actual next token's entry. Raise the `ValueError` first when `prefix_len` is
#       outside `[1, seq)`.
# hint: The picking is `.gather(dim=-1, index=tokens[:, prefix_len:, None])`: the index needs the same number of
#       dimensions as the log-probs, hence the `None`; `.squeeze(-1)` drops it again.

# %% [markdown]
# ## 2. Sampling one token: temperature and top-k
#
# To sample, we turn the logits of the last position into a distribution and draw from it. Two knobs:
#
# - **temperature** $T$: sample from $\mathrm{softmax}(\ell / T)$. $T < 1$ sharpens the distribution, $T > 1$ flattens
#   it, and $T = 0$ is the limit where all the mass sits on the most likely token: greedy decoding (handle it apart,
#   or you will divide by zero).
# - **top-k**: keep only the $k$ most likely tokens (set the others' logits to $-\infty$) before the softmax.
#
# In RL we usually sample at $T = 1$ with no top-k, because the log-probs we train on must be those of the
# distribution we actually sampled from. Greedy decoding is for evaluation.

# %% [exercise] sample_next_token
# marks: difficulty 2 · importance 2 · 15 minutes
# hint: Deal with `temperature == 0` on its own, before any division: greedy decoding is each row's `argmax`.
# hint: Otherwise divide the logits by the temperature. For top-k, find each row's k-th largest logit
#       (`logits.topk(top_k, dim=-1).values[:, -1:]`, kept as `[batch, 1]` so it broadcasts) and set every logit below
#       it to `-inf` (`masked_fill`).
# hint: `torch.multinomial(logits.softmax(dim=-1), num_samples=1)` draws one id per row; `.squeeze(-1)` makes it
#       `[batch]`.

# %% [markdown]
# ## 3. A sampling loop, and why the KV cache matters
#
# The simplest generator runs the model on the whole sequence, takes the logits of the **last** position, samples a
# token, appends it, and repeats. Write it (no EOS handling: it just keeps going).

# %% [exercise] generate_no_cache
# marks: difficulty 1 · importance 1 · 10 minutes
# hint: A plain loop, `max_new_tokens` times: run the model on the whole sequence so far, every time (no cache is the
#       point of the exercise).
# hint: Only the last position predicts the next token: `model(tokens)[:, -1]` is `[batch, vocab]`, which is what
#       `sample_next_token` takes, with the temperature and `top_k` passed on.
# hint: Grow the sequence with `torch.cat([tokens, next_token[:, None]], dim=1)` and return it, prompt included.

# %% [markdown]
# Each step re-reads the whole sequence, so $n$ new tokens cost $O(n^2)$ token-passes. A **KV cache** keeps every
# layer's keys and values from earlier steps, so each step only processes the one new token. TransformerLens's
# `model.generate` does this, through every hook point of the model (`sample(..., engine="bridge")` calls it).
#
# Then there is the cost of the hook points themselves. A decoding step does little arithmetic (one token per row),
# so what it costs is mostly the *number* of operations, and the bridge runs about 225 modules per forward pass (about
# 250 on the Llama-style model). While no hook is active, `sample` takes a leaner road (its default, `engine="auto"`):
# `utils/decoder.py` computes the same function straight from the bridge's weights, a dozen operations per layer, with
# a LoRA merged into the weights and each distinct prompt run once. Its tests check that its logits are the bridge's.
# Compare all three, on equal work:

# %%
import time

prompt = sample(model, ["This is"] * 32, max_new_tokens=1).ids[:, :-1]
n_new = model.cfg.n_ctx - prompt.shape[1]
t0 = time.perf_counter(); generate_no_cache(model, prompt, n_new); t_loop = time.perf_counter() - t0
t0 = time.perf_counter(); sample(model, ["This is"] * 32, max_new_tokens=n_new, stop_at_eos=False, engine="bridge")
t_cache = time.perf_counter() - t0
t0 = time.perf_counter(); sample(model, ["This is"] * 32, max_new_tokens=n_new, stop_at_eos=False, engine="lean")
t_lean = time.perf_counter() - t0
print(f"{n_new} new tokens for 32 prompts: {t_loop:.2f} s without a cache, {t_cache:.2f} s with it "
      f"({t_loop / t_cache:.1f}x faster), {t_lean:.2f} s with the cache and the lean decoder "
      f"({t_loop / t_lean:.1f}x faster)")

# %% [markdown]
# ## 4. Log-probs of sampled completions
#
# `sample` returns a `Samples` object: `ids` holds each prompt (left-padded to a common length) followed by its
# completion, `attention_mask` is 1 on real tokens, `prompt_len` is where completions start, and `completion_mask`
# is True on each completion's tokens **up to and including its first EOS**. Everything after that first EOS is
# padding: it must not count in log-probs, in the KL, the entropy, or the loss.
#
# Two details decide whether the numbers are right:
#
# - **Left padding.** Prompts of different lengths are padded on the left so that all completions start in the same
#   column. Pass `attention_mask` to the model, or the padding is read as text (and GPT-2's positions shift).
# - **The EOS token counts.** Choosing to stop is a decision of the policy, so its log-prob is part of the completion.
#
# Write `completion_logprobs`: the log-prob of every completion token, 0 after the first EOS. Reuse `get_logprobs`.

# %% [exercise] completion_logprobs
# marks: difficulty 2 · importance 3 · 10 minutes
# hint: One forward pass over `samples.ids`, and pass `attention_mask=samples.attention_mask`: without it the left
#       padding is read as text.
# hint: The completions start at column `samples.prompt_len`, so `get_logprobs(logits, samples.ids,
#       prefix_len=samples.prompt_len)` gives exactly `[batch, gen]`.
# hint: Multiply by `samples.completion_mask` to zero everything after each first EOS; the EOS itself is inside the mask
#       and keeps its log-prob.

# %%
samples = sample(model, ["This is", "The", "My friend", "12+34="] * 2, max_new_tokens=16)
with torch.no_grad():
    logprobs = completion_logprobs(model, samples)
rows = [{"prompt": p, "completion": t, "tokens": int(m.sum()), "log-prob": float(lp.sum())}
        for p, t, m, lp in zip(samples.prompts, samples.texts, samples.completion_mask, logprobs)]
print(samples_table(rows))

# %% [markdown]
# ## 5. Hooks: change an activation, watch the log-probs move
#
# TransformerLens gives every intermediate activation a name — `blocks.1.hook_resid_post` is the residual stream
# after block 1, `blocks.0.attn.hook_v` the attention values of layer 0 (`[batch, pos, head, d_head]`) — and lets you
# attach a **hook**: a function `hook_fn(activation, hook)` whose return value replaces the activation.
#
# This is how the whole course changes a model without copying it: a value head reads the last residual stream
# through a hook (Part 1), a LoRA adapter adds its low-rank update through hooks (Part 2), and *removing* the hooks
# gives back the original model — the reference model, for free.
#
# First write a hook factory: `make_steering_hook(direction, scale)` returns a hook that adds `scale * direction`
# to the residual stream at every position.

# %% [exercise] make_steering_hook
# marks: difficulty 1 · importance 2 · 5 minutes
# hint: A factory returns a function: define an inner `hook(resid, hook)` that uses `direction` and `scale` from the
#       enclosing call, and return the inner function itself (do not call it).
# hint: What a TransformerLens hook returns replaces the activation: return `resid + scale * direction`; the `[d_model]`
#       vector broadcasts over batch and positions.

# %% [markdown]
# Now use it. There are three ways to attach hooks, and the difference matters:
#
# - `model.run_with_hooks(tokens, fwd_hooks=[(name, fn)])` — the hooks are active for this one forward pass;
# - `with model.hooks(fwd_hooks=[(name, fn)]): ...` — active inside the block, including in `model.generate`;
# - `model.add_hook(name, fn)` — stays until `model.reset_hooks()`. Easy to leave behind by accident, and a hook left
#   behind silently changes every later forward pass.
#
# Write `steered_logprobs`, which returns the log-probs of `tokens` (as `get_logprobs` with `prefix_len=1`) while
# the residual stream after block `layer` is steered. It must leave no hook behind.

# %% [exercise] steered_logprobs
# marks: difficulty 2 · importance 3 · 5 minutes
# hint: The residual stream after block `layer` is the hook point `f"blocks.{layer}.hook_resid_post"`, and the hook
#       comes from your `make_steering_hook`.
# hint: Choose the way of attaching that cannot leave the hook behind, even if the forward pass raises:
#       `model.run_with_hooks` (or the `with model.hooks(...)` block), never `add_hook`.
# hint: `logits = model.run_with_hooks(tokens, fwd_hooks=[(name, hook)])`, then `get_logprobs(logits, tokens)` with its
#       default `prefix_len=1`.

# %% [markdown]
# The unembedding matrix `model.W_U` maps the final residual stream to logits, so its column for a token is a
# direction that makes that token likelier. Scale it to unit length (so that `scale` is a distance in the
# residual stream, whose vectors after the last block have a norm of about 40 on the GPT-2-style model and about 180
# on the Llama-style one, so the same scales move the Llama-style model less), steer towards `" happy"` and watch its
# log-prob, then sample from the steered model with the context manager:

# %%
import matplotlib.pyplot as plt

word = model.tokenizer(" happy", add_special_tokens=False).input_ids[0]
tokens = torch.cat([sample(model, ["I am"], max_new_tokens=1).ids[:, :-1], torch.tensor([[word]])], dim=1)
direction = model.W_U[:, word].detach()
direction = direction / direction.norm()
scales = [0, 10, 20, 40, 60]
with torch.no_grad():
    lp = [steered_logprobs(model, tokens, model.cfg.n_layers - 1, direction, s)[0, -1].item() for s in scales]
plt.figure(figsize=(4, 3)); plt.plot(scales, lp, marker="o")
plt.xlabel("scale"); plt.ylabel("log P(' happy' | 'I am')"); plt.title("Steering the last block"); plt.show()

hook = make_steering_hook(direction, 30.0)
with model.hooks(fwd_hooks=[(f"blocks.{model.cfg.n_layers - 1}.hook_resid_post", hook)]):
    steered = sample(model, ["I am", "This is", "We feel"], max_new_tokens=12)
plain = sample(model, ["I am", "This is", "We feel"], max_new_tokens=12)
print(samples_table([{"prompt": p, "plain": a, "steered": b}
                     for p, a, b in zip(plain.prompts, plain.texts, steered.texts)]))

# %% [markdown]
# ## Summary, and testing your whole notebook
#
# You wrote the three moves RL needs: `get_logprobs` and `completion_logprobs` (score), `sample_next_token` and
# `generate_no_cache` (sample), `make_steering_hook` and `steered_logprobs` (change the model through a hook, and
# leave nothing behind). Part 1 builds PPO from them.
#
# To test every exercise of this notebook at once, save it and run, from the repository's root:
#
# ```bash
# pytest tests/part0_warmup --impl chapters/part0_warmup.ipynb
# ```
#
# (The checker executes this notebook's cells tagged `setup` and `exercise`; keep your code in those cells.)
