"""The known wrong versions of Part 2's exercises, in notebook order, and the REGISTRY that names them.

Each docstring is what a learner reads when their version fails the same way: what was done wrong, and what to do
instead. The meta-test (test_meta.py) proves that each one fails the exercise's tests and is named.
"""

import math
from pathlib import Path

import torch
import torch.nn as nn

from solutions import part2_lora as ref
from solutions.part0_warmup import completion_logprobs
from tests.support import Exercise, Registry, mistake, only_on


# --- LoRA ---------------------------------------------------------------------------------------------------------

class _LoRARandomB(ref.LoRA):
    """Initialises B at random. B must start at zero (nn.init.zeros_ or torch.zeros), so that the adapted model
    starts as exactly the base model."""

    def __init__(self, d_in, d_out, rank=8, alpha=16.0):
        super().__init__(d_in, d_out, rank, alpha)
        nn.init.normal_(self.B, std=0.02)


class _LoRANoScale(ref.LoRA):
    """Leaves out the alpha / rank scaling in forward: multiply x Aᵀ Bᵀ by self.scale."""

    def forward(self, x):
        return x @ self.A.T @ self.B.T


class _LoRAScaleAlpha(ref.LoRA):
    """Scales by alpha instead of alpha / rank: scale = alpha / rank."""

    def __init__(self, d_in, d_out, rank=8, alpha=16.0):
        super().__init__(d_in, d_out, rank, alpha)
        self.scale = alpha


class _LoRAIntegerScale(ref.LoRA):
    """Computes the scale with integer division (alpha // rank), which is wrong whenever rank does not divide
    alpha: use alpha / rank."""

    def __init__(self, d_in, d_out, rank=8, alpha=16.0):
        super().__init__(d_in, d_out, rank, alpha)
        self.scale = alpha // rank


class _LoRAZeroA(ref.LoRA):
    """Initialises A to zeros too: then B's gradient is 0 and the adapter never learns. Only B starts at zero; A is
    Kaiming-uniform (nn.init.kaiming_uniform_(A, a=math.sqrt(5)))."""

    def __init__(self, d_in, d_out, rank=8, alpha=16.0):
        super().__init__(d_in, d_out, rank, alpha)
        nn.init.zeros_(self.A)


class _LoRAKaimingDefault(ref.LoRA):
    """Initialises A with nn.init.kaiming_uniform_(A) without a=math.sqrt(5), which draws from a range sqrt(6) times
    wider than nn.Linear's: pass a=math.sqrt(5)."""

    def __init__(self, d_in, d_out, rank=8, alpha=16.0):
        super().__init__(d_in, d_out, rank, alpha)
        nn.init.kaiming_uniform_(self.A)


class _LoRATransposed(nn.Module):
    """Stores A as [d_in, rank] and B as [rank, d_out]: forward is right, but merge_lora, save_adapter and
    load_adapter expect A: [rank, d_in] and B: [d_out, rank] (nn.Linear's [out, in] layout)."""

    def __init__(self, d_in, d_out, rank=8, alpha=16.0):
        super().__init__()
        self.A = nn.Parameter(torch.empty(d_in, rank))
        self.B = nn.Parameter(torch.zeros(rank, d_out))
        nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))
        self.scale = alpha / rank

    def forward(self, x):
        return x @ self.A @ self.B * self.scale


@mistake("argument")
class _LoRAIgnoresRank(ref.LoRA):
    """Builds A and B with rank 8 whatever `rank` is: use the `rank` argument for their shapes."""

    def __init__(self, d_in, d_out, rank=8, alpha=16.0):
        super().__init__(d_in, d_out, 8, alpha)
        self.scale = alpha / rank


@mistake("argument")
class _LoRAIgnoresAlpha(ref.LoRA):
    """Uses alpha = 16 whatever `alpha` is: scale = alpha / rank with the `alpha` argument."""

    def __init__(self, d_in, d_out, rank=8, alpha=16.0):
        super().__init__(d_in, d_out, rank, 16.0)


@mistake("gradient")
class _LoRADetachesInput(ref.LoRA):
    """Detaches x in forward: the values are right, but no gradient flows back through the adapter into the
    layers before it. Use x as it is."""

    def forward(self, x):
        return super().forward(x.detach())


@mistake("gradient")
class _LoRATrainableScale(ref.LoRA):
    """Makes the scale an nn.Parameter, so the optimiser trains it too: it is a constant, a plain float."""

    def __init__(self, d_in, d_out, rank=8, alpha=16.0):
        super().__init__(d_in, d_out, rank, alpha)
        self.scale = nn.Parameter(torch.tensor(alpha / rank))


@mistake("inputs")
class _LoRAScalesInputInPlace(ref.LoRA):
    """Scales x in place (x *= scale, or x.mul_): that changes the caller's tensor, here the base model's own
    activation. Compute a new tensor: (x @ A.T) @ B.T * scale."""

    def forward(self, x):
        x *= self.scale
        return x @ self.A.T @ self.B.T


# --- lora_hooks ---------------------------------------------------------------------------------------------------

@mistake("deep")
def _hooks_layer_from_one_digit(model, adapters):
    """Read the layer as key[1], one character: "L10_q" and "L11_q" then put their updates on block 1, and blocks 10
    and 11 get none. The tiny model's 4 blocks hide it; GPT-2 small has 12. Read the whole number before the
    underscore: layer, target = key[1:].split("_", 1)."""
    hooks = []
    for key, adapter in adapters.items():
        hooks += ref.lora_hooks(model, nn.ModuleDict({f"L{key[1]}_{key.split('_', 1)[1]}": adapter}))
    return hooks


def _split_key(key):
    layer, target = key[1:].split("_", 1)
    return layer, target


def _points(key):
    layer, target = _split_key(key)
    return tuple(f"blocks.{layer}.{suffix}" for suffix in ref.TARGETS[target])


def _flat(x):
    return x.flatten(-2) if x.dim() == 4 else x


def _hooks_no_scale(model, adapters):
    """Applies A and B without the adapter's scale: call the adapter itself (its forward applies alpha / rank)."""
    hooks = []
    for key, a in adapters.items():
        in_name, out_name = _points(key)
        stash = {}
        hooks += [(in_name, lambda x, hook, stash=stash: stash.update(x=_flat(x))),
                  (out_name, lambda o, hook, stash=stash, a=a: o + (stash.pop("x") @ a.A.T @ a.B.T).view(o.shape))]
    return hooks


def _hooks_late_binding(model, adapters):
    """The hook functions made in the loop use the loop variable `adapter` when they run, after the loop has ended:
    every hook uses the last adapter. Bind it when the function is made: def hook(out, hook, adapter=adapter)."""
    hooks = []
    for key, adapter in adapters.items():
        in_name, out_name = _points(key)
        stash = {}

        def keep(x, hook, stash=stash):
            stash["x"] = _flat(x)

        def add(out, hook, stash=stash):
            return out + adapter(stash.pop("x")).view(out.shape)

        hooks += [(in_name, keep), (out_name, add)]
    return hooks


def _hooks_q_only(model, adapters):
    """Handles only the q adapters: return a pair of hooks for every adapter, whatever its target."""
    return ref.lora_hooks(model, nn.ModuleDict({k: v for k, v in adapters.items() if k.endswith("_q")}))


def _hooks_replace_output(model, adapters):
    """Returns the adapter's update in place of the projection's output: the hook must return output + update."""
    hooks = []
    for key, adapter in adapters.items():
        in_name, out_name = _points(key)
        stash = {}
        hooks += [(in_name, lambda x, hook, stash=stash: stash.update(x=_flat(x))),
                  (out_name, lambda o, hook, stash=stash, a=adapter: a(stash.pop("x")).view(o.shape))]
    return hooks


def _hooks_not_flattened(model, adapters):
    """Gives the adapter the per-head input [batch, pos, head, d_head] as it is (o reads the per-head z): flatten it
    to [batch, pos, head · d_head] first (x.flatten(-2))."""
    hooks = []
    for key, adapter in adapters.items():
        in_name, out_name = _points(key)
        stash = {}
        hooks += [(in_name, lambda x, hook, stash=stash: stash.update(x=x)),
                  (out_name, lambda o, hook, stash=stash, a=adapter: o + a(stash.pop("x")).view(o.shape))]
    return hooks


def _hooks_first_input_kept(model, adapters):
    """Keeps the first input it sees and reuses it (stash.setdefault): generate runs the hooks once per new token,
    so each forward pass must use its own input (overwrite it, or pop it once used)."""
    hooks = []
    for key, adapter in adapters.items():
        in_name, out_name = _points(key)
        stash = {}
        hooks += [(in_name, lambda x, hook, stash=stash: stash.setdefault("x", _flat(x)) and None),
                  (out_name, lambda o, hook, stash=stash, a=adapter: o + a(stash["x"]).view(o.shape))]
    return hooks


@mistake("gradient")
def _hooks_detach_input(model, adapters):
    """Keeps the projection's input detached (x.detach()): the logits are right, but no gradient flows back
    through the adapters into the layers before them. Keep x itself."""
    hooks = []
    for key, adapter in adapters.items():
        in_name, out_name = _points(key)
        stash = {}
        hooks += [(in_name, lambda x, hook, stash=stash: stash.update(x=_flat(x).detach())),
                  (out_name, lambda o, hook, stash=stash, a=adapter: o + a(stash.pop("x")).view(o.shape))]
    return hooks


@mistake("gradient")
def _hooks_detach_output(model, adapters):
    """Detaches the projection's output before adding the update: the logits are right, but the gradient through
    the base model's own path is cut. Return out + update, with out as it came."""
    hooks = []
    for key, adapter in adapters.items():
        in_name, out_name = _points(key)
        stash = {}
        hooks += [(in_name, lambda x, hook, stash=stash: stash.update(x=_flat(x))),
                  (out_name, lambda o, hook, stash=stash, a=adapter: o.detach() + a(stash.pop("x")).view(o.shape))]
    return hooks


@mistake("hooks")
def _hooks_added_permanently(model, adapters):
    """Adds the hooks to the model with add_hook as well as returning them: they stay on after the with-block.
    Only return the pairs; `with model.hooks(fwd_hooks=...)` adds and removes them."""
    hooks = ref.lora_hooks(model, adapters)
    for name, fn in hooks:
        model.add_hook(name, fn)
    return hooks


@mistake("hooks")
def _hooks_reset_first(model, adapters):
    """Calls model.reset_hooks() to start clean: that removes every hook on the model, the caller's too (e.g. the
    value head's). lora_hooks only returns pairs; it removes nothing."""
    model.reset_hooks()
    return ref.lora_hooks(model, adapters)


# --- policy_and_reference_logprobs --------------------------------------------------------------------------------

def _reference_with_hooks_on(lora_model, samples):
    """Computes the reference through the LoRA model, so it equals the policy: the reference is lora_model.base,
    called with no hooks."""
    lp = completion_logprobs(lora_model, samples)
    return lp, lp.detach().clone()


def _reference_inside_adapted(lora_model, samples):
    """Computes both inside `with lora_model.adapted():`, so the reference ran with the LoRA hooks on: compute the
    reference outside the with-block."""
    with lora_model.adapted():
        return completion_logprobs(lora_model.base, samples), completion_logprobs(lora_model.base, samples)


def _pair_swapped(lora_model, samples):
    """Returns (reference, policy): return (policy log-probs, reference log-probs)."""
    logprobs, ref_logprobs = ref.policy_and_reference_logprobs(lora_model, samples)
    return ref_logprobs, logprobs


def _policy_without_hooks(lora_model, samples):
    """Computes the policy with lora_model.base, without the LoRA hooks: the policy is lora_model itself."""
    lp = completion_logprobs(lora_model.base, samples)
    return lp, lp.detach().clone()


@mistake("gradient")
def _policy_under_no_grad(lora_model, samples):
    """Computes both under torch.no_grad(): the reference may be, but the policy's log-probs must carry the
    adapters' gradient, or nothing trains."""
    with torch.no_grad():
        return ref.policy_and_reference_logprobs(lora_model, samples)


@mistake("lora")
def _reference_is_the_detached_policy(lora_model, samples):
    """Takes the policy's own log-probs, detached, as the reference: true only while B is still zero (before
    training). The reference is lora_model.base called with no hooks."""
    lp = completion_logprobs(lora_model, samples)
    return lp, lp.detach()


@mistake("hooks")
def _reference_hooks_left_behind(lora_model, samples):
    """Adds the LoRA hooks with add_hook and never removes them, so the reference (and every later forward pass)
    runs with them: use `with lora_model.base.hooks(...)`, or just call lora_model."""
    for name, fn in ref.lora_hooks(lora_model.base, lora_model.adapters):
        lora_model.base.add_hook(name, fn)
    logprobs = completion_logprobs(lora_model.base, samples)
    return logprobs, completion_logprobs(lora_model.base, samples)


@mistake("hooks")
def _reference_after_reset_hooks(lora_model, samples):
    """Calls reset_hooks() before the reference pass to be safe: it also removes hooks the caller put on the
    model. lora_model.base called directly already runs without the LoRA hooks."""
    logprobs = completion_logprobs(lora_model, samples)
    lora_model.base.reset_hooks()
    return logprobs, completion_logprobs(lora_model.base, samples)


@mistake("inputs")
def _pads_ids_in_place(lora_model, samples):
    """Overwrites the padding of samples.ids in place: the caller's samples must stay as they were (the ids and masks
    are used again for the loss)."""
    samples.ids.masked_fill_(samples.attention_mask == 0, 0)
    return ref.policy_and_reference_logprobs(lora_model, samples)


# --- freeze_base --------------------------------------------------------------------------------------------------

def _freeze_nothing(model, adapters):
    """Only switches the adapters on; the base stays trainable: model.requires_grad_(False) first."""
    adapters.requires_grad_(True)
    return ref.count_parameters(adapters), ref.count_parameters(model)


def _freeze_base_last(model, adapters):
    """Switches the adapters on first and freezes the model second, so adapters that the model holds (a LoRAModel's)
    are frozen again. Freeze the model first, then switch the adapters on."""
    adapters.requires_grad_(True)
    model.requires_grad_(False)
    return ref.count_parameters(adapters), ref.count_parameters(model)


def _freeze_adapters_too(model, adapters):
    """Freezes the base but does not make the adapters trainable (they may come in frozen): finish with
    adapters.requires_grad_(True)."""
    model.requires_grad_(False)
    return ref.count_parameters(adapters), ref.count_parameters(model)


def _freeze_blocks_only(model, adapters):
    """Freezes the transformer blocks only: the embeddings, the final LayerNorm and the unembedding stay trainable.
    Freeze the whole model: model.requires_grad_(False)."""
    for block in model.blocks:
        block.requires_grad_(False)
    adapters.requires_grad_(True)
    return ref.count_parameters(adapters), ref.count_parameters(model)


def _freeze_counts_swapped(model, adapters):
    """Returns (total, trainable): the order is (trainable, total)."""
    trainable, total = ref.freeze_base(model, adapters)
    return total, trainable


def _freeze_total_with_adapters(model, adapters):
    """Counts the adapters into the total: total is the base model's parameters alone (count_parameters(model))."""
    trainable, total = ref.freeze_base(model, adapters)
    return trainable, total + trainable


def _freeze_total_trainable_only(model, adapters):
    """Counts the base model's parameters after freezing it with trainable_only=True, which gives 0: the total
    counts every parameter, frozen or not."""
    model.requires_grad_(False)
    adapters.requires_grad_(True)
    return ref.count_parameters(adapters), ref.count_parameters(model, trainable_only=True)


def _freeze_counts_tensors(model, adapters):
    """Counts the adapters' tensors instead of their elements: sum(p.numel() for p in adapters.parameters())."""
    ref.freeze_base(model, adapters)
    return len(list(adapters.parameters())), ref.count_parameters(model)


# --- merge_lora ---------------------------------------------------------------------------------------------------

@torch.no_grad()
@only_on("gpt2", "the Llama-style model stores every projection [d_out, d_in] (nn.Linear): nothing to transpose")
def _merge_no_transpose(model, adapters, sign=1.0):
    """Adds scale · B A to every weight as if all were stored [d_out, d_in]: base_weight says when a weight is stored
    [d_in, d_out] (GPT-2's Conv1D), and then the update goes in transposed."""
    for key, a in adapters.items():
        weight, _ = ref.base_weight(model, key)
        delta = sign * a.scale * (a.B @ a.A)
        weight += delta if delta.shape == weight.shape else delta.T


@torch.no_grad()
def _merge_no_scale(model, adapters, sign=1.0):
    """Merges B A without the adapter's scale: the hooks add scale · B A x, so the weight must change by
    scale · B A."""
    for key, a in adapters.items():
        weight, in_out = ref.base_weight(model, key)
        weight += sign * ((a.B @ a.A).T if in_out else a.B @ a.A)


@mistake("argument")
@torch.no_grad()
def _merge_ignores_sign(model, adapters, sign=1.0):
    """Always adds the update, whatever `sign` is: multiply the update by sign."""
    ref.merge_lora(model, adapters)


@mistake("argument")
@torch.no_grad()
def _merge_sign_as_direction(model, adapters, sign=1.0):
    """Uses `sign` only as a direction (add if positive, subtract if negative): it is a factor, W + sign · scale · B A
    (a partial merge, sign = 0.5, is how the TR-DPO reference sync works)."""
    ref.merge_lora(model, adapters, sign=1.0 if sign > 0 else -1.0)


def _merge_without_no_grad(model, adapters, sign=1.0):
    """Changes the weights with gradient tracking on: on a trainable model that raises, on a frozen one the weights
    become results of a computation (with a grad_fn) instead of plain weights. Do it under torch.no_grad()."""
    for key, a in adapters.items():
        weight, in_out = ref.base_weight(model, key)
        delta = sign * a.scale * (a.B @ a.A)
        weight += delta.T if in_out else delta


@torch.no_grad()
def _merge_then_zero_B(model, adapters, sign=1.0):
    """Zeroes B after merging (so the hooks would add nothing): merge_lora only changes the base weights; the
    adapters stay as they are (unmerge_lora needs them)."""
    ref.merge_lora(model, adapters, sign)
    for a in adapters.values():
        a.B.zero_()


@torch.no_grad()
def _merge_scaled_twice(model, adapters, sign=1.0):
    """Applies the scale twice (once by hand, once through the adapter's own forward): the weight changes by
    scale · B A, once."""
    for key, a in adapters.items():
        weight, in_out = ref.base_weight(model, key)
        delta = sign * a.scale * a(torch.eye(a.A.shape[1])).T  # adapter(I)ᵀ = scale · B A
        weight += delta.T if in_out else delta


# --- unmerge_lora -------------------------------------------------------------------------------------------------

def _unmerge_adds_again(model, adapters):
    """Merges a second time instead of taking the update out: merge_lora(model, adapters, sign=-1.0)."""
    ref.merge_lora(model, adapters)


def _unmerge_noop(model, adapters):
    """Does nothing: take the update out again with merge_lora(model, adapters, sign=-1.0)."""


@torch.no_grad()
def _unmerge_no_scale(model, adapters):
    """Subtracts B A without the scale: merge added scale · B A, so that is what comes out."""
    for key, a in adapters.items():
        weight, in_out = ref.base_weight(model, key)
        weight -= (a.B @ a.A).T if in_out else a.B @ a.A


@torch.no_grad()
def _unmerge_zeroes_B(model, adapters):
    """Zeroes the adapters' B instead of changing the weights: the merged update is in the weights, so it must be
    subtracted from them (merge_lora with sign=-1.0), and the adapters left as they are."""
    for a in adapters.values():
        a.B.zero_()


def _unmerge_without_no_grad(model, adapters):
    """Subtracts the updates with gradient tracking on: on a trainable model that raises, on a frozen one the weights
    get a grad_fn. Do it under torch.no_grad(), or reuse merge_lora(..., sign=-1.0)."""
    for key, a in adapters.items():
        weight, in_out = ref.base_weight(model, key)
        delta = a.scale * (a.B @ a.A)
        weight -= delta.T if in_out else delta


# --- save_adapter -------------------------------------------------------------------------------------------------

def _save_with_pickle(adapters, path):
    """Uses torch.save (a pickle), not safetensors: safetensors.torch.save_file(tensors, path, metadata=...)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    torch.save(adapters.state_dict(), str(path))


def _save_without_metadata(adapters, path):
    """Writes the tensors without rank and alpha: pass metadata={"rank": str(rank), "alpha": str(alpha)}."""
    from safetensors.torch import save_file

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in adapters.state_dict().items()}, str(path))


def _save_scale_as_alpha(adapters, path):
    """Stores the scale (alpha / rank) under "alpha": store alpha itself (scale · rank)."""
    from safetensors.torch import save_file

    first = next(iter(adapters.values()))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in adapters.state_dict().items()}, str(path),
              metadata={"rank": str(first.A.shape[0]), "alpha": str(first.scale)})


def _save_rank_from_wrong_dim(adapters, path):
    """Reads the rank from A.shape[1], which is d_in: A is [rank, d_in], so the rank is A.shape[0]."""
    from safetensors.torch import save_file

    first = next(iter(adapters.values()))
    rank = first.A.shape[1]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in adapters.state_dict().items()}, str(path),
              metadata={"rank": str(rank), "alpha": str(first.scale * first.A.shape[0])})


def _save_only_B(adapters, path):
    """Saves only the B matrices (A trains too, and a fresh A is random): save every tensor of
    adapters.state_dict()."""
    from safetensors.torch import save_file

    first = next(iter(adapters.values()))
    rank = first.A.shape[0]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in adapters.state_dict().items() if k.endswith(".B")}, str(path),
              metadata={"rank": str(rank), "alpha": str(first.scale * rank)})


def _save_with_prefix(adapters, path):
    """Prefixes every name ("adapters.L0_q.A"): keep the names of adapters.state_dict(), which load_adapter loads
    into adapters made by make_adapters."""
    from safetensors.torch import save_file

    first = next(iter(adapters.values()))
    rank = first.A.shape[0]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file({f"adapters.{k}": v.contiguous() for k, v in adapters.state_dict().items()}, str(path),
              metadata={"rank": str(rank), "alpha": str(first.scale * rank)})


def _save_without_making_the_folder(adapters, path):
    """Writes into a folder that may not exist yet, so saving to runs/seed0/adapter.safetensors fails: create the
    folder first, Path(path).parent.mkdir(parents=True, exist_ok=True)."""
    from safetensors.torch import save_file

    first = next(iter(adapters.values()))
    rank = first.A.shape[0]
    save_file({k: v.detach().contiguous() for k, v in adapters.state_dict().items()}, str(path),
              metadata={"rank": str(rank), "alpha": str(first.scale * rank)})


# --- load_adapter -------------------------------------------------------------------------------------------------

def _checked_file(path):
    """What the wrong versions of load_adapter below get right (each has one other mistake): a path that is not a
    safetensors file is refused, naming it."""
    from safetensors import safe_open

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no adapter file at {path}")
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a folder")
    try:
        with safe_open(str(path), framework="pt"):
            pass
    except Exception as error:  # noqa: BLE001
        raise ValueError(f"{path} is not a safetensors file") from error


def _load_ignores_alpha(adapters, path):
    """Checks names and shapes but not the rank and alpha in the metadata: the same A and B with another alpha
    compute another model, so compare them with the adapters' and raise a ValueError."""
    _checked_file(path)
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    expected = {name: tuple(p.shape) for name, p in adapters.state_dict().items()}
    if expected != {name: tuple(t.shape) for name, t in tensors.items()}:
        raise ValueError("the file does not fit these adapters")
    adapters.load_state_dict(tensors)
    return adapters


def _load_without_checks(adapters, path):
    """Loads what fits (strict=False) and checks nothing: compare the file's rank, alpha, names and shapes with the
    adapters' and raise a ValueError that names the mismatch."""
    _checked_file(path)
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    adapters.load_state_dict({k: v for k, v in tensors.items() if k in adapters.state_dict()
                              and v.shape == adapters.state_dict()[k].shape}, strict=False)
    return adapters


def _load_returns_nothing(adapters, path):
    """Loads but returns nothing: return `adapters`."""
    ref.load_adapter(adapters, path)


@mistake("error")
def _load_keyerror_without_metadata(adapters, path):
    """Reads metadata["rank"] without checking that it is there, so a file without it raises a KeyError: raise the
    documented ValueError, saying that the file has no rank and alpha."""
    _checked_file(path)
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    rank, alpha = int(meta["rank"]), float(meta["alpha"])
    for adapter in adapters.values():
        if adapter.A.shape[0] != rank or not math.isclose(adapter.scale * rank, alpha):
            raise ValueError(f"saved with rank {rank} and alpha {alpha}")
    return ref.load_adapter(adapters, path)


@mistake("error")
def _load_lets_load_state_dict_refuse(adapters, path):
    """Leaves the name and shape check to load_state_dict, which raises a RuntimeError: check them yourself and
    raise the documented ValueError."""
    _checked_file(path)
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if "rank" not in meta or "alpha" not in meta:
        raise ValueError("no rank and alpha in the file")
    for adapter in adapters.values():
        if adapter.A.shape[0] != int(meta["rank"]) or not math.isclose(adapter.scale * adapter.A.shape[0],
                                                                         float(meta["alpha"])):
            raise ValueError(f"saved with rank {meta['rank']} and alpha {meta['alpha']}")
    adapters.load_state_dict(load_file(str(path)))
    return adapters


def _load_compares_scale_with_alpha(adapters, path):
    """Compares the adapters' scale (alpha / rank) with the file's alpha, so it refuses a file that fits: compare
    scale · rank with it."""
    _checked_file(path)
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    for adapter in adapters.values():
        if "alpha" not in meta or not math.isclose(adapter.scale, float(meta["alpha"])):
            raise ValueError(f"adapter file saved with alpha {meta.get('alpha')}, adapters have {adapter.scale}")
    return ref.load_adapter(adapters, path)


def _load_then_check(adapters, path):
    """Loads the tensors first and checks rank and alpha after: a refused file has already overwritten the
    adapters. Check everything before loading anything."""
    _checked_file(path)
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    own = adapters.state_dict()
    with torch.no_grad():
        for name, t in tensors.items():
            if name in own and own[name].shape == t.shape:
                own[name].copy_(t)
    return ref.load_adapter(adapters, path)


@mistake("error")
def _load_lets_safetensors_refuse_bad_files(adapters, path):
    """Hands any path to safe_open, whose errors on a folder ("No such device"), an empty, truncated or random file or
    one written by torch.save ("header too large") name neither the file nor what is wrong: raise IsADirectoryError
    for a folder, and catch safe_open's error to raise a ValueError that names the file."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt"):
        pass
    return ref.load_adapter(adapters, path)


@mistake("error")
def _load_falls_back_to_torch_load(adapters, path):
    """Falls back to torch.load when the file is not a safetensors file: torch.load unpickles, and a pickle can run
    any code while it loads (this version at least passes weights_only=True). Refuse the file instead, with a
    ValueError that names it: adapters are shared as safetensors precisely so that loading one runs nothing."""
    try:
        return ref.load_adapter(adapters, path)
    except ValueError as refused:
        try:
            with open(path, "rb") as f:  # a file object: torch.load(path) reads a .safetensors name as safetensors
                state = torch.load(f, weights_only=True)
        except Exception:  # noqa: BLE001 - not a pickle either: the reference's refusal stands
            raise refused from None
        adapters.load_state_dict(state)
        return adapters


# --- the registry -------------------------------------------------------------------------------------------------

REGISTRY = Registry("part2_lora", {
    "LoRA": Exercise(
        wrong=[_LoRARandomB, _LoRANoScale, _LoRAScaleAlpha, _LoRAIntegerScale, _LoRAZeroA, _LoRAKaimingDefault,
               _LoRATransposed, _LoRAIgnoresRank, _LoRAIgnoresAlpha, _LoRADetachesInput, _LoRATrainableScale,
               _LoRAScalesInputInPlace],
    ),
    "lora_hooks": Exercise(
        wrong=[_hooks_no_scale, _hooks_late_binding, _hooks_q_only, _hooks_replace_output, _hooks_not_flattened,
               _hooks_first_input_kept, _hooks_detach_input, _hooks_detach_output, _hooks_added_permanently,
               _hooks_reset_first, _hooks_layer_from_one_digit],
    ),
    "policy_and_reference_logprobs": Exercise(
        wrong=[_reference_with_hooks_on, _reference_inside_adapted, _pair_swapped, _policy_without_hooks,
               _policy_under_no_grad, _reference_is_the_detached_policy, _reference_hooks_left_behind,
               _reference_after_reset_hooks, _pads_ids_in_place],
        on_lora_model=True,  # it takes a LoRAModel: tested with one whose B is random (a trained adapter)
    ),
    "freeze_base": Exercise(
        wrong=[_freeze_nothing, _freeze_adapters_too, _freeze_blocks_only, _freeze_counts_swapped,
               _freeze_total_with_adapters, _freeze_total_trainable_only, _freeze_counts_tensors],
    ),
    "merge_lora": Exercise(
        wrong=[_merge_no_transpose, _merge_no_scale, _merge_ignores_sign, _merge_sign_as_direction,
               _merge_without_no_grad, _merge_then_zero_B, _merge_scaled_twice],
    ),
    "unmerge_lora": Exercise(
        wrong=[_unmerge_adds_again, _unmerge_noop, _unmerge_no_scale, _unmerge_zeroes_B, _unmerge_without_no_grad],
    ),
    "save_adapter": Exercise(
        wrong=[_save_with_pickle, _save_without_metadata, _save_scale_as_alpha, _save_rank_from_wrong_dim,
               _save_only_B, _save_with_prefix, _save_without_making_the_folder],
    ),
    "load_adapter": Exercise(
        wrong=[_load_without_checks, _load_ignores_alpha, _load_returns_nothing, _load_keyerror_without_metadata,
               _load_lets_load_state_dict_refuse, _load_compares_scale_with_alpha, _load_then_check,
               _load_lets_safetensors_refuse_bad_files, _load_falls_back_to_torch_load],
    ),
})
