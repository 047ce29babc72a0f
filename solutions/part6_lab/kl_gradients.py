"""Part 6, experiment 1: KL gradients, exactly. The exercises (two_token_logprobs, token_kl_estimate,
estimator_surrogate; exact_sequence_kls is provided), then the experiment that runs on them.

The tiny model's vocabulary has 356 tokens, so every two-token completion of a prompt (356² = 126,736 of them; EOS
counts as an ordinary token here) is scored by ONE batched forward pass of 356 rows, prompt + first token. Over that
enumerated space the sequence-level KL(pi || ref) and KL(ref || pi) are sums, and so are their gradients: exact.
So is the EXPECTED gradient of each KL term used in training (samples y ~ pi, the sampling not differentiated):
the gradient of sum_y sg(pi(y)) * L(y), which `estimator_surrogate` builds. We compare them, as the distance between
policy and reference grows, and then measure how noisy each term's gradient is when estimated from N samples.

The policy is the tiny model with a rank-4 LoRA on q and v (Part 2) whose B is random (each seed draws its own A,
B and prompt), scaled until KL(pi || ref) is 2 nats per sequence; the reference is the same module without the
hooks. The prompt is "a+", the first half of a held-out addition, so that the completions (the second operand) spread
over both tokens: with the whole question "a+b=" the answer's first digit is certain and the sequence has no
structure. Theory (Tang & Munos 2025, "On a few pitfalls in KL divergence gradient estimation for RL",
arXiv:2506.09477), which the numbers check:
  - k1 in the loss has zero expected gradient (sum_y pi(y) grad log pi(y) = grad sum_y pi(y) = 0);
  - k1 in the reward (score function) is the sequence-level reverse-KL gradient, exactly;
  - k3 in the loss (TRL's GRPO `beta` term with use_bias_correction_kl=False, as in Part 3's trainer) has the
    expected gradient sum_t E_{s_t ~ pi}[grad KL(ref(.|s_t) || pi(.|s_t))]: a per-token FORWARD KL on the states the
    policy visits;
  - k2 in the loss and the exact per-token KL follow the per-token reverse KL with the states held fixed, which
    misses the sequence-level term in which a first token is charged for the KL of what follows it; so does k3 times
    the ratio pi / sg(pi) (TRL 1.16's default `beta` term, use_bias_correction_kl=True), checked at the main scale.

    run(seeds, smoke=False, *, two_token_logprobs=..., estimator_surrogate=..., settings=None) -> result
    summarize(result) -> JSON-ready dict (one entry per KL_TERMS row);  plot(result, path=None) -> Figure
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass

import torch
from jaxtyping import Float, Int
from torch import Tensor

from solutions.part2_lora import LoRAModel, freeze_base, make_adapters
from utils.contracts import contract, one_of, relation
from utils.data import addition_pairs
from utils.logger import tqdm
from utils.models import load_model
from utils.plotting import pyplot_for
from utils.sampling import tokenize_prompts


# --- the exercises ------------------------------------------------------------------------------------------------

KL_ESTIMATORS = ("k1", "k2", "k3")  # Schulman's per-token estimators of KL(pi || ref) (k3 is TRL's per_token_kl)
KL_LOSSES = ("k1_loss", "k2_loss", "k3_loss", "exact_token_loss", "k1_reward")  # how the KL term enters training


# Refusals of two_token_logprobs and estimator_surrogate (relations between arguments, utils/contracts.py)
FIRST_TOKENS_IN_VOCABULARY = relation(
    lambda a: a["first_tokens"] is None or not a["first_tokens"].numel()
    or (a["first_tokens"].min() >= 0 and a["first_tokens"].max() < a["model"].cfg.d_vocab),
    lambda a: f"first_tokens holds ids from {a['first_tokens'].min().item()} to {a['first_tokens'].max().item()}, but "
              f"the model's vocabulary has {a['model'].cfg.d_vocab} tokens (ids 0 to {a['model'].cfg.d_vocab - 1})")
ROOM_FOR_TWO_TOKENS = relation(
    lambda a: 1 <= a["prompt"].shape[-1] <= a["model"].cfg.n_ctx - 2,
    lambda a: f"prompt has {a['prompt'].shape[-1]} tokens: it needs at least 1 (BOS) and room for the 2 completion "
              f"tokens in the model's context of {a['model'].cfg.n_ctx}")
FIRST_TOKENS_IN_RANGE = relation(
    lambda a: not a["first_tokens"].numel()
    or (a["first_tokens"].min() >= 0 and a["first_tokens"].max() < a["first"].shape[-1]),
    lambda a: f"first_tokens holds ids from {a['first_tokens'].min().item()} to {a['first_tokens'].max().item()}, "
              f"outside the vocabulary of {a['first'].shape[-1]} tokens that `first` scores")


@contract(FIRST_TOKENS_IN_VOCABULARY, ROOM_FOR_TWO_TOKENS)
def two_token_logprobs(
    model,
    prompt: Int[Tensor, "pos"],
    first_tokens: Int[Tensor, "rows"] | None = None,
) -> tuple[Float[Tensor, "vocab"], Float[Tensor, "rows vocab"]]:
    """Log-probs of two-token completions of `prompt` (its ids, BOS first), from ONE batched forward pass whose row i
    is the prompt then first_tokens[i] (None: every token of the vocabulary in order, so row a starts with token a).
    Gradients flow (call it under torch.no_grad() for the reference).

    Returns: (first, second), log-softmax-normalised over the vocabulary:
      first[a]     = log pi(a | prompt), at the prompt's last position (the same in every row: take row 0);
      second[i, b] = log pi(b | prompt, first_tokens[i]), at the last position of row i.
    """
    if first_tokens is None:
        first_tokens = torch.arange(model.cfg.d_vocab, device=prompt.device)
    batch = torch.cat([prompt.expand(len(first_tokens), -1), first_tokens[:, None]], dim=1)  # [rows, pos + 1]
    logprobs = model(batch)[:, -2:].log_softmax(dim=-1)  # [rows, 2, vocab]: predictions of token 1 and of token 2
    return logprobs[0, 0], logprobs[:, 1]


@contract(kind=one_of(*KL_ESTIMATORS), no_nan=("logp", "ref_logp"))
def token_kl_estimate(
    logp: Float[Tensor, "*shape"],
    ref_logp: Float[Tensor, "*shape"],
    kind: str,
) -> Float[Tensor, "*shape"]:
    """Returns: elementwise, with log_ratio = logp - ref_logp, each sampled token's estimate of KL(pi || ref):
      "k1": log_ratio;
      "k2": log_ratio ** 2 / 2;
      "k3": exp(-log_ratio) - 1 + log_ratio.
    Gradients flow through logp.
    """
    log_ratio = logp - ref_logp
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return log_ratio ** 2 / 2
    return torch.exp(-log_ratio) - 1 + log_ratio


@contract(FIRST_TOKENS_IN_RANGE, kind=one_of(*KL_LOSSES),
          no_nan=("weights", "first", "second", "ref_first", "ref_second"))
def estimator_surrogate(
    weights: Float[Tensor, "rows vocab"],
    first: Float[Tensor, "vocab"],
    second: Float[Tensor, "rows vocab"],
    ref_first: Float[Tensor, "vocab"],
    ref_second: Float[Tensor, "rows vocab"],
    first_tokens: Int[Tensor, "rows"],
    kind: str,
) -> Float[Tensor, ""]:
    """first, second (policy) and ref_first, ref_second (reference) are two_token_logprobs' outputs for the rows
    first_tokens; the weights are constants (detach them). L(y), per kind, sums a per-token term over the two tokens:
      "k1_loss", "k2_loss", "k3_loss": token_kl_estimate(..., "k1" / "k2" / "k3") of each token;
      "exact_token_loss": KL(pi(.|s) || ref(.|s)) over the whole vocabulary at each visited state s (the prompt, then
          the prompt + first token);
      "k1_reward": sg(log pi(y) - log ref(y)) * log pi(y), log pi(y) = first[first_tokens[i]] + second[i, b] (sg: no
          gradient through it).

    Returns: sum_y w(y) * L(y) over y = (first_tokens[i], b), w(y) = weights[i, b]: a scalar whose gradient is that
    of the KL term `kind`, weighted by w.
    """
    w = weights.detach()  # the sampling is not differentiated
    lp1, ref_lp1 = first[first_tokens][:, None], ref_first[first_tokens][:, None]  # [rows, 1]: token 1 of each row
    if kind == "exact_token_loss":
        kl_first = (first.exp() * (first - ref_first)).sum()
        kl_second = (second.exp() * (second - ref_second)).sum(dim=-1, keepdim=True)  # [rows, 1]: after token 1
        return (w * (kl_first + kl_second)).sum()
    if kind == "k1_reward":
        logp, ref_logp = lp1 + second, ref_lp1 + ref_second  # [rows, vocab]: sequence log-probs
        return (w * (logp - ref_logp).detach() * logp).sum()
    estimator = kind.removesuffix("_loss")
    per_token = token_kl_estimate(lp1.expand_as(second), ref_lp1.expand_as(second), estimator)
    return (w * (per_token + token_kl_estimate(second, ref_second, estimator))).sum()


def exact_sequence_kls(
    first: Float[Tensor, "vocab"],
    second: Float[Tensor, "vocab vocab"],
    ref_first: Float[Tensor, "vocab"],
    ref_second: Float[Tensor, "vocab vocab"],
) -> tuple[Float[Tensor, ""], Float[Tensor, ""]]:
    """The sequence-level KL(pi || ref) and KL(ref || pi) over every two-token completion, exactly (rows = every first
    token, in order). Both differentiable in the policy's log-probs: their gradients are the true ones."""
    logp, ref_logp = first[:, None] + second, ref_first[:, None] + ref_second  # [vocab, vocab]: log pi(a, b)
    reverse = (logp.exp() * (logp - ref_logp)).sum()
    forward = (ref_logp.exp() * (ref_logp - logp)).sum()
    return reverse, forward


# --- the experiment's settings ------------------------------------------------------------------------------------

LABELS = {"k1_loss": "k1 in the loss", "k2_loss": "k2 in the loss", "k3_loss": "k3 in the loss",
          "exact_token_loss": "exact per-token KL", "k1_reward": "k1 in the reward",
          "k3_ratio_loss": "k3 × ratio in the loss (TRL 1.16's default)"}
# The experiment's rows: the exercise's terms, and TRL 1.16's default `beta` term (provided: _k3_times_ratio)
KL_TERMS = KL_LOSSES + ("k3_ratio_loss",)


@dataclass
class Settings:
    """The experiment's defaults: 35 to 39 s of CPU time on one thread for 3 seeds, the model's loading included
    (`smoke`: about 15 s for 2 seeds)."""

    rank: int = 4
    alpha: float = 8.0
    targets: tuple[str, ...] = ("q", "v")
    b_std: float = 0.5                     # the LoRA's B ~ N(0, b_std²) before it is scaled to the target KL
    target_kl: float = 2.0                 # nats per sequence: B is scaled until KL(pi || ref) is about this
    prompts: int = 1                       # prompts "a+" (a from a held-out addition) per seed
    scales: tuple[float, ...] = (0.1, 0.25, 0.5, 1.0, 1.5)  # B at these multiples of its calibrated scale
    sample_sizes: tuple[int, ...] = (1, 4, 16, 64, 256, 1024)  # N, for the noise of sampled gradients
    repeats: int = 6                       # sample sets of each size

    @classmethod
    def smoke(cls) -> "Settings":
        return cls(scales=(0.25, 1.0), sample_sizes=(1, 16, 256), repeats=2)


# --- the pieces ---------------------------------------------------------------------------------------------------

def _policy(base, seed: int, settings: Settings) -> LoRAModel:
    """A LoRA on `base` with A and B drawn from `seed` (the global random state is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        adapters = make_adapters(base, settings.rank, settings.alpha, settings.targets)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for adapter in adapters.values():
            adapter.B.copy_(torch.randn(adapter.B.shape, generator=generator) * settings.b_std)
    freeze_base(base, adapters)
    return LoRAModel(base, adapters)


def _flat_grad(scalar: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
    grads = torch.autograd.grad(scalar, params, retain_graph=True, allow_unused=True)
    return torch.cat([(g if g is not None else torch.zeros_like(p)).flatten() for g, p in zip(grads, params)])


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0))


def _forward_kl_on_policy_states(first, second, ref_first, ref_second) -> torch.Tensor:
    """sum_t E_{s_t ~ pi}[KL(ref(.|s_t) || pi(.|s_t))], the states' probabilities held fixed: what k3 in the loss
    follows, by the theory. Its gradient is compared with k3's expected gradient."""
    forward_first = (ref_first.exp() * (ref_first - first)).sum()
    forward_second = (ref_second.exp() * (ref_second - second)).sum(dim=-1)  # [vocab]: after each first token
    return forward_first + (first.exp().detach() * forward_second).sum()


def _k3_times_ratio(weights, first, second, ref_first, ref_second, first_tokens=None) -> torch.Tensor:
    """TRL 1.16's default `beta` term (use_bias_correction_kl=True; trl/trainer/grpo_trainer.py, _compute_loss:
    `per_token_kl * coef_1`, coef_1 = exp(logp - old logp) with the gradient through logp): each token's k3 times
    its ratio pi / sg(pi), which is 1 but carries a gradient. The surrogate sum_y w(y) L(y) as estimator_surrogate
    builds it, over the rows first_tokens (default: every first token, in order). By the theory its expected
    gradient is the exact per-token KL's, and each sampled token's gradient is k2's: (k3 + 1 - ref/pi) grad log pi =
    log(pi/ref) grad log pi, so its noise rows are k2's."""
    def k3_times_ratio(logp, ref_logp):
        return token_kl_estimate(logp, ref_logp, "k3") * (logp - logp.detach()).exp()

    rows = slice(None) if first_tokens is None else first_tokens
    per_token = k3_times_ratio(first[rows], ref_first[rows])[:, None] + k3_times_ratio(second, ref_second)
    return (weights.detach() * per_token).sum()  # [rows, vocab] summed


def _scale_b(lora_model, b_start: dict, scale: float) -> None:
    with torch.no_grad():
        for key, adapter in lora_model.adapters.items():
            adapter.B.copy_(b_start[key] * scale)


def _calibrate(lora_model, prompt, reference, b_start, target_kl, two_token_logprobs, steps: int = 8) -> float:
    """The multiple of the LoRA's B at which the sequence-level KL(pi || ref) is closest to target_kl, by bisection on
    a log scale (the KL can jump where the policy's most likely completion changes, so no smoother method is safe)."""
    def log_kl(scale: float) -> float:
        _scale_b(lora_model, b_start, scale)
        with torch.no_grad():
            kl = exact_sequence_kls(*two_token_logprobs(lora_model, prompt), *reference)[0].item()
        return math.log(max(kl, 1e-10))

    goal = math.log(target_kl)
    seen = {0.0: log_kl(1.0)}  # log scale -> log KL
    low, high = (0.0, None) if seen[0.0] < goal else (None, 0.0)
    for _ in range(steps - 1):
        if low is None:
            x = high - math.log(2.0)
        elif high is None:
            x = low + math.log(2.0)
        else:
            x = (low + high) / 2
        seen[x] = log_kl(math.exp(x))
        if seen[x] < goal:
            low = x
        else:
            high = x
    return math.exp(min(seen, key=lambda x: abs(seen[x] - goal)))


def _exact_gradients(lora_model, prompt, reference, two_token_logprobs, estimator_surrogate, identity=False):
    """Every gradient of the experiment at the policy's current weights, flattened over the LoRA's parameters."""
    params = [p for p in lora_model.adapters.parameters()]
    ref_first, ref_second = reference
    first, second = two_token_logprobs(lora_model, prompt)
    vocab = first.shape[0]
    tokens = torch.arange(vocab)
    reverse, forward = exact_sequence_kls(first, second, ref_first, ref_second)
    weights = (first[:, None] + second).exp().detach()  # pi(y) for every two-token completion, [vocab, vocab]
    out = {"reverse_kl": reverse.item(), "forward_kl": forward.item(),
           "grad_reverse": _flat_grad(reverse, params), "grad_forward": _flat_grad(forward, params)}
    for kind in KL_LOSSES:
        out[kind] = _flat_grad(estimator_surrogate(weights, first, second, ref_first, ref_second, tokens, kind),
                               params)
    out["k3_ratio_loss"] = _flat_grad(_k3_times_ratio(weights, first, second, ref_first, ref_second), params)
    if identity:
        out["per_token_forward_on_policy_states"] = _flat_grad(
            _forward_kl_on_policy_states(first, second, ref_first, ref_second), params)
    out["weights"] = weights
    return out


def _noise(lora_model, prompt, reference, exact, settings, generator, two_token_logprobs, estimator_surrogate):
    """Cosines of each term's N-sample gradient (empirical weights count / N) with its own exact expectation and with
    the true reverse-KL gradient, for each N and repeat. Only the first tokens drawn are run through the model."""
    params = [p for p in lora_model.adapters.parameters()]
    ref_first, ref_second = reference
    vocab = exact["weights"].shape[0]
    flat = exact["weights"].flatten()
    rows: dict[str, dict[int, list[tuple[float, float]]]] = {k: {n: [] for n in settings.sample_sizes}
                                                            for k in KL_TERMS}
    for _ in range(settings.repeats):
        draws = torch.multinomial(flat, max(settings.sample_sizes), replacement=True, generator=generator)
        for n in settings.sample_sizes:
            counts = torch.bincount(draws[:n], minlength=vocab * vocab).view(vocab, vocab).float()
            first_tokens = counts.sum(dim=1).nonzero().flatten()  # the first tokens that were drawn
            first, second = two_token_logprobs(lora_model, prompt, first_tokens)
            weights = counts[first_tokens] / n
            for kind in KL_TERMS:
                if kind == "k3_ratio_loss":
                    surrogate = _k3_times_ratio(weights, first, second, ref_first, ref_second[first_tokens],
                                                first_tokens)
                else:
                    surrogate = estimator_surrogate(weights, first, second, ref_first, ref_second[first_tokens],
                                                    first_tokens, kind)
                grad = _flat_grad(surrogate, params)
                own = exact[kind]  # k1 in the loss: zero up to rounding, no direction to compare with
                zero = own.norm() <= 1e-4 * exact["grad_reverse"].norm()
                rows[kind][n].append((math.nan if zero else _cosine(grad, own),
                                      _cosine(grad, exact["grad_reverse"])))
    return rows


# --- the experiment -----------------------------------------------------------------------------------------------

def run(seeds: list[int], smoke: bool = False, *, two_token_logprobs=two_token_logprobs,
        estimator_surrogate=estimator_surrogate, settings: Settings | None = None) -> dict:
    """For each seed: a LoRA policy with random B, `settings.prompts` prompts "a+" (a from held-out additions), B
    scaled to the target KL; at each multiple of that scale of B the exact gradients (reverse KL, forward KL, each KL
    term's expected gradient); at scale 1 the noise of sampled gradients. The exercises are the ones above unless
    passed (the notebook passes the learner's)."""
    settings = settings or (Settings.smoke() if smoke else Settings())
    base = load_model("tiny", "cpu")
    runs = []
    bar = tqdm(total=len(seeds) * settings.prompts * (len(settings.scales) + 1), desc="exact KL gradients")
    for seed in seeds:
        lora_model = _policy(base, seed, settings)
        b_start = {key: adapter.B.detach().clone() for key, adapter in lora_model.adapters.items()}
        pairs = random.Random(seed).sample(addition_pairs("held_out"), settings.prompts)  # a of (a, b)
        generator = torch.Generator().manual_seed(seed)
        for a, _ in pairs:
            text = f"{a}+"  # the completion is the second operand: two digits, ~90 likely completions
            ids, _ = tokenize_prompts(base.tokenizer, [text], "cpu")
            prompt = ids[0]
            with torch.no_grad():
                reference = two_token_logprobs(base, prompt)  # the same module, no hooks
            calibrated = _calibrate(lora_model, prompt, reference, b_start, settings.target_kl, two_token_logprobs)
            by_scale = {}
            for scale in settings.scales:
                _scale_b(lora_model, b_start, calibrated * scale)
                by_scale[scale] = _exact_gradients(lora_model, prompt, reference, two_token_logprobs,
                                                   estimator_surrogate, identity=scale == 1.0)
                bar.update(1)
            main = by_scale[1.0]
            _scale_b(lora_model, b_start, calibrated)
            noise = _noise(lora_model, prompt, reference, main, settings, generator, two_token_logprobs,
                           estimator_surrogate)
            bar.update(1)
            runs.append({"seed": seed, "prompt": text, "b_scale": calibrated * settings.b_std,
                         "by_scale": {s: _measure(g) for s, g in by_scale.items()},
                         "k3_identity": _identity(main), "k3_ratio_identity": _ratio_identity(main),
                         "noise": noise})
            _scale_b(lora_model, b_start, 1.0)
        base.reset_hooks()
    bar.close()
    return {"runs": runs, "seeds": list(seeds), "settings": settings}


def _measure(g: dict) -> dict:
    """Cosines and norm ratios of each term's expected gradient against the true gradients."""
    norm_reverse = g["grad_reverse"].norm().item()
    out = {"reverse_kl": g["reverse_kl"], "forward_kl": g["forward_kl"],
           "cosine_reverse_forward": _cosine(g["grad_reverse"], g["grad_forward"])}
    for kind in KL_TERMS:
        zero = g[kind].norm().item() <= 1e-4 * norm_reverse  # k1 in the loss: zero up to rounding
        out[kind] = {"cosine_reverse": None if zero else _cosine(g[kind], g["grad_reverse"]),
                     "cosine_forward": None if zero else _cosine(g[kind], g["grad_forward"]),
                     "norm_ratio": g[kind].norm().item() / norm_reverse}
    return out


def _identity(g: dict) -> dict:
    """k3's expected gradient against the per-token forward KL on the policy's states: equal, by the theory."""
    k3, rhs = g["k3_loss"], g["per_token_forward_on_policy_states"]
    return {"cosine": _cosine(k3, rhs), "relative_error": ((k3 - rhs).norm() / rhs.norm()).item()}


def _ratio_identity(g: dict) -> dict:
    """k3 times the ratio (TRL 1.16's default) against the exact per-token KL: equal, by the theory."""
    k3_ratio, rhs = g["k3_ratio_loss"], g["exact_token_loss"]
    return {"cosine": _cosine(k3_ratio, rhs), "relative_error": ((k3_ratio - rhs).norm() / rhs.norm()).item()}


# --- summary and figure -------------------------------------------------------------------------------------------

def _per_seed(result: dict, value) -> list[float | None]:
    """value(run) averaged over each seed's prompts, one number per seed."""
    out = []
    for seed in result["seeds"]:
        values = [value(r) for r in result["runs"] if r["seed"] == seed]
        out.append(statistics.fmean(values) if None not in values else None)
    return out


def _mean(values: list):
    return None if not values or None in values else statistics.fmean(values)


def summarize(result: dict) -> dict:
    """The JSON figures: per KL term, cosines with the exact reverse- and forward-KL gradients and the norm ratio at
    the main scale (mean over seeds; per-seed values under "per_seed"); the KLs used; the k3 and k3 × ratio
    identities; the sweep."""
    def at(scale, key, field=None):
        return lambda r: r["by_scale"][scale][key] if field is None else r["by_scale"][scale][key][field]

    out: dict = {}
    for kind in KL_TERMS:
        entry = {}
        for field in ("cosine_reverse", "cosine_forward", "norm_ratio"):
            values = _per_seed(result, at(1.0, kind, field))
            mean = _mean(values)
            entry[field] = None if mean is None else round(mean, 6 if field != "norm_ratio" or mean > 1e-3 else 12)
            entry.setdefault("per_seed", {})[field] = [None if v is None else round(v, 6) if abs(v) > 1e-3 else v
                                                       for v in values]
        out[kind] = entry
    reverse = _per_seed(result, at(1.0, "reverse_kl"))
    out["reverse_kl"] = {"mean": round(_mean(reverse), 4), "per_seed": [round(v, 4) for v in reverse]}
    out["forward_kl"] = {"mean": round(_mean(_per_seed(result, at(1.0, "forward_kl"))), 4)}
    errors = [r["k3_identity"]["relative_error"] for r in result["runs"]]
    out["k3_equals_per_token_forward_kl_on_policy_states"] = {"max_relative_error": float(f"{max(errors):.3g}")}
    errors = [r["k3_ratio_identity"]["relative_error"] for r in result["runs"]]
    out["k3_times_ratio_equals_exact_per_token_kl"] = {"max_relative_error": float(f"{max(errors):.3g}")}
    out["scale_sweep"] = [
        {"scale": s, "reverse_kl": round(_mean(_per_seed(result, at(s, "reverse_kl"))), 4),
         **{f"cosine_reverse_{kind}": (None if (m := _mean(_per_seed(result, at(s, kind, "cosine_reverse")))) is None
                                       else round(m, 4)) for kind in KL_TERMS}}
        for s in result["settings"].scales]
    sizes = list(result["settings"].sample_sizes)

    def noise(kind, which):  # mean over repeats and seeds, for each N
        values = [statistics.fmean(c[which] for r in result["runs"] for c in r["noise"][kind][n]) for n in sizes]
        return None if any(math.isnan(v) for v in values) else [round(v, 4) for v in values]

    out["noise"] = {"n": sizes, **{kind: {"cosine_own": noise(kind, 0), "cosine_reverse": noise(kind, 1)}
                                   for kind in KL_TERMS}}
    return out


def plot(result: dict, path=None):
    """Six panels. Top: each term's expected gradient against the true ones at the main scale (cosines; norm ratio),
    and the cosine with the reverse-KL gradient as the policy moves away from the reference. Bottom: the norm ratio
    against the KL, and the N-sample gradients' cosine with their own expectation and with the reverse-KL gradient."""
    plt = pyplot_for(path)
    settings, seeds = result["settings"], result["seeds"]
    fig, axes = plt.subplots(2, 3, figsize=(17, 9))
    x = list(range(len(KL_TERMS)))
    names = [LABELS[k] for k in KL_TERMS]
    reverse_kl = _mean(_per_seed(result, lambda r: r["by_scale"][1.0]["reverse_kl"]))

    def main_scale(kind, field):
        return _per_seed(result, lambda r: r["by_scale"][1.0][kind][field])

    ax = axes[0, 0]  # cosines at the main scale: bar = mean over seeds, dots = seeds
    for offset, field, color, label in ((-0.2, "cosine_reverse", "C0", "reverse"), (0.2, "cosine_forward", "C1",
                                                                                   "forward")):
        per_seed = [main_scale(kind, field) for kind in KL_TERMS]
        ax.bar([i + offset for i in x], [_mean(v) or 0.0 for v in per_seed], width=0.4, color=color, alpha=0.6,
               label=f"cosine with the {label}-KL gradient")
        for i, values in enumerate(per_seed):
            if None not in values:
                ax.plot([i + offset] * len(values), values, "k.", ms=4)
    ax.text(0, 0.05, "zero\ngradient", ha="center", fontsize=8)
    ax.set_title(f"expected gradients against the true ones (KL(pi||ref) = {reverse_kl:.2f} nats)", fontsize=10)
    ax.set_xticks(x, names, rotation=20, fontsize=8)
    ax.set_ylim(min(0, ax.get_ylim()[0]), 1.05)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3, axis="y")

    ax = axes[0, 1]  # norm ratios at the main scale
    ratios = [main_scale(kind, "norm_ratio") for kind in KL_TERMS]
    ax.bar(x, [_mean(v) for v in ratios], color="C2", alpha=0.6)
    for i, values in enumerate(ratios):
        ax.plot([i] * len(values), values, "k.", ms=4)
    ax.set_yscale("log")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_title("norm of the expected gradient / norm of the reverse-KL gradient", fontsize=10)
    ax.set_xticks(x, names, rotation=20, fontsize=8)
    ax.grid(alpha=0.3, axis="y")

    def against_kl(ax, value, color, label, style="-"):
        """Mean over seeds at each scale (line), each seed (dots), against the mean reverse KL at that scale."""
        kls = [_mean(_per_seed(result, lambda r, s=s: r["by_scale"][s]["reverse_kl"])) for s in settings.scales]
        per_seed = [_per_seed(result, lambda r, s=s: value(r["by_scale"][s])) for s in settings.scales]
        ax.plot(kls, [_mean(v) for v in per_seed], style, color=color, label=label, marker=".")
        for s, values in zip(settings.scales, per_seed):
            seed_kls = _per_seed(result, lambda r, s=s: r["by_scale"][s]["reverse_kl"])
            ax.plot(seed_kls, values, ".", color=color, alpha=0.35, ms=5)

    ax = axes[0, 2]  # cosine with the reverse-KL gradient against the KL
    for i, kind in enumerate(KL_TERMS[1:], start=1):
        against_kl(ax, lambda m, k=kind: m[k]["cosine_reverse"], f"C{i}", LABELS[kind])
    against_kl(ax, lambda m: m["cosine_reverse_forward"], "k", "the forward-KL gradient itself", ":")
    ax.set_xscale("log")
    ax.set_xlabel("sequence-level KL(pi || ref), nats (B scaled)")
    ax.set_ylabel("cosine with the reverse-KL gradient")
    ax.set_title("near the reference every KL gradient agrees; far from it they part", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)

    ax = axes[1, 0]  # norm ratio against the KL
    for i, kind in enumerate(KL_TERMS[1:], start=1):
        against_kl(ax, lambda m, k=kind: m[k]["norm_ratio"], f"C{i}", LABELS[kind])
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("sequence-level KL(pi || ref), nats (B scaled)")
    ax.set_ylabel("norm / norm of the reverse-KL gradient")
    ax.set_title("how hard each term pulls, relative to the reverse KL", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)

    sizes = list(settings.sample_sizes)
    for ax, which, title in ((axes[1, 1], 0, "cosine of the N-sample gradient with its own expectation"),
                             (axes[1, 2], 1, "cosine of the N-sample gradient with the reverse-KL gradient")):
        for i, kind in enumerate(KL_TERMS):
            if which == 0 and kind == "k1_loss":
                continue  # its expectation is 0: no direction to compare with
            per_seed = [[statistics.fmean(c[which] for r in result["runs"] if r["seed"] == seed
                                          for c in r["noise"][kind][n]) for seed in seeds] for n in sizes]
            ax.plot(sizes, [statistics.fmean(v) for v in per_seed], "-", marker=".", color=f"C{i}",
                    label=LABELS[kind])
            ax.fill_between(sizes, [min(v) for v in per_seed], [max(v) for v in per_seed], color=f"C{i}", alpha=0.12)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("N samples from pi")
        ax.set_ylabel(f"cosine (mean of {settings.repeats} repeats; band: seeds' range)")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)

    fig.suptitle(f"KL gradients, exactly: every two-token completion, {len(seeds)} seeds", fontsize=12)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=100)
    return fig
