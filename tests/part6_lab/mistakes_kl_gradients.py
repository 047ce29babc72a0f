"""The known wrong versions of the kl_gradients experiment's exercises: two_token_logprobs, token_kl_estimate,
estimator_surrogate. Each docstring is what a learner whose version fails the same way reads."""

import torch

from solutions import part6_lab as ref
from tests.support import Exercise, mistake


# --- two_token_logprobs ------------------------------------------------------------------------------------------

def _two_token(model, prompt, first_tokens=None, *, first_at=-2, second_at=-1, normalise="log_softmax",
               all_rows=False, grad=True, in_place=False, return_type=False):
    if all_rows or first_tokens is None:
        first_tokens = torch.arange(model.cfg.d_vocab)
    if in_place:
        prompt = prompt.unsqueeze_(0)
    batch = torch.cat([prompt.expand(len(first_tokens), -1), first_tokens[:, None]], dim=1)
    with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
        logits = model(batch, return_type="logits") if return_type else model(batch)
        if normalise == "log_softmax":
            out = logits.log_softmax(dim=-1)
        elif normalise == "softmax":
            out = logits.softmax(dim=-1)
        elif normalise == "rows":
            out = logits.log_softmax(dim=0)
        else:
            out = logits
    return out[0, first_at], out[:, second_at]


def _second_at_prompt_position(model, prompt, first_tokens=None):
    """The second token is scored at the prompt's last position, the one that predicts the FIRST token. Logits at
    position t predict token t + 1: log pi(b | prompt, a) is read at a's position, the last of the row (-1)."""
    return _two_token(model, prompt, first_tokens, second_at=-2)


def _first_at_last_position(model, prompt, first_tokens=None):
    """The first token is read at the last position of row 0, which predicts the token AFTER first_tokens[0]. The
    prediction of the first token is made at the prompt's last position: index -2 of each row."""
    return _two_token(model, prompt, first_tokens, first_at=-1)


def _raw_logits(model, prompt, first_tokens=None):
    """Returns raw logits, not log-probs. Normalise over the vocabulary: logits.log_softmax(dim=-1)."""
    return _two_token(model, prompt, first_tokens, normalise="none")


def _probabilities(model, prompt, first_tokens=None):
    """Returns probabilities (softmax), not log-probabilities: use log_softmax(dim=-1)."""
    return _two_token(model, prompt, first_tokens, normalise="softmax")


def _normalised_over_rows(model, prompt, first_tokens=None):
    """Normalises over the batch of rows (log_softmax(dim=0)) instead of over the vocabulary: each row's prediction
    is a distribution over the next token, log_softmax(dim=-1)."""
    return _two_token(model, prompt, first_tokens, normalise="rows")


@mistake("argument")
def _ignores_first_tokens(model, prompt, first_tokens=None):
    """Ignores first_tokens and always runs every token of the vocabulary: row i must be prompt + first_tokens[i]
    when first_tokens is given (the experiment runs only the first tokens it sampled)."""
    return _two_token(model, prompt, first_tokens, all_rows=True)


@mistake("gradient")
def _under_no_grad(model, prompt, first_tokens=None):
    """Runs the model under torch.no_grad(): the policy's log-probs carry no gradient, and no KL gradient can be
    computed from them. Leave gradients on; the caller wraps the reference's call in torch.no_grad()."""
    return _two_token(model, prompt, first_tokens, grad=False)


@mistake("inputs")
def _prompt_unsqueezed_in_place(model, prompt, first_tokens=None):
    """Makes the prompt a batch of one with prompt.unsqueeze_(0), which changes the caller's tensor (its shape)
    in place: use prompt[None] or prompt.expand(rows, -1), which return new views."""
    return _two_token(model, prompt, first_tokens, in_place=True)


@mistake("lora")
def _return_type_argument(model, prompt, first_tokens=None):
    """Calls model(batch, return_type="logits"), an argument of the TransformerLens model that a LoRAModel's forward
    does not take (it takes tokens and an attention mask): call model(batch), which is logits for both."""
    return _two_token(model, prompt, first_tokens, return_type=True)


# --- token_kl_estimate -------------------------------------------------------------------------------------------

def _k3_wrong_way_round(logp, ref_logp, kind):
    """k3 with the ratio the wrong way round: exp(log_ratio) - 1 - log_ratio uses pi/ref. Schulman's k3 (TRL's
    per_token_kl) uses r = ref/pi: r - 1 - log r = exp(-log_ratio) - 1 + log_ratio."""
    log_ratio = logp - ref_logp
    return {"k1": log_ratio, "k2": log_ratio ** 2 / 2, "k3": torch.exp(log_ratio) - 1 - log_ratio}[kind]


def _k2_without_half(logp, ref_logp, kind):
    """k2 without the 1/2: it is log_ratio ** 2 / 2."""
    log_ratio = logp - ref_logp
    return {"k1": log_ratio, "k2": log_ratio ** 2, "k3": torch.exp(-log_ratio) - 1 + log_ratio}[kind]


def _k1_reversed(logp, ref_logp, kind):
    """k1 the wrong way round (ref_logp - logp): the estimate of KL(pi || ref) from a sample of pi is
    log pi - log ref."""
    log_ratio = logp - ref_logp
    return {"k1": -log_ratio, "k2": log_ratio ** 2 / 2, "k3": torch.exp(-log_ratio) - 1 + log_ratio}[kind]


def _k1_absolute(logp, ref_logp, kind):
    """k1 made non-negative with abs(): k1 is the plain log-ratio, negative where pi < ref; that is what makes it
    unbiased (and noisy). For a non-negative estimate use k2 or k3."""
    log_ratio = logp - ref_logp
    return {"k1": log_ratio.abs(), "k2": log_ratio ** 2 / 2, "k3": torch.exp(-log_ratio) - 1 + log_ratio}[kind]


def _estimate_ignores_kind(logp, ref_logp, kind):
    """Always returns k3, whatever `kind` asks for: k1 is the log-ratio, k2 half its square."""
    log_ratio = logp - ref_logp
    return torch.exp(-log_ratio) - 1 + log_ratio


@mistake("gradient")
def _k3_ratio_detached(logp, ref_logp, kind):
    """k3's ratio exp(-log_ratio) is detached: the values are right but half of the gradient is missing. Every term
    of the estimate must stay differentiable: its gradient is what the loss trains with."""
    log_ratio = logp - ref_logp
    return {"k1": log_ratio, "k2": log_ratio ** 2 / 2, "k3": torch.exp(-log_ratio).detach() - 1 + log_ratio}[kind]


@mistake("inputs")
def _log_ratio_in_place(logp, ref_logp, kind):
    """Computes the log-ratio in place (logp -= ref_logp), which overwrites the caller's log-probs: compute a new
    tensor, log_ratio = logp - ref_logp."""
    log_ratio = logp.sub_(ref_logp)
    return {"k1": log_ratio, "k2": log_ratio ** 2 / 2, "k3": torch.exp(-log_ratio) - 1 + log_ratio}[kind]


# --- estimator_surrogate -----------------------------------------------------------------------------------------

def _surrogate(weights, first, second, ref_first, ref_second, first_tokens, kind, *, detach=True,
               stop_reward=True, reward_per_token=False, by_column=False, exact="reverse", reduce="sum",
               only_k3=False, in_place=False):
    w = weights.detach() if detach else weights
    if in_place:
        w.clamp_(min=1e-12)
    if by_column:
        lp1, ref_lp1 = first[None, :].expand_as(second), ref_first[None, :].expand_as(second)
    else:
        lp1, ref_lp1 = first[first_tokens][:, None].expand_as(second), ref_first[first_tokens][:, None].expand_as(second)
    if kind == "exact_token_loss" and not only_k3:
        if exact == "forward":
            kl1 = (ref_first.exp() * (ref_first - first)).sum()
            kl2 = (ref_second.exp() * (ref_second - second)).sum(-1, keepdim=True)
        else:
            kl1 = (first.exp() * (first - ref_first)).sum()
            kl2 = (second.exp() * (second - ref_second)).sum(-1, keepdim=True)
        per = (0.0 if exact == "second_only" else kl1) + kl2
    elif kind == "k1_reward" and not only_k3:
        if reward_per_token:
            per = (lp1 - ref_lp1).detach() * lp1 + (second - ref_second).detach() * second
        else:
            logp, ref_logp = lp1 + second, ref_lp1 + ref_second
            ratio = (logp - ref_logp).detach() if stop_reward else logp - ref_logp
            per = ratio * logp
    else:
        estimator = "k3" if only_k3 else kind.removesuffix("_loss")
        per = ref.token_kl_estimate(lp1, ref_lp1, estimator) + ref.token_kl_estimate(second, ref_second, estimator)
    total = w * per
    return total.mean() if reduce == "mean" else total.sum()


@mistake("gradient")
def _weights_not_detached(weights, first, second, ref_first, ref_second, first_tokens, kind):
    """The weights are not detached: when they are pi(y) computed from the policy, the gradient then includes
    grad pi(y) * L(y), i.e. it differentiates through the sampling, which training never does (the samples are
    given). Use weights.detach(): the result is then the expected gradient of L under y ~ pi."""
    return _surrogate(weights, first, second, ref_first, ref_second, first_tokens, kind, detach=False)


@mistake("gradient")
def _reward_not_stopped(weights, first, second, ref_first, ref_second, first_tokens, kind):
    """k1_reward without the stop-gradient on the log-ratio: a reward is a number, not part of the graph. The score
    function is sg(log pi(y) - log ref(y)) * log pi(y): detach the log-ratio."""
    return _surrogate(weights, first, second, ref_first, ref_second, first_tokens, kind, stop_reward=False)


def _reward_per_token(weights, first, second, ref_first, ref_second, first_tokens, kind):
    """k1_reward with each token's own log-ratio as its reward: the first token then ignores the KL of what comes
    after it. In the reward, the KL is the sequence's: sg(log pi(y) - log ref(y)) * (log pi(a) + log pi(b | a))."""
    return _surrogate(weights, first, second, ref_first, ref_second, first_tokens, kind, reward_per_token=True)


def _first_token_by_column(weights, first, second, ref_first, ref_second, first_tokens, kind):
    """The first token's log-probs are broadcast along the columns (first[None, :]), so column b gets log pi(b |
    prompt): the completion (first_tokens[i], b) starts with first_tokens[i], whose log-prob is first[first_tokens[i]]
    (first[first_tokens][:, None], one per row)."""
    return _surrogate(weights, first, second, ref_first, ref_second, first_tokens, kind, by_column=True)


def _exact_token_forward(weights, first, second, ref_first, ref_second, first_tokens, kind):
    """The exact per-token KL the wrong way round, KL(ref || pi) = sum ref (log ref - log pi): the term is the
    reverse KL(pi || ref) = sum_b pi(b|s) (log pi(b|s) - log ref(b|s)) at each visited state."""
    return _surrogate(weights, first, second, ref_first, ref_second, first_tokens, kind, exact="forward")


def _exact_token_second_only(weights, first, second, ref_first, ref_second, first_tokens, kind):
    """The exact per-token KL at the second state only: the prompt is a visited state too, and its KL (over the
    first token's distribution) belongs to every completion's sum."""
    return _surrogate(weights, first, second, ref_first, ref_second, first_tokens, kind, exact="second_only")


def _surrogate_mean(weights, first, second, ref_first, ref_second, first_tokens, kind):
    """Takes the mean over the [rows, vocab] table instead of the weighted sum: the weights already average (they sum
    to 1), so sum weights * L; a mean divides once more, by rows * vocab."""
    return _surrogate(weights, first, second, ref_first, ref_second, first_tokens, kind, reduce="mean")


def _surrogate_ignores_kind(weights, first, second, ref_first, ref_second, first_tokens, kind):
    """Always builds k3 in the loss, whatever `kind` asks for: each kind puts the KL into training another way."""
    return _surrogate(weights, first, second, ref_first, ref_second, first_tokens, kind, only_k3=True)


@mistake("inputs")
def _weights_clamped_in_place(weights, first, second, ref_first, ref_second, first_tokens, kind):
    """Clamps the weights in place (w = weights.detach(); w.clamp_(min=1e-12)): detach() shares the caller's storage,
    so this overwrites their weights (the zeros of the completions never sampled). Leave the weights as given; to
    change them, make a new tensor (w.clamp(min=...), no trailing underscore)."""
    return _surrogate(weights, first, second, ref_first, ref_second, first_tokens, kind, in_place=True)


EXERCISES = {
    "two_token_logprobs": Exercise(
        wrong=[_second_at_prompt_position, _first_at_last_position, _raw_logits, _probabilities,
               _normalised_over_rows, _ignores_first_tokens, _under_no_grad, _prompt_unsqueezed_in_place,
               _return_type_argument],
        on_lora_model=True,
    ),
    "token_kl_estimate": Exercise(
        wrong=[_k3_wrong_way_round, _k2_without_half, _k1_reversed, _k1_absolute, _estimate_ignores_kind,
               _k3_ratio_detached, _log_ratio_in_place],
    ),
    "estimator_surrogate": Exercise(
        wrong=[_weights_not_detached, _reward_not_stopped, _reward_per_token, _first_token_by_column,
               _exact_token_forward, _exact_token_second_only, _surrogate_mean, _surrogate_ignores_kind,
               _weights_clamped_in_place],
    ),
}
