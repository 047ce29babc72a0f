"""The known wrong versions of the hacking experiment's exercises (the reward model's pieces): bradley_terry_loss,
last_token_scores, reward_model_scores. Each docstring is what a learner whose version fails the same way reads."""

import torch
import torch.nn.functional as F

from solutions import part6_lab as ref
from tests.support import Exercise, mistake


# --- bradley_terry_loss ------------------------------------------------------------------------------------------

def _bt_refuse(chosen_scores, rejected_scores):
    if chosen_scores.shape != rejected_scores.shape or chosen_scores.dim() != 1:
        raise ValueError("bradley_terry_loss takes two [pairs] tensors of one shape")


def _bt_swapped(chosen_scores, rejected_scores):
    """Computes -log sigmoid(rejected - chosen), the margin the wrong way round (the two scores swapped, or
    F.softplus(chosen - rejected), which is the same): the loss then prefers the rejected answer. Minimise
    -log sigmoid(chosen - rejected) = F.softplus(rejected - chosen)."""
    _bt_refuse(chosen_scores, rejected_scores)
    return -F.logsigmoid(rejected_scores - chosen_scores).mean()


def _bt_log_of_sigmoid(chosen_scores, rejected_scores):
    """Computed log(sigmoid(margin)) in two steps: for a margin of -200, sigmoid underflows to 0 and its log is -inf,
    so the loss is inf. F.logsigmoid(margin) computes the same value in one stable step."""
    _bt_refuse(chosen_scores, rejected_scores)
    return -torch.log(torch.sigmoid(chosen_scores - rejected_scores)).mean()


def _bt_without_log(chosen_scores, rejected_scores):
    """Minimised 1 - sigmoid(margin), without the log: the Bradley-Terry loss is the negative log-likelihood,
    -log sigmoid(margin) (F.logsigmoid)."""
    _bt_refuse(chosen_scores, rejected_scores)
    return (1 - torch.sigmoid(chosen_scores - rejected_scores)).mean()


def _bt_summed(chosen_scores, rejected_scores):
    """Summed the per-pair losses: average them (.mean()), so that the loss does not grow with the batch."""
    _bt_refuse(chosen_scores, rejected_scores)
    return -F.logsigmoid(chosen_scores - rejected_scores).sum()


def _bt_hinge(chosen_scores, rejected_scores):
    """A hinge, max(0, 1 - margin), instead of the logistic loss -log sigmoid(margin): Bradley-Terry is a logistic
    model of the preference."""
    _bt_refuse(chosen_scores, rejected_scores)
    return torch.relu(1 - (chosen_scores - rejected_scores)).mean()


def _bt_means_first(chosen_scores, rejected_scores):
    """Averaged the scores before the sigmoid (-log sigmoid(mean(chosen) - mean(rejected))): the loss is per pair,
    then averaged over the pairs."""
    _bt_refuse(chosen_scores, rejected_scores)
    return -F.logsigmoid(chosen_scores.mean() - rejected_scores.mean())


@mistake("error")
def _bt_no_shape_check(chosen_scores, rejected_scores):
    """Accepted scores of different shapes, which broadcast silently ([pairs, 1] against [pairs] gives every chosen
    against every rejected): raise a ValueError unless both are [pairs] tensors of one shape."""
    return -F.logsigmoid(chosen_scores - rejected_scores).mean()


@mistake("error")
def _bt_shapes_only(chosen_scores, rejected_scores):
    """Refused scores of different shapes but not scores of one shape that are not [pairs]: two [pairs, 1] columns
    (or [pairs, k] tensors) are averaged as if every element were a pair. Raise a ValueError unless they are 1-D
    too (chosen_scores.dim() == 1)."""
    if chosen_scores.shape != rejected_scores.shape:
        raise ValueError("bradley_terry_loss takes two tensors of one shape")
    return -F.logsigmoid(chosen_scores - rejected_scores).mean()


@mistake("gradient")
def _bt_rejected_detached(chosen_scores, rejected_scores):
    """Detached the rejected scores, as if they were constants: both come from the reward model being trained, and
    the loss must push the rejected score down too."""
    _bt_refuse(chosen_scores, rejected_scores)
    return -F.logsigmoid(chosen_scores - rejected_scores.detach()).mean()


@mistake("inputs")
def _bt_in_place(chosen_scores, rejected_scores):
    """Wrote the margin into the caller's tensor (chosen_scores -= rejected_scores): compute the margin as a new
    tensor, chosen_scores - rejected_scores."""
    _bt_refuse(chosen_scores, rejected_scores)
    chosen_scores -= rejected_scores
    return -F.logsigmoid(chosen_scores).mean()


# --- last_token_scores -------------------------------------------------------------------------------------------

def _last_index(attention_mask):
    positions = torch.arange(attention_mask.shape[1])
    return torch.where(attention_mask.bool(), positions, -1).amax(1)


def _last_refuse(attention_mask):
    if not attention_mask.bool().any(1).all():
        raise ValueError("a row with no real token")


def _last_column(scores, attention_mask):
    """Read every row at the last column (scores[:, -1]), which is padding for a completion shorter than the longest:
    read at the last position where attention_mask is 1."""
    _last_refuse(attention_mask)
    return scores[:, -1]


def _last_by_count(scores, attention_mask):
    """Read each row at position attention_mask.sum(1) - 1, which is its last real token only without left padding:
    the prompts are padded on the left, so take the largest position t where the mask is 1."""
    _last_refuse(attention_mask)
    return scores.gather(1, (attention_mask.sum(1) - 1)[:, None]).squeeze(1)


def _last_first_real(scores, attention_mask):
    """Read each row at its FIRST real token (attention_mask.argmax(1)): a reward model's score is read at the last
    real token, the only one that has seen the whole completion."""
    _last_refuse(attention_mask)
    return scores.gather(1, attention_mask.argmax(1)[:, None]).squeeze(1)


def _last_first_column(scores, attention_mask):
    """Read every row at position 0 (scores[:, 0]): the first token has seen nothing of the completion; read at each
    row's last real token."""
    _last_refuse(attention_mask)
    return scores[:, 0]


def _last_mean_over_real(scores, attention_mask):
    """Averaged the scores over each row's real tokens (mean pooling): the reward is the score at the last real token,
    as TRL's reward models read it."""
    _last_refuse(attention_mask)
    mask = attention_mask.to(scores.dtype)
    return (scores * mask).sum(1) / mask.sum(1)


def _last_mean_over_all(scores, attention_mask):
    """Averaged the scores over every position, padding included: read the one score at each row's last real
    token."""
    _last_refuse(attention_mask)
    return scores.mean(1)


def _last_one_past(scores, attention_mask):
    """Read one position past the last real token (the first padding after the completion, e.g. the index of the
    last 1 plus one): read AT the last position where the mask is 1."""
    _last_refuse(attention_mask)
    index = (_last_index(attention_mask) + 1).clamp(max=scores.shape[1] - 1)
    return scores.gather(1, index[:, None]).squeeze(1)


@mistake("error")
def _last_no_empty_check(scores, attention_mask):
    """A row with no real token was silently read at position 0 (argmax of a mask of zeros is 0): raise a ValueError
    when a row of attention_mask has no 1."""
    positions = torch.arange(attention_mask.shape[1])
    return scores.gather(1, (attention_mask * positions).argmax(1)[:, None]).squeeze(1)


@mistake("gradient")
def _last_rebuilt(scores, attention_mask):
    """Built the result from Python numbers (torch.tensor of .tolist() values), which cuts it off from autograd: the
    reward model trains through these scores, so keep to tensor operations (gather or indexing)."""
    return torch.tensor(ref.last_token_scores(scores, attention_mask).tolist())


@mistake("inputs")
def _last_masks_in_place(scores, attention_mask):
    """Wrote into the caller's scores (masked_fill_ of the padding) before reading them: the caller still needs them;
    use the out-of-place masked_fill, or index without changing anything."""
    _last_refuse(attention_mask)
    scores.masked_fill_(attention_mask == 0, 0.0)
    return ref.last_token_scores(scores, attention_mask)


# --- reward_model_scores -----------------------------------------------------------------------------------------

def _rm_resid(model, ids, attention_mask, point="ln_final.hook_normalized", mask=True):
    kept = {}

    def keep(x, hook):
        kept["x"] = x

    with model.hooks(fwd_hooks=[(point, keep)]):
        model(ids, attention_mask=attention_mask) if mask else model(ids)
    return kept["x"]


def _rm_last_column(model, head, ids, attention_mask):
    """Read the scores at the last column (head(resid)[:, -1]), which is padding for the shorter completions: read
    each row at its last real token, last_token_scores(scores, attention_mask)."""
    return head(_rm_resid(model, ids, attention_mask)).squeeze(-1)[:, -1]


def _rm_before_final_block(model, head, ids, attention_mask):
    """Read the residual stream before the last block (blocks.{n_layers - 1}.hook_resid_pre): the reward model's head
    reads the FINAL residual stream, at 'ln_final.hook_normalized'."""
    point = f"blocks.{model.cfg.n_layers - 1}.hook_resid_pre"
    return ref.last_token_scores(head(_rm_resid(model, ids, attention_mask, point)).squeeze(-1), attention_mask)


def _rm_no_attention_mask(model, head, ids, attention_mask):
    """Ran the model without the attention mask, so the left padding of the short prompts was read as text: pass
    attention_mask to the forward pass (and to last_token_scores)."""
    return ref.last_token_scores(head(_rm_resid(model, ids, attention_mask, mask=False)).squeeze(-1),
                                 attention_mask)


def _rm_mean_pool(model, head, ids, attention_mask):
    """Averaged the head's scores over the real tokens (mean pooling): read the score at each row's last real token,
    the only position that has seen the whole completion."""
    scores = head(_rm_resid(model, ids, attention_mask)).squeeze(-1)
    mask = attention_mask.to(scores.dtype)
    return (scores * mask).sum(1) / mask.sum(1)


@mistake("gradient")
def _rm_no_grad(model, head, ids, attention_mask):
    """Computed the scores under torch.no_grad(): the reward model trains through them with the Bradley-Terry loss.
    Use no_grad only where the reward model is used as a reward (in the GRPO reward function)."""
    with torch.no_grad():
        return ref.reward_model_scores(model, head, ids, attention_mask)


@mistake("hooks")
def _rm_hook_left_attached(model, head, ids, attention_mask):
    """Added the hook with model.add_hook and never removed it: every later forward pass runs it. Use
    `with model.hooks(fwd_hooks=[...]):`, which removes it when done (also when the forward pass raises)."""
    kept = {}

    def keep(x, hook):
        kept["x"] = x

    model.add_hook("ln_final.hook_normalized", keep)
    model(ids, attention_mask=attention_mask)
    return ref.last_token_scores(head(kept["x"]).squeeze(-1), attention_mask)


@mistake("hooks")
def _rm_resets_hooks(model, head, ids, attention_mask):
    """Cleaned up with model.reset_hooks(), which removes the caller's hooks too: `with model.hooks(fwd_hooks=...)`
    removes only its own."""
    kept = {}

    def keep(x, hook):
        kept["x"] = x

    model.add_hook("ln_final.hook_normalized", keep)
    try:
        model(ids, attention_mask=attention_mask)
    finally:
        model.reset_hooks()
    return ref.last_token_scores(head(kept["x"]).squeeze(-1), attention_mask)


@mistake("hooks")
def _rm_no_finally(model, head, ids, attention_mask):
    """Removed its hook after the forward pass but not when the forward pass raised (no try/finally): the hook then
    stays attached. `with model.hooks(fwd_hooks=...)` removes it either way."""
    kept = {}

    def keep(x, hook):
        kept["x"] = x

    model.add_hook("ln_final.hook_normalized", keep)
    model(ids, attention_mask=attention_mask)
    model.hook_dict["ln_final.hook_normalized"].remove_hooks()
    return ref.last_token_scores(head(kept["x"]).squeeze(-1), attention_mask)


@mistake("inputs")
def _rm_overwrites_padding(model, head, ids, attention_mask):
    """Overwrote the padding of the caller's ids in place (ids[attention_mask == 0] = 0): the caller still needs
    them, and the attention mask already keeps the padding out."""
    ids[attention_mask == 0] = 0
    return ref.reward_model_scores(model, head, ids, attention_mask)


EXERCISES = {
    "bradley_terry_loss": Exercise(
        wrong=[_bt_swapped, _bt_log_of_sigmoid, _bt_without_log, _bt_summed, _bt_hinge, _bt_means_first,
               _bt_no_shape_check, _bt_shapes_only, _bt_rejected_detached, _bt_in_place],
    ),
    "last_token_scores": Exercise(
        wrong=[_last_column, _last_by_count, _last_first_real, _last_first_column, _last_mean_over_real,
               _last_mean_over_all, _last_one_past, _last_no_empty_check, _last_rebuilt, _last_masks_in_place],
    ),
    "reward_model_scores": Exercise(
        wrong=[_rm_last_column, _rm_before_final_block, _rm_no_attention_mask, _rm_mean_pool, _rm_no_grad,
               _rm_hook_left_attached, _rm_resets_hooks, _rm_no_finally, _rm_overwrites_padding],
    ),
}
