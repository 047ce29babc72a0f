"""Lean decoders with a KV cache, over a TransformerBridge's own weights: the fast path of `utils.sampling`.

Why it exists. TransformerLens's `generate` runs every token through the bridge: about 225 modules on the tiny
model (a hook point around every intermediate, attention and LayerNorm in Python). That is what makes hooks
possible, and it is what makes decoding one token at a time slow: the arithmetic of a decoding step is small,
so the overhead per operation is the step's cost. While no hook is active there is nothing to call, so this file
computes the same function with a dozen operations per layer, reading the very parameters the bridge trains:

    x = W_E[tok] + W_pos[pos]
    per block:  x += attn(ln1(x)) ;  x += mlp(ln2(x))        (GPT-2 is pre-LayerNorm)
    logits = ln_f(x) @ W_U^T                                  (for the last position only)

Four things make it faster than the bridge, and than Hugging Face's `generate` too (BENCHMARKS.md measures them):
- q, k and v come out of one matrix multiplication (their weights concatenated), and attention is torch's fused
  `scaled_dot_product_attention` over a KV cache allocated once, for the whole completion;
- a LoRA is merged into the weights once per call (`updates`, below), not applied as a side branch every step;
- a prompt that occurs several times in the batch (GRPO's G completions of each prompt) is run through the model
  once, and its keys and values are copied to its rows: the "prefill" is shared;
- the next token is drawn with one uniform number per row (inverse-CDF sampling, `pick`).

The Llama-style models (Llama, Qwen2, SmolLM2: `LeanLlama`) get the same treatment: RMSNorm instead of LayerNorm, the
rotary position embedding applied to q and k (its angles from the Hugging Face model's own `rotary_emb`, so any RoPE
scaling it has is the same), grouped-query attention (the cache holds the fewer k/v heads; torch's attention shares
each among its query heads), and the gated MLP down(silu(gate(x)) * up(x)), gate and up in one matrix multiplication.

Each computes what the bridge computes, to float rounding: `tests/test_utils.py` checks their logits against the
bridge's at every decoding step (padded and repeated prompts, with and without a merged LoRA), its greedy tokens
against TransformerLens's, and its samples' frequencies against softmax(logits / temperature).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

# The projections a weight update may name, per block, as paths in the bridge: "blocks.{layer}.{one of these}"
# ("mlp.gate" on a gated MLP only).
PROJECTIONS = ("attn.q", "attn.k", "attn.v", "attn.o", "mlp.gate", "mlp.in", "mlp.out")


# The Hugging Face classes each lean decoder reproduces.
LLAMA_STYLE = ("LlamaForCausalLM", "Qwen2ForCausalLM")


def unsupported_reason(model) -> str | None:
    """Why no lean decoder can stand in for `model.generate`, or None if one can: it must be a bridge over a Hugging
    Face GPT-2 with its standard attention, or over a Llama-style model (LLAMA_STYLE) with SiLU and full attention,
    and no hook may be active (a hook can change anything)."""
    hf = getattr(model, "original_model", None)
    kind = type(hf).__name__
    config = getattr(hf, "config", None)
    if kind == "GPT2LMHeadModel":
        if not config.scale_attn_weights or config.scale_attn_by_inverse_layer_idx or config.reorder_and_upcast_attn:
            return "this GPT-2 scales its attention in a non-standard way"
        if config.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):  # the same function, two spellings
            return f"this GPT-2 uses the {config.activation_function} activation, not gelu_new"
    elif kind in LLAMA_STYLE:
        if config.hidden_act != "silu":
            return f"this {kind} uses the {config.hidden_act} activation, not silu"
        if getattr(config, "use_sliding_window", False) or getattr(config, "pretraining_tp", 1) != 1:
            return f"this {kind} uses sliding-window attention or tensor-parallel slices"
    else:
        return f"the lean decoders know GPT-2 and {', '.join(LLAMA_STYLE)} only, and this model wraps {kind}"
    if any(isinstance(m, nn.Dropout) and m.training and m.p > 0 for m in hf.modules()) or (
            kind in LLAMA_STYLE and hf.training and config.attention_dropout > 0):
        return "the model is in training mode with dropout on (call model.eval() to sample without it)"
    hooked = [name for name, m in model.named_modules() if any(_counts(m, fn) for fn in _hook_functions(m))]
    if hooked:
        return f"hooks are active on {hooked[0]}{' and others' if len(hooked) > 1 else ''}"
    return None


def lean_decoder(model, updates: dict[str, Tensor] | None = None) -> "LeanDecoder":
    """The lean decoder for `model`'s architecture (check unsupported_reason first)."""
    kind = type(model.original_model).__name__
    return (LeanLlama if kind in LLAMA_STYLE else LeanGPT2)(model, updates)


def _hook_functions(module: nn.Module) -> list:
    return [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]


def _counts(module: nn.Module, fn) -> bool:
    """Whether a hook may change the output. Hook points carry the hooks of `model.hooks(...)` and `add_hook`: they
    all count. Two kinds of library hooks on the wrapped modules only read, and don't: the bridge's own pre-hooks,
    which feed its hook points, and the ones Hugging Face installs to collect hidden states and attention patterns
    (after `run_with_cache`, say), which return nothing. A hook of any other origin (`register_forward_hook` by
    hand) counts."""
    from transformer_lens.hook_points import HookPoint

    if isinstance(module, HookPoint):
        return True
    fn = getattr(fn, "func", fn)  # functools.partial
    origin = getattr(fn, "__module__", "") or ""
    reads_only = origin.startswith("transformer_lens.") or (
        origin == "transformers.utils.output_capturing" and fn.__name__ == "output_capturing_hook")
    return not reads_only


def linear_weight(module: nn.Module) -> tuple[Float[Tensor, "d_out d_in"], Tensor | None]:
    """(weight as [d_out, d_in], bias) of an nn.Linear, or of GPT-2's Conv1D, which stores [d_in, d_out]."""
    weight = module.weight if isinstance(module, nn.Linear) else module.weight.T
    return weight, module.bias


def _fused(parts: list[tuple[Tensor, Tensor | None]]) -> tuple[Tensor, Tensor | None]:
    """Several projections of the same input as one: their (weight, bias) pairs concatenated along d_out (a part
    without a bias gets zeros; None if none has one), so that one matrix multiplication computes them all."""
    weight = torch.cat([w for w, _ in parts])
    if all(b is None for _, b in parts):
        return weight, None
    return weight, torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b in parts])


class LeanDecoder:
    """What both lean decoders share: the bridge's weights, gathered once per sampling call (with `updates` merged
    in), the KV cache, the prefill and the decoding loop. A subclass reads its architecture's weights (`_read`)
    and computes its forward pass.

    updates: {"blocks.{layer}.{projection}": [d_in, d_out] matrix} added to those projections' weights; a LoRA
    model's `weight_updates()` gives them. The bridge itself is not modified.
    """

    n_kv_heads: int

    def __init__(self, model, updates: dict[str, Tensor] | None = None):
        updates = dict(updates or {})
        unknown = [k for k in updates if k.split(".", 2)[-1] not in PROJECTIONS or not k.startswith("blocks.")]
        if unknown:
            raise ValueError(f"weight updates for {unknown}: name projections as 'blocks.L.P' with P one of "
                             f"{PROJECTIONS}")
        cfg = model.cfg
        final = model.ln_final.original_component
        self.n_heads, self.d_head = cfg.n_heads, cfg.d_head
        self.eps = getattr(final, "eps", getattr(final, "variance_epsilon", None))  # LayerNorm's, RMSNorm's
        self.n_kv_heads = self.n_heads
        self.W_E = model.embed.original_component.weight                   # [vocab, d_model]
        unembed = model.unembed.original_component
        self.W_U, self.b_U = unembed.weight, unembed.bias                  # [vocab, d_model], [vocab] or None
        self._read_model(model)
        self.blocks = []
        for layer, block in enumerate(model.blocks):
            def projection(name: str, layer=layer, block=block) -> tuple[Tensor, Tensor | None]:
                weight, bias = linear_weight(block.get_submodule(name).original_component)
                update = updates.pop(f"blocks.{layer}.{name}", None)
                return (weight if update is None else weight + update.T.to(weight.dtype)), bias

            self.blocks.append(self._read(model, block, projection))
        if updates:
            raise ValueError(f"weight updates for projections this model does not have: {sorted(updates)}")

    def _read_model(self, model) -> None:
        """Read what lies outside the blocks."""
        raise NotImplementedError

    def _read(self, model, block, projection) -> dict:
        """One block's weights; `projection(name)` gives (weight [d_out, d_in] with its update merged, bias)."""
        raise NotImplementedError

    def new_cache(self, batch: int, length: int) -> list[tuple[Tensor, Tensor]]:
        shape = (batch, self.n_kv_heads, length, self.d_head)
        return [(self.W_E.new_empty(shape), self.W_E.new_empty(shape)) for _ in self.blocks]

    @torch.no_grad()
    def prefill(self, ids: Int[Tensor, "batch prompt"], attention_mask: Int[Tensor, "batch prompt"], length: int,
                ) -> tuple[Float[Tensor, "batch vocab"], list[tuple[Tensor, Tensor]], Int[Tensor, "batch"]]:
        """Run the left-padded prompts: (logits at each row's last position, a KV cache of `length` columns whose
        first prompt-length columns are filled, each row's last position)."""
        batch, prompt_len = ids.shape
        device = ids.device
        # Each distinct prompt is run once; `rows` maps every row to its distinct prompt.
        unique, rows = torch.unique(torch.cat([ids, attention_mask], dim=1), dim=0, return_inverse=True)
        u_ids, u_mask = unique[:, :prompt_len], unique[:, prompt_len:].bool()
        positions = (u_mask.long().cumsum(1) - 1).clamp(min=0)  # left padding does not shift positions
        causal = torch.ones(prompt_len, prompt_len, dtype=torch.bool, device=device).tril()
        # a query may see the real keys at or before it; a padding query sees itself, so that no row of the
        # attention is empty (an empty row is NaN on some attention kernels)
        mask = (causal & u_mask[:, None, :]) | torch.eye(prompt_len, dtype=torch.bool, device=device)
        distinct_cache = self.new_cache(len(unique), prompt_len)
        logits = self.forward(u_ids, positions, mask[:, None], distinct_cache, 0)[rows]   # [batch, vocab]
        cache = self.new_cache(batch, length)
        for (k, v), (k0, v0) in zip(cache, distinct_cache):
            k[:, :, :prompt_len], v[:, :, :prompt_len] = k0[rows], v0[rows]
        return logits, cache, positions[rows, -1]

    @torch.no_grad()
    def generate(self, ids: Int[Tensor, "batch prompt"], attention_mask: Int[Tensor, "batch prompt"],
                 max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 eos_id: int | None = None, stop_at_eos: bool = True) -> Int[Tensor, "batch gen"]:
        """Sample up to max_new_tokens after each left-padded prompt (temperature 0: greedy). After a row's EOS
        it gets EOS again; with stop_at_eos the loop ends once every row has one (the result is then shorter)."""
        batch, prompt_len = ids.shape
        total = prompt_len + max_new_tokens
        logits, cache, position = self.prefill(ids, attention_mask, total)
        key_mask = torch.zeros(batch, total, dtype=torch.bool, device=ids.device)
        key_mask[:, :prompt_len] = attention_mask.bool()
        done = torch.zeros(batch, dtype=torch.bool, device=ids.device)
        out = []
        for t in range(max_new_tokens):
            token = self.pick(logits, temperature, top_k)
            if eos_id is not None:
                token = token.masked_fill(done, eos_id)
                done |= token == eos_id
            out.append(token)
            if t == max_new_tokens - 1 or (stop_at_eos and eos_id is not None and bool(done.all())):
                break
            column = prompt_len + t
            key_mask[:, column] = True
            position = position + 1
            logits = self.forward(token[:, None], position[:, None], key_mask[:, None, None, :column + 1], cache,
                                  column)
        return torch.stack(out, dim=1)

    @staticmethod
    def pick(logits: Float[Tensor, "batch vocab"], temperature: float, top_k: int | None) -> Int[Tensor, "batch"]:
        """The next token of each row: the argmax at temperature 0, else a sample of softmax(logits / T), from the
        top_k most likely tokens only if top_k is given."""
        if temperature == 0:
            return logits.argmax(dim=-1)
        logits = logits.float() / temperature
        if top_k is not None:
            kth = logits.topk(top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, -math.inf)
        # Inverse-CDF sampling: one uniform number per row, found in the running sum of the probabilities. It draws
        # from the same distribution as torch.multinomial, which spends a random number on every vocabulary entry
        # (1 ms a step for 128 rows on a CPU, more than the rest of the step's sampling).
        cdf = logits.softmax(dim=-1).double().cumsum(dim=-1)
        u = torch.rand(len(cdf), 1, device=cdf.device, dtype=cdf.dtype) * cdf[:, -1:]
        return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp(max=cdf.shape[1] - 1)


class LeanGPT2(LeanDecoder):
    """GPT-2: x = W_E[tok] + W_pos[pos]; per block x += attn(ln1(x)); x += mlp(ln2(x)); logits = ln_f(x) @ W_U^T."""

    def _read_model(self, model) -> None:
        self.W_pos = model.pos_embed.original_component.weight             # [n_ctx, d_model]
        final = model.ln_final.original_component
        self.ln_f = (final.weight, final.bias)

    def _read(self, model, block, projection) -> dict:
        qkv = [projection(name) for name in ("attn.q", "attn.k", "attn.v")]
        ln1, ln2 = block.ln1.original_component, block.ln2.original_component
        return {"ln1": (ln1.weight, ln1.bias), "ln2": (ln2.weight, ln2.bias),
                "qkv": _fused(qkv),  # one matmul for all three
                "o": projection("attn.o"), "mlp_in": projection("mlp.in"), "mlp_out": projection("mlp.out")}

    def forward(self, tokens: Int[Tensor, "batch pos"], positions: Int[Tensor, "batch pos"],
                mask: Tensor, cache: list[tuple[Tensor, Tensor]], start: int) -> Float[Tensor, "batch vocab"]:
        """Logits at the last position of `tokens`, which sit at columns start.. of the cache (written here).

        mask: [batch, 1, pos, start + pos] bool, True where a query may attend to a key.
        """
        batch, n = tokens.shape
        x = self.W_E[tokens] + self.W_pos[positions]                               # [batch, pos, d_model]
        for block, (k_cache, v_cache) in zip(self.blocks, cache):
            h = F.layer_norm(x, x.shape[-1:], *block["ln1"], self.eps)
            q, k, v = F.linear(h, *block["qkv"]).view(batch, n, 3, self.n_heads, self.d_head).unbind(2)
            k_cache[:, :, start:start + n] = k.transpose(1, 2)                       # [batch, head, pos, d_head]
            v_cache[:, :, start:start + n] = v.transpose(1, 2)
            z = F.scaled_dot_product_attention(q.transpose(1, 2), k_cache[:, :, :start + n],
                                               v_cache[:, :, :start + n], attn_mask=mask)
            x = x + F.linear(z.transpose(1, 2).reshape(batch, n, -1), *block["o"])
            h = F.layer_norm(x, x.shape[-1:], *block["ln2"], self.eps)
            x = x + F.linear(F.gelu(F.linear(h, *block["mlp_in"]), approximate="tanh"), *block["mlp_out"])
        last = F.layer_norm(x[:, -1], x.shape[-1:], *self.ln_f, self.eps)
        return F.linear(last, self.W_U, self.b_U)


class LeanLlama(LeanDecoder):
    """Llama-style: x = W_E[tok]; per block x += attn(rms1(x)) with RoPE on q and k and grouped-query attention;
    x += down(silu(gate(rms2(x))) * up(rms2(x))); logits = rms_f(x) @ W_U^T."""

    def _read_model(self, model) -> None:
        hf = model.original_model
        self.n_kv_heads = hf.config.num_key_value_heads
        self.rotary = hf.model.rotary_emb                                  # (x, position_ids) -> cos, sin
        self.ln_f = model.ln_final.original_component.weight

    def _read(self, model, block, projection) -> dict:
        qkv = [projection(name) for name in ("attn.q", "attn.k", "attn.v")]
        gate_up = [projection(name) for name in ("mlp.gate", "mlp.in")]
        return {"ln1": block.ln1.original_component.weight, "ln2": block.ln2.original_component.weight,
                "qkv": _fused(qkv), "o": projection("attn.o"), "gate_up": _fused(gate_up),
                "down": projection("mlp.out")}

    def forward(self, tokens: Int[Tensor, "batch pos"], positions: Int[Tensor, "batch pos"],
                mask: Tensor, cache: list[tuple[Tensor, Tensor]], start: int) -> Float[Tensor, "batch vocab"]:
        """As LeanGPT2.forward; the cache holds the keys after their rotation, so each is rotated once."""
        batch, n = tokens.shape
        heads, kv, d_head = self.n_heads, self.n_kv_heads, self.d_head
        x = self.W_E[tokens]                                                       # [batch, pos, d_model]
        cos, sin = (t[:, None] for t in self.rotary(x, positions))                # [batch, 1, pos, d_head]

        def rotate(t: Tensor) -> Tensor:                                           # [batch, head, pos, d_head]
            half = t.shape[-1] // 2
            return t * cos + torch.cat([-t[..., half:], t[..., :half]], dim=-1) * sin

        for block, (k_cache, v_cache) in zip(self.blocks, cache):
            h = F.rms_norm(x, x.shape[-1:], block["ln1"], self.eps)
            q, k, v = F.linear(h, *block["qkv"]).split([heads * d_head, kv * d_head, kv * d_head], dim=-1)
            q = rotate(q.view(batch, n, heads, d_head).transpose(1, 2))
            k_cache[:, :, start:start + n] = rotate(k.view(batch, n, kv, d_head).transpose(1, 2))
            v_cache[:, :, start:start + n] = v.view(batch, n, kv, d_head).transpose(1, 2)
            z = F.scaled_dot_product_attention(q, k_cache[:, :, :start + n], v_cache[:, :, :start + n],
                                               attn_mask=mask, enable_gqa=kv != heads)
            x = x + F.linear(z.transpose(1, 2).reshape(batch, n, -1), *block["o"])
            h = F.rms_norm(x, x.shape[-1:], block["ln2"], self.eps)
            gate, up = F.linear(h, *block["gate_up"]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, *block["down"])
        last = F.rms_norm(x[:, -1], x.shape[-1:], self.ln_f, self.eps)
        return F.linear(last, self.W_U, self.b_U)
