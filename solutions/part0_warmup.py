"""Part 0, warm-up: log-probs, sampling and hooks on a TransformerLens 4 model.

The reference solutions of `chapters/part0_warmup.ipynb`, in the notebook's order. Run it as a script to
sample from the embedded model:

    python -m solutions.part0_warmup            # a table of samples and a few figures
    python -m solutions.part0_warmup --json     # ... and a last line that is a JSON object of the figures
"""

import time
from typing import Callable

import torch
from jaxtyping import Float, Int
from torch import Tensor

from utils.contracts import (TEMPERATURE, TOP_K, a_finite_value_per_row, a_number, at_least, at_most_size, contract,
                             d_model_of, layer_of, token_ids_of, within_context)
from utils.data import addition_accuracy, addition_pairs
from utils.logger import print_figures, samples_table
from utils.models import load_model
from utils import cli
from utils.sampling import Samples, sample


# --- 1. Log-probs of given tokens --------------------------------------------------------------------------

@contract(token_ids_of("tokens", "logits"), no_nan=("logits",))
def get_logprobs(
    logits: Float[Tensor, "batch seq vocab"],
    tokens: Int[Tensor, "batch seq"],
    prefix_len: int = 1,
) -> Float[Tensor, "batch gen"]:
    """Log-probability of each token of `tokens` from position `prefix_len` on; logits[:, t] scores tokens[:, t+1].

    Returns: [batch, seq - prefix_len]; column j is log P(tokens[:, prefix_len + j] | the tokens before it).
    Raises: ValueError unless 1 <= prefix_len < seq.
    """
    if not 1 <= prefix_len < tokens.shape[1]:
        raise ValueError(f"prefix_len must be in [1, seq), got {prefix_len} for seq = {tokens.shape[1]}")
    logprobs = logits[:, prefix_len - 1:-1].log_softmax(dim=-1)  # the predictions for positions prefix_len..
    return logprobs.gather(dim=-1, index=tokens[:, prefix_len:, None]).squeeze(-1)


# --- 2. Sampling one token: temperature and top-k ----------------------------------------------------------

@contract(at_most_size("top_k", "logits", -1, "the vocabulary's tokens"), a_finite_value_per_row("logits"),
          no_nan=("logits",), temperature=TEMPERATURE, top_k=TOP_K)
def sample_next_token(
    logits: Float[Tensor, "batch vocab"],
    temperature: float = 1.0,
    top_k: int | None = None,
) -> Int[Tensor, "batch"]:
    """One token per row, drawn from softmax(logits / temperature) over the top_k most likely tokens (None: all).

    Returns: [batch] token ids; with temperature == 0, each row's most likely token (greedy).
    """
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None:
        kth_best = logits.topk(top_k, dim=-1).values[:, -1:]  # [batch, 1]
        logits = logits.masked_fill(logits < kth_best, float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1), num_samples=1).squeeze(-1)


# --- 3. A sampling loop, without a KV cache ----------------------------------------------------------------

@torch.no_grad()
@contract(within_context("tokens", "max_new_tokens"), max_new_tokens=at_least(0), temperature=TEMPERATURE, top_k=TOP_K)
def generate_no_cache(
    model,
    tokens: Int[Tensor, "batch pos"],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
) -> Int[Tensor, "batch total"]:
    """Append `max_new_tokens` tokens to each row, one sample_next_token per step on the whole sequence's last logits.

    Returns: [batch, pos + max_new_tokens], the prompt included. No EOS handling: it keeps going.
    """
    for _ in range(max_new_tokens):
        next_logits = model(tokens)[:, -1]  # only the last position predicts the next token
        next_token = sample_next_token(next_logits, temperature, top_k)
        tokens = torch.cat([tokens, next_token[:, None]], dim=1)
    return tokens


# --- 4. Log-probs of sampled completions -------------------------------------------------------------------

def completion_logprobs(model, samples: Samples) -> Float[Tensor, "batch gen"]:
    """Log-prob under `model` of each completion token of `samples`, from one forward pass with samples.attention_mask.

    Returns: [batch, gen], 0 where samples.completion_mask is False (after each completion's first EOS).
    """
    logits = model(samples.ids, attention_mask=samples.attention_mask)
    logprobs = get_logprobs(logits, samples.ids, prefix_len=samples.prompt_len)
    return logprobs * samples.completion_mask


# --- 5. A forward hook that changes an activation ----------------------------------------------------------

@contract(finite=("direction",), scale=a_number())
def make_steering_hook(direction: Float[Tensor, "d_model"], scale: float) -> Callable:
    """Returns: a TransformerLens hook function, hook(resid, hook) -> resid + scale * direction (at every position)."""

    def hook(resid: Float[Tensor, "batch pos d_model"], hook) -> Float[Tensor, "batch pos d_model"]:
        return resid + scale * direction

    return hook


@contract(layer_of("layer"), d_model_of("direction"), finite=("direction",), scale=a_number())
def steered_logprobs(
    model,
    tokens: Int[Tensor, "batch seq"],
    layer: int,
    direction: Float[Tensor, "d_model"],
    scale: float,
) -> Float[Tensor, "batch gen"]:
    """Log-probs of `tokens` with `scale * direction` added to the residual stream after block `layer`
    (blocks.{layer}.hook_resid_post); the hook is active for this call only.

    Returns: [batch, seq - 1], as get_logprobs with prefix_len=1.
    """
    hook = make_steering_hook(direction, scale)
    logits = model.run_with_hooks(tokens, fwd_hooks=[(f"blocks.{layer}.hook_resid_post", hook)])
    return get_logprobs(logits, tokens)


# --- The script: sample from the model, and measure what the notebook shows --------------------------------

def main(argv: list[str] | None = None) -> dict:
    parser = cli.ArgumentParser(description="Sample from a course model and print a table of samples.")
    parser.add_argument("--model", default="tiny", help="'tiny' (embedded, offline) or 'gpt2'")
    parser.add_argument("--prompts", nargs="+", default=["This is", "The", "My friend", "12+34="])
    parser.add_argument("--samples-per-prompt", type=cli.at_least(1), default=3)
    parser.add_argument("--max-new-tokens", type=cli.at_least(1), default=20)
    parser.add_argument("--temperature", type=cli.at_least(0.0, TEMPERATURE.why), default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="end with one line: a JSON object of the figures")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    torch.manual_seed(args.seed)
    model = load_model(args.model)
    prompts = [p for p in args.prompts for _ in range(args.samples_per_prompt)]
    samples = sample(model, prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    with torch.no_grad():
        logprobs = completion_logprobs(model, samples)
    lengths = samples.completion_mask.sum(dim=1)
    rows = [{"prompt": p, "completion": t, "tokens": int(n), "log-prob": float(lp)}
            for p, t, n, lp in zip(samples.prompts, samples.texts, lengths, logprobs.sum(dim=1))]
    print(samples_table(rows))

    # The KV cache, measured: the same number of new tokens, with and without it.
    batch = samples.ids[:, :samples.prompt_len]
    n_new = min(args.max_new_tokens, model.cfg.n_ctx - batch.shape[1])
    t0 = time.perf_counter()
    generate_no_cache(model, batch[:8], n_new)
    t_loop = time.perf_counter() - t0
    t0 = time.perf_counter()
    sample(model, prompts[:8], max_new_tokens=n_new, stop_at_eos=False, engine="bridge")  # the cache alone
    t_cache = time.perf_counter() - t0
    t0 = time.perf_counter()
    sample(model, prompts[:8], max_new_tokens=n_new, stop_at_eos=False, engine="lean")  # the same, fewer operations
    t_lean = time.perf_counter() - t0

    figures = {
        "model": args.model,
        "mean_completion_logprob": round(float(logprobs.sum() / lengths.sum()), 4),
        "mean_completion_tokens": round(float(lengths.float().mean()), 2),
        "truncated_fraction": round(float(samples.truncated.float().mean()), 3),
        "kv_cache_speedup": round(t_loop / t_cache, 2),
        "lean_decoder_speedup": round(t_loop / t_lean, 2),
        "seconds": 0.0,
    }
    if args.model == "tiny":
        figures["held_out_addition_accuracy"] = round(addition_accuracy(model, addition_pairs("held_out")), 4)
    figures["seconds"] = round(time.perf_counter() - start, 2)
    print_figures(figures, args.json)
    return figures


if __name__ == "__main__":
    main()
