"""Part 4's shared set-up: the adapters "as if trained", padded samples and a fixed dataset of the tiny model, and
the checks several exercises' tests make (log-probs of padded rows, memory sharing, requires_grad flags, syncs)."""

import copy
import dataclasses

import torch
import torch.nn as nn
from torch import Tensor

from solutions import part4_reference as ref
from tests.support import adapters_with_random_B, aside, expect, reference_trace
from utils.sampling import Samples, completion_mask_from_ids, sample

S = ref.ReferenceSettings

RANK, ALPHA = 4, 6.0  # scale = alpha / rank = 1.5: no factor a mistake makes with it collides with 2 or 1/2
SCALE = ALPHA / RANK


def trained_adapters(model, seed=0, targets=("q", "o")) -> nn.ModuleDict:
    """Adapters "as if trained": random A (LoRA's own init, after torch.manual_seed(seed)) and random B (std 0.1), so
    that they change the model. "q" and "o" because their base weights are stored the two ways round (base_weight's
    second answer False and True)."""
    return adapters_with_random_B(model, seed, rank=RANK, alpha=ALPHA, targets=targets, std=0.1, seed_A=seed)


def padded_samples(model, prompts=("12+34=", "This is", "The", "56+21="), max_new_tokens=8, seed=0) -> Samples:
    """Completions sampled from the tiny model, with row 0's completion cut by an EOS in the middle (padding after
    it), and prompts of different lengths (left padding): both kinds of padding, whatever was sampled. Sampled once
    per process and model (the shared model is put back as loaded before each test); each call gets its own copy."""
    base = getattr(model, "base", model)

    def make() -> Samples:
        torch.manual_seed(seed)
        s = sample(base, list(prompts), max_new_tokens=max_new_tokens)
        completion = s.completion_ids.clone()
        completion[0, 2:] = s.eos_id
        cmask = completion_mask_from_ids(completion, s.eos_id)
        ids = torch.cat([s.ids[:, :s.prompt_len], completion], dim=1)
        attention = torch.cat([s.attention_mask[:, :s.prompt_len], cmask.long()], dim=1)
        return Samples(ids=ids, attention_mask=attention, completion_mask=cmask, prompt_len=s.prompt_len,
                       prompts=list(s.prompts), texts=list(s.texts), eos_id=s.eos_id)

    key = f"part4 padded samples {tuple(prompts)} {max_new_tokens} {seed}"
    return copy.deepcopy(reference_trace(key, make, model=base))


def padded_rows(got, expected: Tensor, samples: Samples) -> tuple[str | None, str | None]:
    """(finding, aside), only where the difference shows it: exactly the rows with a left-padded prompt are wrong (the
    finding), which a forward pass without the attention mask gives (the aside: the pattern does not prove it).
    (None, None) otherwise."""
    if not isinstance(got, Tensor) or got.shape != expected.shape:
        return None, None
    wrong = ~torch.isclose(got.detach().double(), expected.double(), atol=1e-4, rtol=1e-4).all(-1)
    padded = (samples.attention_mask[:, :samples.prompt_len] == 0).any(-1)
    if wrong.any() and torch.equal(wrong, padded):
        return (f"The wrong rows, {padded.nonzero().flatten().tolist()}, are exactly those whose prompt is "
                "left-padded.",
                "A forward pass without attention_mask=samples.attention_mask (which also sets each token's position) "
                "gives this.")
    return None, None


def named_parameters(modules) -> dict[str, Tensor]:
    """Parameters by name, of a module or of a plain dict of modules (a wrong answer may be one)."""
    if isinstance(modules, nn.Module):
        return dict(modules.named_parameters())
    if isinstance(modules, dict):
        return {f"{k}.{n}": p for k, m in modules.items() for n, p in m.named_parameters()}
    return {}


def storage(t: Tensor) -> int:
    return t.untyped_storage().data_ptr()


def call_sync(fn, *args, what: str):
    """Run a sync; a parameter changed in place outside torch.no_grad() is explained, not left as autograd's error."""
    try:
        return fn(*args)
    except RuntimeError as error:
        if "leaf Variable that requires grad" in str(error):
            expect(False, what, "a parameter that requires grad was changed in place while autograd was recording, "
                   "and torch refused (\"a leaf Variable that requires grad is being used in an in-place "
                   "operation\"): a sync is not part of any loss, so run it under torch.no_grad() (decorate the "
                   "function with @torch.no_grad())", observed="in-place on a leaf that requires grad")
        raise


def flags_unchanged(modules: dict[str, nn.Module], call, what: str):
    """Run call(); fail if it changed which parameters of `modules` require grad (assert_inputs_unchanged compares
    values, not flags). Returns call()'s result."""
    before = {f"{label}.{n}": p.requires_grad for label, m in modules.items() for n, p in m.named_parameters()}
    result = call()
    after = {f"{label}.{n}": p.requires_grad for label, m in modules.items() for n, p in m.named_parameters()}
    changed = sorted(n for n in before if after.get(n) != before[n])
    off = [n for n in changed if before[n]]
    stopped = (": the adapters being trained would stop learning" if any(".adapters." in n for n in off) else
               ": the weights being trained would stop learning" if off else "")
    expect(not changed, f"{what}: which parameters require grad", f"it changed requires_grad of {len(changed)} "
           f"parameters (e.g. {changed[:2]}){stopped}. It must only read the model" + aside(
               "Common cause: requires_grad_(False) used to compute without gradients; torch.no_grad() does that "
               "and changes no flag."), observed=changed)
    return result


def short(settings) -> str:
    """S(beta=0.1, precomputed=True): only the fields away from their defaults."""
    defaults = S(beta=0.0)
    fields = [f"{f.name}={getattr(settings, f.name)!r}" for f in dataclasses.fields(settings)
              if f.name == "beta" or getattr(settings, f.name) != getattr(defaults, f.name)]
    return f"ReferenceSettings({', '.join(fields)})"


PROMPTS = [("12+34=", "This is", "The", "56+21="), ("The cat", "7+8=", "It")]


def fixed_dataset(model) -> list[Samples]:
    """Two batches of different sizes and completion lengths, as a fixed dataset has."""
    return [padded_samples(model, prompts, max_new_tokens=n, seed=i)
            for i, (prompts, n) in enumerate(zip(PROMPTS, (8, 5)))]
