"""The known wrong versions of Part 1's exercises (PPO): the policy with its value head, and the completion's slice, in
notebook order (PolicyWithValueHead, completion_slice).
Gathered into the part's registry by mistakes.py."""


import torch
import torch.nn as nn

from solutions import part1_ppo as ref
from tests.support import Exercise, mistake


# --- PolicyWithValueHead -----------------------------------------------------------------------------------

class _PolicyReadsResidPre(ref.PolicyWithValueHead):
    """The value head reads the residual stream *before* the last block (hook_resid_pre). It must read the final
    residual stream: blocks.{n_layers - 1}.hook_resid_post."""

    def __init__(self, model, d_hidden=64):
        super().__init__(model, d_hidden)
        self.hook_name = f"blocks.{model.cfg.n_layers - 1}.hook_resid_pre"


class _PolicyReadsFirstBlock(ref.PolicyWithValueHead):
    """The value head reads the first block's output (blocks.0.hook_resid_post). It must read the last block's:
    blocks.{n_layers - 1}.hook_resid_post."""

    def __init__(self, model, d_hidden=64):
        super().__init__(model, d_hidden)
        self.hook_name = "blocks.0.hook_resid_post"


class _PolicyReadsLnFinal(ref.PolicyWithValueHead):
    """The value head reads ln_final.hook_normalized, not the final residual stream. Hook
    blocks.{n_layers - 1}.hook_resid_post."""

    def __init__(self, model, d_hidden=64):
        super().__init__(model, d_hidden)
        self.hook_name = "ln_final.hook_normalized"


class _PolicyTwoPasses(ref.PolicyWithValueHead):
    """Runs the model twice: once for the logits, once (run_with_cache) for the values. Read the values with a hook
    during the one forward pass that makes the logits."""

    def forward(self, tokens, attention_mask=None):
        logits = self.model(tokens, attention_mask=attention_mask)
        _, cache = self.model.run_with_cache(tokens, attention_mask=attention_mask)
        return logits, self.value_head(cache[self.hook_name]).squeeze(-1)


class _PolicyHeadWithoutReLU(ref.PolicyWithValueHead):
    """The value head has no ReLU between its two layers, so it is one linear map of the residual stream. It is
    Linear(d_model, d_hidden) -> ReLU -> Linear(d_hidden, 1)."""

    def __init__(self, model, d_hidden=64):
        super().__init__(model, d_hidden)
        self.value_head = nn.Sequential(nn.Linear(model.cfg.d_model, d_hidden), nn.Linear(d_hidden, 1))


class _PolicySqueezesEverySize(ref.PolicyWithValueHead):
    """Squeezes the head's output with .squeeze(), which also drops the batch and position dimensions when they have
    size one. Squeeze only the last dimension: .squeeze(-1)."""

    def forward(self, tokens, attention_mask=None):
        logits, values = super().forward(tokens, attention_mask)
        return logits, values.unsqueeze(-1).squeeze()


@mistake("hooks")
class _PolicyHookLeftBehind(ref.PolicyWithValueHead):
    """Adds the hook with model.add_hook and never removes it, so it runs on every later forward pass. Use
    `with self.model.hooks(fwd_hooks=[...]):`, which removes it when the block ends."""

    def forward(self, tokens, attention_mask=None):
        stored = {}
        self.model.add_hook(self.hook_name, lambda resid, hook: stored.update(v=self.value_head(resid).squeeze(-1)))
        return self.model(tokens, attention_mask=attention_mask), stored["v"]


@mistake("hooks")
class _PolicyResetHooks(ref.PolicyWithValueHead):
    """Adds the hook with add_hook and cleans up with model.reset_hooks(), which removes every hook on the model,
    the caller's too. Use `with self.model.hooks(fwd_hooks=[...]):`, which removes only its own."""

    def forward(self, tokens, attention_mask=None):
        stored = {}
        self.model.add_hook(self.hook_name, lambda resid, hook: stored.update(v=self.value_head(resid).squeeze(-1)))
        logits = self.model(tokens, attention_mask=attention_mask)
        self.model.reset_hooks()
        return logits, stored["v"]


@mistake("hooks")
class _PolicyNoFinally(ref.PolicyWithValueHead):
    """Removes its hook after the forward pass, but not when the forward pass raises: the hook then stays on the
    model. Remove it in a `finally:` block, or use `with self.model.hooks(fwd_hooks=[...]):`."""

    def forward(self, tokens, attention_mask=None):
        stored = {}
        point = self.model.hook_dict[self.hook_name]
        point.add_hook(lambda resid, hook: stored.update(v=self.value_head(resid).squeeze(-1)))
        logits = self.model(tokens, attention_mask=attention_mask)
        point.remove_hooks("fwd")
        return logits, stored["v"]


@mistake("gradient")
class _PolicyDetached(ref.PolicyWithValueHead):
    """Detaches the residual stream before the value head, so the value loss cannot train the model's trunk. The
    head and the model share the trunk: pass the residual stream to the head as it is."""

    def forward(self, tokens, attention_mask=None):
        stored = {}

        def read(resid, hook):
            stored["v"] = self.value_head(resid.detach()).squeeze(-1)

        with self.model.hooks(fwd_hooks=[(self.hook_name, read)]):
            logits = self.model(tokens, attention_mask=attention_mask)
        return logits, stored["v"]


@mistake("argument")
class _PolicyIgnoresMask(ref.PolicyWithValueHead):
    """Does not pass attention_mask on to the model, so left padding changes the outputs. Call
    self.model(tokens, attention_mask=attention_mask)."""

    def forward(self, tokens, attention_mask=None):
        return super().forward(tokens)


@mistake("argument")
class _PolicyIgnoresDHidden(ref.PolicyWithValueHead):
    """Builds the value head with 64 hidden units whatever d_hidden says. Use nn.Linear(d_model, d_hidden)."""

    def __init__(self, model, d_hidden=64):
        super().__init__(model, 64)


class _PolicyValuesNotSqueezed(ref.PolicyWithValueHead):
    """Returns the values as [batch, seq, 1]: the head's last dimension of size 1 must be squeezed away
    (.squeeze(-1)) to give [batch, seq]."""

    def forward(self, tokens, attention_mask=None):
        logits, values = super().forward(tokens, attention_mask)
        return logits, values[..., None]


@mistake("inputs")
class _PolicyWritesIntoTokens(ref.PolicyWithValueHead):
    """Overwrites the padding tokens of its `tokens` argument in place (tokens[mask == 0] = ...). The caller still
    needs them: leave the tokens alone (the attention mask already hides the padding)."""

    def forward(self, tokens, attention_mask=None):
        if attention_mask is not None:
            tokens[attention_mask == 0] = 0
        return super().forward(tokens, attention_mask)


@mistake("lora")
class _PolicyRunWithHooks(ref.PolicyWithValueHead):
    """Calls self.model.run_with_hooks(...), which a bare TransformerLens model has but Part 2's LoRAModel does not
    (and the base's run_with_hooks would skip the adapters). Use `with self.model.hooks(fwd_hooks=[...]):` around
    self.model(tokens, attention_mask=...): both kinds of model support it."""

    def forward(self, tokens, attention_mask=None):
        stored = {}

        def read(resid, hook):
            stored["v"] = self.value_head(resid).squeeze(-1)

        logits = self.model.run_with_hooks(tokens, attention_mask=attention_mask, fwd_hooks=[(self.hook_name, read)])
        return logits, stored["v"]


@mistake("lora")
class _PolicyBypassesAdapters(ref.PolicyWithValueHead):
    """Runs the bare base model (getattr(model, "base", model)), so on a LoRAModel the adapters never act and
    nothing trains them. Call self.model(...) itself: a LoRAModel adds its LoRA hooks in its own forward."""

    def forward(self, tokens, attention_mask=None):
        base = getattr(self.model, "base", self.model)
        stored = {}

        def read(resid, hook):
            stored["v"] = self.value_head(resid).squeeze(-1)

        with base.hooks(fwd_hooks=[(self.hook_name, read)]):
            logits = base(tokens, attention_mask=attention_mask)
        return logits, stored["v"]


# --- completion_slice --------------------------------------------------------------------------------------

def _slice_shifted(x, prompt_len):
    """Starts at prompt_len, one position too late: completion token j is chosen at position prompt_len - 1 + j
    (the logits at position t score token t + 1), so the slice is x[:, prompt_len - 1:-1]."""
    if not 1 <= prompt_len < x.shape[1]:
        raise ValueError("prompt_len out of range")
    return x[:, prompt_len:]


def _slice_keeps_last(x, prompt_len):
    """Keeps the last position, which chooses a token after the end of the sample. Drop it: x[:, prompt_len - 1:-1]."""
    if not 1 <= prompt_len < x.shape[1]:
        raise ValueError("prompt_len out of range")
    return x[:, prompt_len - 1:]


def _slice_late_start_drops_last(x, prompt_len):
    """Drops the last position but starts at prompt_len: start one earlier, at prompt_len - 1 (the prompt's last
    position chooses the first completion token)."""
    if not 1 <= prompt_len < x.shape[1]:
        raise ValueError("prompt_len out of range")
    return x[:, prompt_len:-1]


def _slice_last_dim(x, prompt_len):
    """Slices the last dimension (x[..., prompt_len - 1:-1]) rather than the sequence dimension, dimension 1:
    right for [batch, seq] values, wrong for [batch, seq, vocab] logits. Use x[:, prompt_len - 1:-1]."""
    if not 1 <= prompt_len < x.shape[1]:
        raise ValueError("prompt_len out of range")
    return x[..., prompt_len - 1:-1]


@mistake("error")
def _slice_no_refusal(x, prompt_len):
    """Does not check prompt_len, so an impossible one returns an empty or wrong slice silently. Raise a ValueError
    unless 1 <= prompt_len < seq."""
    return x[:, prompt_len - 1:-1]


@mistake("error")
def _slice_refuses_only_zero(x, prompt_len):
    """Refuses prompt_len < 1 but not prompt_len >= seq, which leaves no completion token. Raise a ValueError
    unless 1 <= prompt_len < seq."""
    if prompt_len < 1:
        raise ValueError("prompt_len must be at least 1")
    return x[:, prompt_len - 1:-1]


@mistake("error")
def _slice_asserts(x, prompt_len):
    """Checks prompt_len with `assert`, which raises AssertionError (and disappears under python -O). Raise the
    ValueError the docstring promises."""
    assert 1 <= prompt_len < x.shape[1], "prompt_len out of range"
    return x[:, prompt_len - 1:-1]


@mistake("gradient")
def _slice_detached(x, prompt_len):
    """Returns a detached copy (.detach().clone()), so no gradient flows back to the logits or values. A slice
    x[:, prompt_len - 1:-1] keeps the graph."""
    if not 1 <= prompt_len < x.shape[1]:
        raise ValueError("prompt_len out of range")
    return x[:, prompt_len - 1:-1].detach().clone()


@mistake("inputs")
def _slice_zeroes_the_last_position(x, prompt_len):
    """Blanks the unused last position of the input in place (x[:, -1] = 0) before slicing. Do not write into the
    input: slicing x[:, prompt_len - 1:-1] already leaves that position out."""
    if not 1 <= prompt_len < x.shape[1]:
        raise ValueError("prompt_len out of range")
    with torch.no_grad():
        x[:, -1] = 0
    return x[:, prompt_len - 1:-1]


EXERCISES = {
    "PolicyWithValueHead": Exercise(
        wrong=[_PolicyReadsResidPre, _PolicyReadsFirstBlock, _PolicyReadsLnFinal, _PolicyTwoPasses,
               _PolicyHookLeftBehind, _PolicyResetHooks, _PolicyNoFinally, _PolicyDetached, _PolicyIgnoresMask,
               _PolicyIgnoresDHidden, _PolicyValuesNotSqueezed, _PolicyWritesIntoTokens, _PolicyRunWithHooks,
               _PolicyBypassesAdapters],
        on_lora_model=True,
    ),
    "completion_slice": Exercise(
        wrong=[_slice_shifted, _slice_keeps_last, _slice_late_start_drops_last, _slice_last_dim, _slice_no_refusal,
               _slice_refuses_only_zero, _slice_asserts, _slice_detached, _slice_zeroes_the_last_position],
    ),
}
