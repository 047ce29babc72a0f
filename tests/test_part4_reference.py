"""Tests of Part 4's exercises (the reference model in every form). Each runs against `impl` (see utils/harness.py)
and compares with the reference solution.

MUTANTS, at the end, are known wrong versions: the meta-test (tests/test_harness.py) proves each one fails these
tests, and when a learner's version fails a test the same way, its docstring is what the learner reads.
"""

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn
from torch import Tensor

from solutions import part4_reference as ref
from solutions.part0_warmup import completion_logprobs, get_logprobs
from solutions.part2_lora import LoRA, LoRAModel, base_weight, load_adapter, lora_hooks, make_adapters, save_adapter
from tests.helpers import (assert_close, assert_equal, assert_hooks_clean, assert_inputs_unchanged,
                           assert_raises, expect, mistake, run_script)
from utils.checker.observe import observe
from utils.models import load_model
from utils.sampling import Samples, completion_mask_from_ids, sample

exercise = pytest.mark.exercise
S = ref.ReferenceSettings

# Exercises the course calls with a LoRAModel: their tests run them on one whose B is random (not the B = 0 of a
# fresh adapter, under which "with the adapter" and "without it" cannot be told apart).
ON_LORA_MODEL = {"old_adapter_logprobs", "precompute_reference_logprobs", "sync_lora"}

RANK, ALPHA = 4, 6.0  # scale = alpha / rank = 1.5: no factor a mistake makes with it collides with 2 or 1/2
SCALE = ALPHA / RANK


# --- set-up -------------------------------------------------------------------------------------------------

def adapters_with_random_B(model, seed=0, targets=("q", "o")) -> nn.ModuleDict:
    """Adapters "as if trained": random A (LoRA's own init) and random B, so that they change the model. "q" and
    "o" because their base weights are stored the two ways round (base_weight's second answer False and True)."""
    torch.manual_seed(seed)
    adapters = make_adapters(model, RANK, ALPHA, targets)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for a in adapters.values():
            a.B.copy_(torch.randn(a.B.shape, generator=g) * 0.1)
    return adapters


_SAMPLED: dict[tuple, Samples] = {}


def padded_samples(model, prompts=("12+34=", "This is", "The", "56+21="), max_new_tokens=8, seed=0) -> Samples:
    """Completions sampled from the tiny model, with row 0's completion cut by an EOS in the middle (padding after
    it), and prompts of different lengths (left padding): both kinds of padding, whatever was sampled. Sampled once
    per process (the shared model is put back as loaded before each test); each call gets its own copy."""
    key = (tuple(prompts), max_new_tokens, seed)
    if key not in _SAMPLED:
        torch.manual_seed(seed)
        base = getattr(model, "base", model)
        s = sample(base, list(prompts), max_new_tokens=max_new_tokens)
        completion = s.completion_ids.clone()
        completion[0, 2:] = s.eos_id
        cmask = completion_mask_from_ids(completion, s.eos_id)
        ids = torch.cat([s.ids[:, :s.prompt_len], completion], dim=1)
        attention = torch.cat([s.attention_mask[:, :s.prompt_len], cmask.long()], dim=1)
        _SAMPLED[key] = Samples(ids=ids, attention_mask=attention, completion_mask=cmask, prompt_len=s.prompt_len,
                                prompts=list(s.prompts), texts=list(s.texts), eos_id=s.eos_id)
    return copy.deepcopy(_SAMPLED[key])


def logprob_hint(got, expected: Tensor, samples: Samples) -> str | None:
    """A cause, only where the difference implies it: exactly the rows with a left-padded prompt are wrong."""
    if not isinstance(got, Tensor) or got.shape != expected.shape:
        return None
    wrong = ~torch.isclose(got.detach().double(), expected.double(), atol=1e-4, rtol=1e-4).all(-1)
    padded = (samples.attention_mask[:, :samples.prompt_len] == 0).any(-1)
    if wrong.any() and torch.equal(wrong, padded):
        return ("Exactly the rows whose prompt is left-padded are wrong: usually the forward pass ran without "
                "attention_mask=samples.attention_mask (which also sets each token's position).")
    return None


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
           f"parameters (e.g. {changed[:2]}){stopped}. "
           "It must only read the model; to compute without gradients use torch.no_grad(), which changes no flag",
           observed=changed)
    return result


# --- reference_kind -----------------------------------------------------------------------------------------

def short(settings) -> str:
    """S(beta=0.1, precomputed=True): only the fields away from their defaults."""
    defaults = S(beta=0.0)
    fields = [f"{f.name}={getattr(settings, f.name)!r}" for f in dataclasses.fields(settings)
              if f.name == "beta" or getattr(settings, f.name) != getattr(defaults, f.name)]
    return f"ReferenceSettings({', '.join(fields)})"


WHY = {
    "none": "beta == 0 means no KL term: no reference, no forward pass, nothing to precompute, whatever else is set",
    "hooks_removed": "with hook-LoRA the reference is the same module with the LoRA hooks removed",
    "frozen_copy": "full fine-tuning changes the weights themselves, so the reference must be a frozen copy",
    "old_adapter": "re-training an adapter starts from base + old adapter, so that is the reference, precomputed "
                   "or not, synced or not; and a LoRA run synced with lora_sync='reference_only' keeps base + a "
                   "frozen adapter copy as its reference, which its syncs move (the policy untouched)",
}


def cases():  # (settings, the answer); new objects for every test, which a wrong version may change
    return [
        (S(beta=0.1), ("hooks_removed", False)),
        (S(beta=0.1, lora=False), ("frozen_copy", False)),
        (S(beta=2.0, lora=False), ("frozen_copy", False)),
        (S(beta=0.1, retraining_adapter=True), ("old_adapter", False)),
        (S(beta=0.1, precomputed=True), ("hooks_removed", True)),
        (S(beta=0.1, precomputed=True, retraining_adapter=True), ("old_adapter", True)),
        (S(beta=0.1, lora=False, precomputed=True), ("frozen_copy", True)),
        (S(beta=0.1, sync_every=10, sync_alpha=0.5), ("hooks_removed", False)),
        (S(beta=0.1, lora=False, sync_every=10, sync_alpha=1.0), ("frozen_copy", False)),  # alpha = 1 is allowed
        (S(beta=0.1, retraining_adapter=True, sync_every=10, sync_alpha=0.5), ("old_adapter", False)),
        (S(beta=0.1, sync_alpha=1.5), ("hooks_removed", False)),  # no sync (tau = 0): alpha is unused
        (S(beta=0.1, precomputed=True, sync_alpha=0.5), ("hooks_removed", True)),  # precomputed, never synced: fine
        (S(beta=0.1, sync_every=10, sync_alpha=1.0, lora_sync="reference_only"), ("old_adapter", False)),
        (S(beta=0.1, sync_every=3, sync_alpha=0.5, lora_sync="reference_only", retraining_adapter=True),
         ("old_adapter", False)),
        (S(beta=0.1, lora_sync="reference_only"), ("hooks_removed", False)),  # never synced: the copy stays B = 0
        (S(beta=0.1, lora=False, sync_every=5, sync_alpha=0.5, lora_sync="reference_only"), ("frozen_copy", False)),
    ]


def beta_zero():  # beta == 0 answers first: ("none", False), even where the other settings would be refused
    return [
        S(beta=0.0),
        S(beta=0.0, lora=False),
        S(beta=0.0, precomputed=True),
        S(beta=0.0, precomputed=True, retraining_adapter=True),
        S(beta=0.0, lora=False, retraining_adapter=True),
        S(beta=0.0, precomputed=True, sync_every=5, sync_alpha=0.5),
        S(beta=0.0, sync_every=5, sync_alpha=0.0),
        S(beta=0.0, sync_every=5, sync_alpha=0.5, lora_sync="adapter"),
    ]


def refusals():  # (settings, why it contradicts itself)
    return [
        (S(beta=-0.1), "a negative beta would reward moving away from the reference"),
        (S(beta=0.1, lora=False, retraining_adapter=True), "an adapter is a LoRA: re-training one needs lora=True"),
        (S(beta=0.1, lora=False, precomputed=True, retraining_adapter=True), "re-training an adapter needs lora=True, "
                                                                             "precomputed or not"),
        (S(beta=0.1, precomputed=True, sync_every=5, sync_alpha=0.5), "precomputed log-probs cannot be synced: the "
                                                                      "model they came from is gone"),
        (S(beta=0.1, sync_every=5, sync_alpha=0.0), "a sync with alpha = 0 does nothing: alpha must be in (0, 1]"),
        (S(beta=0.1, sync_every=5, sync_alpha=1.5), "alpha > 1 moves the reference past the policy: alpha must be in "
                                                    "(0, 1]"),
        (S(beta=0.1, sync_every=5, sync_alpha=-0.5), "a negative alpha moves the reference away from the policy"),
        (S(beta=0.1, sync_every=5, sync_alpha=0.5, lora_sync="adapter"), "lora_sync must be 'merge' or "
                                                                         "'reference_only'"),
    ]


def decide(impl, settings):
    """The answer, as a tuple if it is a sequence, or what the function raised."""
    try:
        got = impl.reference_kind(settings)
    except NotImplementedError:
        raise
    except Exception as error:  # noqa: BLE001 - a refusal where an answer was due is reported, not crashed on
        return f"raised {type(error).__name__}: {str(error)[:120]}"
    return tuple(got) if isinstance(got, (list, tuple)) else got


def table_hint(settings_list, answers, expected) -> str | None:
    lines = [f"{short(s)}: expected {want}, got {got}; {WHY[want[0]]}"
             + ("; and it is precomputed, as the settings ask" if want[1] else "")
             for s, got, want in zip(settings_list, answers, expected) if got != want]
    return "\n  ".join(lines) if lines else None


def settings_unchanged(settings, before):
    after = [dataclasses.asdict(s) for s in settings]
    changed = [f"{short(s)} (was {b})" for s, a, b in zip(settings, after, before) if a != b]
    assert_equal(after, before, "the settings after reference_kind read them",
                 hint=f"reference_kind changed the settings it was given, e.g. {changed[:1]}: it must only read them "
                      "(the trainer and the Reference read the same object later)" if changed else None)


@exercise("reference_kind")
def test_reference_kind_returns_kind_and_precomputed(impl):
    got = impl.reference_kind(S(beta=0.1, precomputed=True))
    expect(isinstance(got, tuple) and len(got) == 2, "reference_kind's result",
           f"expected a tuple (kind, precomputed), e.g. ('hooks_removed', True), got {got!r}", observed=repr(got))
    expect(got[0] in ref.KINDS, "reference_kind's kind", f"expected one of {ref.KINDS}, got {got[0]!r}",
           observed=got[0])


@exercise("reference_kind")
def test_reference_kind_decides_every_case(impl):
    table = cases()
    settings = [s for s, _ in table]
    before = [dataclasses.asdict(s) for s in settings]
    answers = [decide(impl, s) for s in settings]
    expected = [want for _, want in table]
    assert_equal(answers, expected, f"reference_kind on {len(table)} settings with beta > 0",
                 hint=table_hint(settings, answers, expected))
    settings_unchanged(settings, before)


@exercise("reference_kind")
def test_reference_kind_beta_zero_answers_first(impl):
    settings = beta_zero()
    before = [dataclasses.asdict(s) for s in settings]
    answers = [decide(impl, s) for s in settings]
    expected = [("none", False)] * len(settings)
    assert_equal(answers, expected, f"reference_kind on {len(settings)} settings with beta == 0",
                 hint=table_hint(settings, answers, expected))
    settings_unchanged(settings, before)


@exercise("reference_kind")
def test_reference_kind_refuses_contradictions(impl):
    for settings, why in refusals():
        assert_raises(ValueError, impl.reference_kind, settings, what=f"reference_kind({short(settings)})", why=why)


# --- frozen_adapter_copy ------------------------------------------------------------------------------------

COPY_FACTORS = {f"{16.0 / ALPHA:.4g} = 16/{ALPHA:g}, LoRA's default alpha over the adapters' alpha (the copy was "
                f"built with LoRA(d_in, d_out, rank), whose scale is not the adapters')": 16.0 / ALPHA}


@exercise("frozen_adapter_copy")
def test_frozen_adapter_copy_computes_what_the_adapters_compute(impl, tiny_model):
    adapters = adapters_with_random_B(tiny_model, seed=0)
    frozen = assert_inputs_unchanged(impl.frozen_adapter_copy, adapters, what="frozen_adapter_copy(adapters)")
    expect(isinstance(frozen, nn.ModuleDict), "frozen_adapter_copy's result",
           f"expected an nn.ModuleDict, like the adapters, got {type(frozen).__name__}: lora_hooks, the Reference "
           "and sync_old_adapter use it as one (.items(), .parameters())", observed=type(frozen).__name__)
    assert_equal(list(frozen.keys()), list(adapters.keys()), "the copy's adapter keys")
    g = torch.Generator().manual_seed(1)
    for key, a in adapters.items():
        x = torch.randn(3, a.A.shape[1], generator=g)
        with torch.no_grad():
            want, got = a(x), frozen[key](x)
        assert_close(got, want, f"the copy of adapter {key} applied to a random input", factors=COPY_FACTORS,
                     check_grad=False, hint="The copy adds nothing: its B is 0, as in a fresh adapter. The old "
                     "adapter is the trained one, as it is now" if isinstance(got, Tensor) and not got.any() else None)


@exercise("frozen_adapter_copy")
def test_frozen_adapter_copy_is_frozen_and_the_adapters_are_not(impl, tiny_model):
    adapters = adapters_with_random_B(tiny_model, seed=1)
    frozen = impl.frozen_adapter_copy(adapters)
    params = named_parameters(frozen)
    live = {storage(p) for p in adapters.parameters()}
    observe("how many of the copy's tensors share memory with the live adapters (recorded, checked below)",
            sum(storage(p) in live for p in params.values()))
    expect(bool(params), "the copy's parameters", f"the copy has no parameters (got {type(frozen).__name__})",
           observed=len(params))
    trainable = [n for n, p in params.items() if p.requires_grad]
    expect(not trainable, "the copy's requires_grad", f"{len(trainable)} of its {len(params)} parameters still "
           f"require grad (e.g. {trainable[:2]}): an optimiser given them, or a loss through them, would train the "
           "reference. Freeze the copy: .requires_grad_(False) on it (torch.no_grad() around the copying does not "
           "freeze anything)", observed=trainable)
    frozen_live = [n for n, p in adapters.named_parameters() if not p.requires_grad]
    expect(not frozen_live, "the live adapters' requires_grad after the copy", f"the adapters that train on were "
           f"frozen too ({len(frozen_live)} parameters, e.g. {frozen_live[:2]}): they would never learn. Freeze "
           "only the copy: copy first, then .requires_grad_(False) on the copy", observed=frozen_live)


@exercise("frozen_adapter_copy")
def test_frozen_adapter_copy_does_not_follow_training(impl, tiny_model):
    adapters = adapters_with_random_B(tiny_model, seed=2)
    frozen = impl.frozen_adapter_copy(adapters)
    live = {storage(p): n for n, p in adapters.named_parameters()}
    shared = [live[storage(p)] for p in named_parameters(frozen).values() if storage(p) in live]
    expect(not shared, "memory shared by the copy and the live adapters", f"the copy shares memory with the live "
           f"adapters at {shared[:3]}{'...' if len(shared) > 3 else ''}: every training step would move the "
           "reference with the policy. Make new tensors: copy.deepcopy(adapters) does; the same modules in a new "
           "ModuleDict, copy.copy, and .detach() (a view of the same memory) do not", observed=shared)
    g = torch.Generator().manual_seed(2)
    inputs = {key: torch.randn(3, a.A.shape[1], generator=g) for key, a in adapters.items()}
    with torch.no_grad():
        before = {key: frozen[key](x) for key, x in inputs.items()}
        for p in adapters.parameters():  # a training step moves the live adapters
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
        after = {key: frozen[key](x) for key, x in inputs.items()}
    for key in inputs:
        assert_close(after[key], before[key], f"the copy of adapter {key}, after the live adapters took a training "
                     "step", check_grad=False)


# --- old_adapter_logprobs -----------------------------------------------------------------------------------

def retraining(tiny_model, seed):
    """A LoRAModel whose adapters have moved on since the old adapter was copied, and samples of it."""
    adapters = adapters_with_random_B(tiny_model, seed=seed)
    lora_model = LoRAModel(tiny_model, adapters)
    old = ref.frozen_adapter_copy(adapters)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for a in adapters.values():  # training moved the live adapters on since
            a.A.add_(torch.randn(a.A.shape, generator=g) * 0.05)
            a.B.add_(torch.randn(a.B.shape, generator=g) * 0.1)
    return lora_model, old, padded_samples(lora_model, seed=seed)


def check_old_adapter_logprobs(impl, lora_model, old, samples, what):
    with torch.no_grad():
        expected = ref.old_adapter_logprobs(lora_model, old, samples)

    def call():
        try:
            return assert_inputs_unchanged(impl.old_adapter_logprobs, lora_model, old, samples, what=what)
        except RuntimeError as error:
            if "size mismatch" in str(error):
                expect(False, what, "the old adapter's tensors were loaded into the live adapters (or the reverse), "
                       "and their shapes differ: an old adapter need not have the live ones' rank (after a sync it "
                       "has more). Leave the live adapters alone and run lora_model.base with the old adapter's own "
                       "hooks, lora_hooks(lora_model.base, old_adapters)", observed="size mismatch")
            raise
    got = flags_unchanged({"lora_model": lora_model, "old_adapters": old}, call, what)
    assert_close(got, expected, what, mask=samples.completion_mask, atol=1e-4,
                 hint=logprob_hint(got, expected, samples))


@exercise("old_adapter_logprobs")
def test_old_adapter_logprobs_are_the_base_with_the_old_adapter(impl, tiny_model):
    lora_model, old, samples = retraining(tiny_model, seed=1)
    check_old_adapter_logprobs(impl, lora_model, old, samples, "old_adapter_logprobs(lora_model, old_adapters, "
                               "samples)")


@exercise("old_adapter_logprobs")
def test_old_adapter_logprobs_with_an_old_adapter_of_another_rank(impl, tiny_model):
    """After a sync (sync_old_adapter) the old adapter has rank r + r_old and scale 1: it is its own LoRA."""
    lora_model, old, samples = retraining(tiny_model, seed=2)
    old = ref.sync_old_adapter(old, lora_model.adapters, 0.5)
    check_old_adapter_logprobs(impl, lora_model, old, samples, "old_adapter_logprobs with an old adapter of rank "
                               f"{2 * RANK} (the live ones: rank {RANK})")


@exercise("old_adapter_logprobs")
def test_old_adapter_logprobs_leaves_no_hooks(impl, tiny_model):
    lora_model, old, samples = retraining(tiny_model, seed=3)
    assert_hooks_clean(lora_model, lambda: impl.old_adapter_logprobs(lora_model, old, samples),
                       "old_adapter_logprobs")


# --- precompute_reference_logprobs --------------------------------------------------------------------------

PROMPTS = [("12+34=", "This is", "The", "56+21="), ("The cat", "7+8=", "It")]


def fixed_dataset(model) -> list[Samples]:
    """Two batches of different sizes and completion lengths, as a fixed dataset has."""
    return [padded_samples(model, prompts, max_new_tokens=n, seed=i)
            for i, (prompts, n) in enumerate(zip(PROMPTS, (8, 5)))]


def check_table(table, expected: list[Tensor], dataset: list[Samples], what: str):
    expect(isinstance(table, list), f"{what}: the table", f"expected a list with one tensor per batch of the "
           f"dataset, got {type(table).__name__}", observed=type(table).__name__)
    assert_equal(len(table), len(dataset), f"{what}: the number of tensors in the table",
                 hint="one tensor of log-probs per batch of the dataset, in the dataset's order")
    shapes = [tuple(e.shape) for e in expected]
    for i, (got, want, batch) in enumerate(zip(table, expected, dataset)):
        if isinstance(got, Tensor) and tuple(got.shape) != shapes[i] and tuple(got.shape) in shapes:
            j = shapes.index(tuple(got.shape))
            same = torch.allclose(got.detach().double(), expected[j].double(), atol=1e-4, rtol=1e-4)
            expect(False, f"{what}: table[{i}]", f"it {'holds' if same else 'has the shape of'} batch {j}'s "
                   f"log-probs {shapes[j]}, not batch {i}'s {shapes[i]}: table[i] must be dataset[i]'s (training "
                   "looks batch i up as table[i]). Usually: the batches were reordered (sorted, reversed, popped "
                   "from the end), or one batch's result was used for another", observed=(i, j, same))
        assert_close(got, want, f"{what}: table[{i}]", mask=batch.completion_mask, atol=1e-4,
                     hint=logprob_hint(got, want, batch))


@exercise("precompute_reference_logprobs")
@pytest.mark.parametrize("kind", ["hooks_removed", "old_adapter", "frozen_copy"])
def test_precompute_reference_logprobs_of_each_kind(impl, tiny_model, kind):
    """The table holds the log-probs of the reference of `kind`, before any update: the bare base for
    "hooks_removed", base + the adapter as it is now for "old_adapter", the plain model for "frozen_copy"."""
    lora_model = LoRAModel(tiny_model, adapters_with_random_B(tiny_model, seed=4))  # an adapter that was trained
    dataset = fixed_dataset(lora_model)
    model = tiny_model if kind == "frozen_copy" else lora_model  # full fine-tuning: a plain model, no .base
    with torch.no_grad():
        expected = [completion_logprobs(lora_model if kind == "old_adapter" else tiny_model, b) for b in dataset]
    what = f"precompute_reference_logprobs(model, {kind!r}, dataset)"
    table = flags_unchanged({"model": model}, lambda: assert_inputs_unchanged(
        impl.precompute_reference_logprobs, model, kind, dataset, what=what), what)
    check_table(table, expected, dataset, what)


@exercise("precompute_reference_logprobs")
def test_precompute_reference_logprobs_leaves_no_hooks(impl, tiny_model):
    lora_model = LoRAModel(tiny_model, adapters_with_random_B(tiny_model, seed=5))
    dataset = fixed_dataset(lora_model)
    for kind in ("old_adapter", "hooks_removed"):
        assert_hooks_clean(lora_model, lambda: impl.precompute_reference_logprobs(lora_model, kind, dataset),
                           f"precompute_reference_logprobs(model, {kind!r}, dataset)")


@exercise("precompute_reference_logprobs")
def test_precompute_reference_logprobs_refuses_what_is_not_a_reference(impl, tiny_model):
    lora_model = LoRAModel(tiny_model, adapters_with_random_B(tiny_model, seed=6))
    dataset = fixed_dataset(lora_model)[:1]
    for kind, why in [("none", "kind 'none' (beta == 0) has no reference, so nothing to precompute"),
                      ("lora", "'lora' is not a kind: the kinds are 'hooks_removed', 'old_adapter', 'frozen_copy'")]:
        assert_raises(ValueError, impl.precompute_reference_logprobs, lora_model, kind, dataset,
                      what=f"precompute_reference_logprobs(model, {kind!r}, dataset)", why=why)


# --- sync_full ----------------------------------------------------------------------------------------------

def policy_and_reference(seed, alpha_gap=1.0):
    """A small policy that training has moved away from its reference (a frozen copy, as Reference makes it)."""
    torch.manual_seed(seed)
    policy = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 5), nn.LayerNorm(5))
    reference = copy.deepcopy(policy).requires_grad_(False)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * alpha_gap)
    return policy, reference


def alpha_factors(alpha: float) -> dict[str, float]:
    return {f"(1 - alpha)/alpha with alpha = {alpha:g}: alpha and 1 - alpha swapped": (1 - alpha) / alpha,
            f"1/alpha with alpha = {alpha:g}: moved all the way, as if alpha were 1": 1 / alpha,
            f"alpha = {alpha:g}: alpha applied twice": alpha}


NOT_MOVED = ("the reference did not move at all. Usually: the new value was assigned to a name (p_ref = ...) or "
             "computed out of place (torch.lerp / .lerp instead of .lerp_, a new state_dict never loaded), or only "
             "parameters that require grad were synced (a frozen reference has none)")


@exercise("sync_full")
def test_sync_full_moves_the_reference_alpha_of_the_way(impl):
    policy, reference = policy_and_reference(seed=0)
    policy_start = {n: p.detach().clone() for n, p in policy.named_parameters()}
    ref_start = {n: p.detach().clone() for n, p in reference.named_parameters()}
    assert_inputs_unchanged(lambda policy: call_sync(impl.sync_full, policy, reference, 0.3, what="sync_full"),
                            policy, what="sync_full(policy, reference, alpha=0.3), on the policy,")
    moved = {n: p.detach() - ref_start[n] for n, p in reference.named_parameters()}
    hint = NOT_MOVED if all(not m.any() for m in moved.values()) else None
    for name, m in moved.items():
        assert_close(m, 0.3 * (policy_start[name] - ref_start[name]), f"how far reference weight {name} moved "
                     "(after - before), for ref <- 0.3 * policy + 0.7 * ref", factors=alpha_factors(0.3),
                     hint=hint, check_grad=False)


@exercise("sync_full")
def test_sync_full_leaves_the_reference_a_frozen_leaf(impl):
    policy, reference = policy_and_reference(seed=1)
    call_sync(impl.sync_full, policy, reference, 0.5, what="sync_full")
    graph = [n for n, p in reference.named_parameters() if p.grad_fn is not None or p.requires_grad]
    expect(not graph, "the reference's weights after sync_full", f"{len(graph)} of them (e.g. {graph[:2]}) now "
           "require grad and carry an autograd graph back to the policy's weights: a loss through the reference "
           "would push gradients into the policy, and the graph grows with every sync. Run the sync under "
           "torch.no_grad() (decorate the function with @torch.no_grad())", observed=graph)


@exercise("sync_full")
def test_sync_full_with_alpha_one_copies_the_policy_and_stays_independent(impl, tiny_model):
    """alpha = 1 replaces the reference by the policy, on the course's model; the two must stay separate tensors."""
    reference = copy.deepcopy(tiny_model).requires_grad_(False)
    tokens = padded_samples(tiny_model).ids
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in tiny_model.parameters():  # full fine-tuning moved the policy
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
        policy_logits = tiny_model(tokens)
    call_sync(impl.sync_full, tiny_model, reference, 1.0, what="sync_full")
    with torch.no_grad():
        assert_close(reference(tokens), policy_logits, "the reference's logits after sync_full(alpha=1)", atol=1e-4,
                     hint="alpha = 1 makes every reference weight equal to the policy's")
    policy_memory = {storage(p): n for n, p in tiny_model.named_parameters()}
    shared = [policy_memory[storage(p)] for p in reference.parameters() if storage(p) in policy_memory]
    expect(not shared, "memory shared by the reference and the policy after sync_full(alpha=1)", f"the reference "
           f"now uses the policy's own tensors ({shared[:2]}{'...' if len(shared) > 2 else ''}): the next training "
           "step moves the reference with it, and the KL is 0 forever. Copy the values into the reference's tensors "
           "(p_ref.copy_(p_pol), or lerp_) instead of p_ref.data = p_pol.data", observed=shared)


# --- sync_lora ----------------------------------------------------------------------------------------------

def B_factors(alpha: float) -> dict[str, float]:
    return {f"1/(1 - alpha) with alpha = {alpha:g}: B was left as it was": 1 / (1 - alpha),
            f"alpha/(1 - alpha) with alpha = {alpha:g}: B was scaled by alpha instead of 1 - alpha":
                alpha / (1 - alpha)}


def merge_factors(alpha: float) -> dict[str, float]:
    return {f"1/alpha with alpha = {alpha:g}: the whole update was merged, not alpha of it": 1 / alpha,
            f"(1 - alpha)/alpha with alpha = {alpha:g}: (1 - alpha) of the update was merged, not alpha of it":
                (1 - alpha) / alpha,
            f"1 - alpha with alpha = {alpha:g}: the update was merged after B had been shrunk (merge first)":
                1 - alpha,
            f"1/scale with scale = {SCALE:g}: the adapter's scale (alpha / rank) was left out of the merge": 1 / SCALE}


def lora_on_a_copy(tiny_model, seed):
    """A LoRAModel on a copy of the tiny model (a sync changes base weights) with random A and B."""
    model = copy.deepcopy(tiny_model)
    return model, LoRAModel(model, adapters_with_random_B(model, seed=seed))


@exercise("sync_lora")
def test_sync_lora_merges_alpha_of_the_update_and_shrinks_B(impl, tiny_model):
    model, lora_model = lora_on_a_copy(tiny_model, seed=3)
    alpha = 0.3
    start, adapted = {}, set()
    for key, a in lora_model.adapters.items():
        weight, in_out = base_weight(model, key)
        delta = (a.scale * (a.B @ a.A)).detach()
        start[key] = (weight.detach().clone(), a.A.detach().clone(), a.B.detach().clone(), delta.T if in_out else delta)
        adapted.add(id(weight))
    others = {n: p.detach().clone() for n, p in model.named_parameters() if id(p) not in adapted}
    objects = {n: p for n, p in lora_model.named_parameters()}
    call_sync(impl.sync_lora, lora_model, alpha, what="sync_lora")

    replaced = [n for n, p in lora_model.named_parameters() if objects.get(n) is not p]
    expect(not replaced, "the LoRAModel's parameters after sync_lora", f"{len(replaced)} parameters (e.g. "
           f"{replaced[:2]}) are new nn.Parameter objects: the optimiser still holds the old ones, so it would go on "
           "updating tensors the model no longer uses. Change them in place (B.mul_(1 - alpha), weight += ...)",
           observed=replaced)
    for key, a in lora_model.adapters.items():
        w0, A0, B0, delta = start[key]
        assert_close(a.B.detach(), (1 - alpha) * B0, f"B of adapter {key} after sync_lora(alpha={alpha})",
                     factors=B_factors(alpha), check_grad=False)
        assert_close(a.A.detach(), A0, f"A of adapter {key} after the sync", check_grad=False,
                     hint="the adapter keeps its A; only B shrinks")
        moved, want = base_weight(model, key)[0].detach() - w0, alpha * delta
        transposed = moved.shape == want.T.shape and torch.allclose(moved, want.T, atol=1e-5, rtol=1e-4)
        assert_close(moved, want, f"how far the base weight under adapter {key} moved (after - before), expected "
                     "alpha * scale * B A", factors=merge_factors(alpha), check_grad=False,
                     hint="base_weight(model, key) also says how the weight is stored: True means [d_in, d_out], "
                          "which takes the [d_out, d_in] update B A transposed" if transposed else None)
    changed = sorted(n for n, p in model.named_parameters() if n in others and not torch.equal(p, others[n]))
    expect(not changed, "base weights that no adapter updates", f"{len(changed)} of them changed (e.g. "
           f"{changed[:3]}): only the weights under an adapter take its update", observed=changed)


@exercise("sync_lora")
def test_sync_lora_leaves_the_policy_unchanged_and_moves_the_reference(impl, tiny_model):
    model, lora_model = lora_on_a_copy(tiny_model, seed=4)
    tokens = padded_samples(lora_model).ids
    with torch.no_grad():
        policy_before, reference_before = lora_model(tokens), model(tokens)
    call_sync(impl.sync_lora, lora_model, 0.3, what="sync_lora")
    with torch.no_grad():
        policy_after, reference_after = lora_model(tokens), model(tokens)
    assert_close(policy_after, policy_before, "the policy's logits (base + hooks) after sync_lora(alpha=0.3)",
                 atol=1e-4, hint="a sync moves the reference only: what goes into the base weights must come out "
                                 "of the adapter (base + alpha s B A + s (1 - alpha) B A = base + s B A)")
    moved = (reference_after - reference_before).abs().max().item()
    expect(moved > 1e-3, "the reference's logits (the base, no hooks) after sync_lora(alpha=0.3)", f"they did not "
           f"change (largest change {moved:.2g}): the base weights must take alpha of the adapter's update, in "
           "place", observed=moved > 1e-3)


@exercise("sync_lora")
def test_sync_lora_with_alpha_one_makes_the_reference_the_policy(impl, tiny_model):
    model, lora_model = lora_on_a_copy(tiny_model, seed=5)
    tokens = padded_samples(lora_model).ids
    with torch.no_grad():
        policy_before = lora_model(tokens)
    call_sync(impl.sync_lora, lora_model, 1.0, what="sync_lora")
    with torch.no_grad():
        reference_after, policy_after = model(tokens), lora_model(tokens)
    assert_close(reference_after, policy_before, "the reference's logits (the base, no hooks) after "
                 "sync_lora(alpha=1)", atol=1e-4, hint="alpha = 1 merges the whole update: the reference becomes "
                                                       "the policy")
    for key, a in lora_model.adapters.items():
        assert_close(a.B.detach(), torch.zeros_like(a.B), f"B of adapter {key} after sync_lora(alpha=1)",
                     check_grad=False, hint="with the whole update in the base, the adapter must add nothing")
    assert_close(policy_after, policy_before, "the policy's logits after sync_lora(alpha=1)", atol=1e-4)


# --- the Reference object and the trainer (provided) ----------------------------------------------------------

@pytest.fixture
def fresh_model():
    """A model of our own: syncing changes base weights, which the shared tiny model must never see."""
    return load_model("tiny", device="cpu")


def test_reference_serves_every_kind_and_counts_forward_passes(fresh_model):
    lora_model = LoRAModel(fresh_model, adapters_with_random_B(fresh_model, seed=5))  # the base and policy differ
    samples = padded_samples(lora_model)
    with torch.no_grad():
        bare, adapted = completion_logprobs(fresh_model, samples), completion_logprobs(lora_model, samples)
    expect((bare - adapted).abs().max() > 1e-3, "test set-up", "the adapter should change the log-probs")

    none = ref.Reference(S(beta=0.0), lora_model)
    assert_equal(none.logprobs(samples), None, "Reference(beta=0).logprobs")
    assert_equal(none.forward_passes, 0, "Reference(beta=0).forward_passes")
    hooks = ref.Reference(S(beta=0.1), lora_model)
    assert_close(hooks.logprobs(samples), bare, "Reference(beta=0.1, LoRA).logprobs", atol=1e-4)
    assert_equal((hooks.forward_passes, hooks.copy), (1, None), "the LoRA reference: (forward passes, copy)")
    old = ref.Reference(S(beta=0.1, retraining_adapter=True), lora_model)
    with torch.no_grad():
        for a in lora_model.adapters.values():  # training moves the adapters on; the reference must not follow
            a.B.add_(torch.randn_like(a.B) * 0.1)
    assert_close(old.logprobs(samples), adapted, "Reference(retraining_adapter=True).logprobs", atol=1e-4)
    expect(old.old_adapters is not None and old.copy is None, "the old-adapter reference", "holds the old adapter "
           "and no copy of the model")

    full = ref.Reference(S(beta=0.1, lora=False), fresh_model)  # full fine-tuning: a plain model, copied
    with torch.no_grad():
        for p in fresh_model.parameters():  # training moves the weights on; the copy must not follow
            p.add_(torch.randn_like(p) * 0.01)
    assert_close(full.logprobs(samples), bare, "Reference(lora=False).logprobs", atol=1e-4)
    expect(full.copy is not None and full.forward_passes == 1, "the full fine-tuning reference", "holds a copy "
           "and counted one forward pass")


def test_precomputed_reference_serves_its_kind_from_a_table_keyed_by_index(fresh_model):
    lora_model = LoRAModel(fresh_model, adapters_with_random_B(fresh_model, seed=6))
    dataset = fixed_dataset(lora_model)
    with torch.no_grad():
        bare = [completion_logprobs(fresh_model, batch) for batch in dataset]
        adapted = [completion_logprobs(lora_model, batch) for batch in dataset]
    for settings, model, expected in [(S(beta=0.1, precomputed=True), lora_model, bare),
                                      (S(beta=0.1, precomputed=True, retraining_adapter=True), lora_model, adapted),
                                      (S(beta=0.1, precomputed=True, lora=False), fresh_model, bare)]:
        r = ref.Reference(settings, model, dataset=dataset)
        expect(r.copy is None and r.old_adapters is None, short(settings), "a precomputed reference keeps no model")
        for i in (1, 0):
            assert_close(r.logprobs(dataset[i], index=i), expected[i], f"{short(settings)}: batch {i}", atol=1e-4)
        assert_equal(r.forward_passes, 0, f"{short(settings)}: forward passes")
        assert_raises(ValueError, r.logprobs, dataset[0], what="logprobs without index", why="the table is "
                      "looked up by index")
        error = assert_raises(ValueError, r.logprobs, dataset[0], index=1, what="logprobs of batch 0 as index 1",
                              why="never stale numbers for another batch")
        expect("not batch 1" in str(error), "the refusal's message", f"says which batch: {error}")


def test_maybe_sync_moves_each_kind_of_reference(fresh_model):
    lora_model = LoRAModel(fresh_model, adapters_with_random_B(fresh_model, seed=7))
    samples = padded_samples(lora_model)
    old = ref.Reference(S(beta=0.1, retraining_adapter=True, sync_every=2, sync_alpha=0.3), lora_model)
    start = {k: (a.scale * a.B @ a.A).detach().clone() for k, a in lora_model.adapters.items()}
    with torch.no_grad():  # training moves A and B both: mixing them one by one would be inexact
        for a in lora_model.adapters.values():
            a.A.add_(torch.randn_like(a.A) * 0.1)
            a.B.add_(torch.randn_like(a.B) * 0.1)
        policy = completion_logprobs(lora_model, samples)
    assert_equal((old.maybe_sync(0), old.maybe_sync(1)), (False, True), "tau = 2: sync after steps 1, 3, 5, ...")
    for key, a in lora_model.adapters.items():
        o = old.old_adapters[key]
        assert_close(o.scale * o.B @ o.A, 0.3 * a.scale * (a.B @ a.A).detach() + 0.7 * start[key],
                     f"the old adapter's update at {key} after sync(0.3)", check_grad=False)
    expect(all(not p.requires_grad for p in old.old_adapters.parameters()), "the synced old adapter",
           "must stay frozen")
    with torch.no_grad():
        assert_close(completion_logprobs(lora_model, samples), policy, "the policy after the sync", atol=1e-4)
    once_more = ref.Reference(S(beta=0.1, retraining_adapter=True, sync_every=1, sync_alpha=1.0), lora_model)
    once_more.maybe_sync(0)
    assert_close(once_more.logprobs(samples), policy, "alpha = 1: the reference is the policy", atol=1e-4)

    full = ref.Reference(S(beta=0.1, lora=False, sync_every=1, sync_alpha=0.25), fresh_model)
    start_weights = [p.detach().clone() for p in fresh_model.parameters()]
    with torch.no_grad():
        for p in fresh_model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    assert_equal(full.maybe_sync(0), True, "a full fine-tuning reference syncs with tau = 1")
    for p_ref, p_pol, p0 in zip(full.copy.parameters(), fresh_model.parameters(), start_weights):
        assert_close(p_ref, 0.25 * p_pol.detach() + 0.75 * p0, "the synced copy", check_grad=False)


@pytest.mark.slow
def test_synced_trainer_runs_and_syncs():
    cfg = ref.GRPOConfig(steps=4, n_prompts=4, group_size=4, eval_every=2, table_every=100)
    trainer = ref.SyncedGRPOTrainer(cfg, S(beta=0.1, sync_every=2, sync_alpha=0.5))
    logger = trainer.train()
    assert_equal((trainer.ref.kind, trainer.ref.forward_passes), ("hooks_removed", 4), "(kind, forward passes)")
    assert_equal([h.get("synced") for h in logger.history if "synced" in h], [0.0, 1.0, 0.0, 1.0], "synced steps")
    expect({"kl", "accuracy"} <= {k for h in logger.history for k in h}, "the history", "logs kl and accuracy")


@pytest.mark.slow
def test_synced_trainer_re_trains_a_saved_adapter_against_it(tmp_path):
    base = load_model("tiny", device="cpu")
    trained = adapters_with_random_B(base, seed=8, targets=("q", "k", "v", "o"))  # yesterday's adapter, saved
    with torch.no_grad():
        for a in trained.values():
            a.B.mul_(2.0)
    save_adapter(trained, tmp_path / "adapter.safetensors")
    cfg = ref.GRPOConfig(steps=1, n_prompts=4, group_size=4, eval_every=0, table_every=100, lora_rank=RANK,
                         lora_alpha=ALPHA, lora_targets=("q", "k", "v", "o"))
    first_kl = {}
    for retraining_adapter in (True, False):
        trainer = ref.SyncedGRPOTrainer(cfg, S(beta=0.1, retraining_adapter=retraining_adapter), model=base,
                                        adapters=tmp_path / "adapter.safetensors")
        for k, a in trained.items():
            assert_close(trainer.model.adapters[k].B, a.B, f"the trainer's adapter {k}: it must start from the "
                         "saved adapter", check_grad=False)
        first_kl[retraining_adapter] = trainer.train().history[0]["kl"]
    assert_equal(trainer.ref.kind, "hooks_removed", "the fresh run's reference")
    # the first step's KL is measured before its update, where the policy is still base + the saved adapter
    expect(first_kl[True] < 1e-6, "the first KL against the old adapter", f"should be 0 (the run starts there), "
           f"got {first_kl[True]}")
    expect(first_kl[False] > 1e-3, "test set-up", f"the bare base should be far from the adapter; KL {first_kl[False]}")


def test_synced_trainer_refuses_what_it_cannot_do():
    cfg = ref.GRPOConfig()
    for settings, match in [(S(beta=0.1, lora=False), "full fine-tuning"),
                            (S(beta=0.1, retraining_adapter=True), "adapters="),
                            (S(beta=0.1, precomputed=True), "precompute")]:
        error = assert_raises(ValueError, ref.SyncedGRPOTrainer, cfg, settings, what=f"SyncedGRPOTrainer("
                              f"{short(settings)})", why="before any model is loaded")
        expect(match in str(error), "the refusal's message", f"should mention {match!r}: {error}")


# --- the sync experiment's control: a sync that moves the reference alone (provided) ----------------------------

def tiny_cfg(steps=2):
    return ref.GRPOConfig(steps=steps, n_prompts=4, group_size=4, eval_every=0, table_every=10**9)


def optimizer_state(optimizer) -> list[Tensor]:
    return [t.detach().clone() for state in optimizer.state.values() for t in state.values() if isinstance(t, Tensor)]


@pytest.mark.slow
def test_a_reference_only_sync_moves_the_reference_exactly_and_nothing_else():
    trainer = ref.SyncedGRPOTrainer(tiny_cfg(), S(beta=0.1, sync_every=2, sync_alpha=0.5,
                                                  lora_sync="reference_only"))
    assert_equal(trainer.ref.kind, "old_adapter", "the control's reference: the base + a frozen adapter copy")
    samples = padded_samples(trainer.model)
    with torch.no_grad():
        base_start = completion_logprobs(trainer.model.base, samples)
    assert_close(trainer.ref.logprobs(samples), base_start, "the reference before any sync (a copy of a fresh "
                 "adapter, B = 0: the base)", atol=1e-6)
    trainer.step(0)  # an update (Adam now has state); (0 + 1) % 2: no sync yet
    with torch.no_grad():
        policy = completion_logprobs(trainer.model, samples)
    parameters = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    moments = optimizer_state(trainer.optimizer)
    merged = copy.deepcopy(trainer.model)  # what a merge-sync of the same alpha makes the reference: its base
    ref.sync_lora(merged, 0.5)

    assert_equal(trainer.ref.maybe_sync(1), True, "maybe_sync after step 1 with tau = 2")
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p, parameters[n])]
    expect(not changed, "the policy's parameters after a reference-only sync", f"changed: {changed[:3]}",
           observed=changed)
    after = optimizer_state(trainer.optimizer)
    assert_equal(len(after), len(moments), "the optimizer's state tensors after the sync")
    expect(all(torch.equal(a, b) for a, b in zip(after, moments)), "the optimizer's state after the sync",
           "Adam's moments (or its step counts) changed", observed=False)
    with torch.no_grad():
        assert_close(completion_logprobs(trainer.model, samples), policy, "the policy after the sync", atol=0)
        assert_close(trainer.ref.logprobs(samples), completion_logprobs(merged.base, samples),
                     "the reference after a reference-only sync (alpha = 0.5), against the base a merge-sync of the "
                     "same alpha makes", atol=1e-4)
    restarted = [k for k, a in merged.adapters.items() if not torch.equal(a.B, trainer.model.adapters[k].B)]
    expect(len(restarted) == len(merged.adapters), "the contrast: a merge-sync", "shrinks every B (the LoRA the "
           "policy trains on restarts from (1 - alpha) B)", observed=len(restarted))


@pytest.mark.slow
def test_kl_to_the_original_is_0_at_the_start_and_a_sync_does_not_reset_it():
    trainer = ref.SyncedGRPOTrainer(tiny_cfg(steps=3), S(beta=0.1, sync_every=1, sync_alpha=1.0),
                                    track_original=True)  # a merge-sync after every step
    history = [h for h in trainer.train().history if "kl" in h]
    assert_equal(len(history), 3, "steps that logged a KL")
    assert_close(history[0]["kl_original"], 0.0, "KL to the original at step 0 (the policy is the original)",
                 atol=1e-7)
    for h in history[1:]:  # after an alpha = 1 sync the reference is the policy; the original stays where it was
        assert_close(h["kl"], 0.0, f"KL to the current reference at step {h['step']}, just after a sync with "
                     "alpha = 1", atol=1e-5)
        expect(h["kl_original"] > 1e-6, f"KL to the original at step {h['step']}", "it should grow with training, "
               f"whatever the syncs do; got {h['kl_original']}", observed=h["kl_original"])
    plain = ref.SyncedGRPOTrainer(tiny_cfg(steps=1), S(beta=0.1))
    expect("kl_original" not in plain.train().history[0], "a trainer without track_original",
           "logs no kl_original (it keeps no copy of the starting model)")


def test_kl_to_original_is_the_exact_per_token_kl(fresh_model):
    lora_model = LoRAModel(fresh_model, adapters_with_random_B(fresh_model, seed=9))
    samples = padded_samples(lora_model)
    assert_close(ref.kl_to_original(lora_model, lora_model, samples), 0.0, "kl_to_original(policy, policy)", atol=0)
    with torch.no_grad():
        logits = lora_model(samples.ids, attention_mask=samples.attention_mask)
        base_logits = fresh_model(samples.ids, attention_mask=samples.attention_mask)
    p, q = (x[:, samples.prompt_len - 1:-1].log_softmax(-1) for x in (logits, base_logits))
    per_token = (p.exp() * (p - q)).sum(-1)[samples.completion_mask]
    assert_close(ref.kl_to_original(lora_model, fresh_model, samples), per_token.mean().item(),
                 "kl_to_original(policy, base): the mean over completion tokens of the full-vocabulary KL", atol=1e-6)


def test_a_saved_adapter_after_a_merge_sync_no_longer_reproduces_the_policy(tmp_path, fresh_model):
    """After a merge-sync part of the update lives in the base weights, so the adapter file is not the policy; after
    a reference-only sync it still is."""
    samples = padded_samples(fresh_model)
    for lora_sync, same in (("reference_only", True), ("merge", False)):
        model = copy.deepcopy(fresh_model)
        lora_model = LoRAModel(model, adapters_with_random_B(model, seed=10))
        reference = ref.Reference(S(beta=0.1, sync_every=1, sync_alpha=0.5, lora_sync=lora_sync), lora_model)
        reference.maybe_sync(0)
        save_adapter(lora_model.adapters, tmp_path / f"{lora_sync}.safetensors")
        fresh = load_model("tiny", device="cpu")
        reloaded = LoRAModel(fresh, load_adapter(make_adapters(fresh, RANK, ALPHA, ("q", "o")),
                                                 tmp_path / f"{lora_sync}.safetensors"))
        with torch.no_grad():
            gap = (completion_logprobs(reloaded, samples) - completion_logprobs(lora_model, samples)).abs().max()
        expect((gap < 1e-5) == same, f"the saved adapter on a fresh base, after a {lora_sync} sync",
               f"{'reproduces' if same else 'does not reproduce'} the policy; largest log-prob gap {gap:.3g}",
               observed=gap.item())


@pytest.mark.slow
def test_script_prints_json_figures(tmp_path):
    _, figures = run_script("solutions.part4_reference", "--json", "--plot", str(tmp_path / "c.png"))
    runs = {"static", "merge-sync", "reference-only sync"}
    expect(runs | {"seconds", "seeds"} <= set(figures), "the script's figures", f"missing keys: {figures}")
    assert_equal(figures["seeds"], [0, 1], "the smoke run's seeds")
    for run in runs:
        expect({"accuracy_end", "kl_end", "kl_original_end", "saved_adapter_accuracy"} <= set(figures[run])
               and len(figures[run]["accuracy_end"]["seeds"]) == 2, f"the figures of {run}", f"{figures[run]}")
    expect((tmp_path / "c.png").exists(), "the script's plot", "was not written")


# --- Mutants: known wrong versions, each of which some test above must catch and name ----------------------
# Their docstrings are what a learner reads when their version fails the same way.

# reference_kind

def _kind_lora_even_without_beta(settings):
    """With beta == 0 a LoRA run still gets the hooks-removed reference: beta == 0 means no KL term at all, so the
    answer is ("none", False) whatever else is set. Ask about beta first."""
    if settings.beta == 0 and settings.lora:
        return "hooks_removed", settings.precomputed
    return ref.reference_kind(settings)


def _kind_retraining_uses_base(settings):
    """Re-training an adapter is treated like a fresh LoRA (reference = the bare base): the run starts from base +
    old adapter, so the reference is "old_adapter"; the bare base would pull the policy back before yesterday's
    training."""
    kind, precomputed = ref.reference_kind(settings)
    return ("hooks_removed" if kind == "old_adapter" else kind), precomputed


def _kind_precomputed_from_bare_base(settings):
    """"precomputed" is asked before "re-training an adapter", so a precomputed run that re-trains an adapter gets
    the bare base: precomputing changes *when* the reference runs, not *which* model it is (still "old_adapter")."""
    kind, precomputed = ref.reference_kind(settings)
    return ("hooks_removed" if precomputed and kind == "old_adapter" else kind), precomputed


def _kind_ignores_precomputed(settings):
    """precomputed is always False: return what the settings ask for (settings.precomputed) when beta > 0."""
    return ref.reference_kind(settings)[0], False


def _kind_precomputes_without_beta(settings):
    """With beta == 0 precomputed is still settings.precomputed: there is no reference, so nothing to precompute;
    the answer is ("none", False)."""
    kind, precomputed = ref.reference_kind(settings)
    return kind, precomputed or (kind == "none" and settings.precomputed)


def _kind_lora_and_full_swapped(settings):
    """LoRA and full fine-tuning are the wrong way round: with hook-LoRA the reference is the same module with its
    hooks removed ("hooks_removed"); full fine-tuning changes the weights, so it needs a "frozen_copy"."""
    kind, precomputed = ref.reference_kind(settings)
    return {"hooks_removed": "frozen_copy", "frozen_copy": "hooks_removed"}.get(kind, kind), precomputed


def _kind_validates_before_beta(settings):
    """Contradictions are refused before beta == 0 is looked at: with beta == 0 the answer is ("none", False)
    whatever else is set (nothing else is used), so ask about beta first and refuse only when beta > 0."""
    s = settings
    if s.retraining_adapter and not s.lora:
        raise ValueError("retraining_adapter needs lora=True")
    if s.sync_every and (s.precomputed or not 0 < s.sync_alpha <= 1):
        raise ValueError("cannot sync these settings")
    return ref.reference_kind(settings)


def _kind_checks_alpha_without_sync(settings):
    """sync_alpha is checked even when sync_every == 0 (no sync): alpha is only used, and only refused, when the
    reference is synced."""
    if settings.beta > 0 and not 0 < settings.sync_alpha <= 1:
        raise ValueError(f"sync_alpha must be in (0, 1], got {settings.sync_alpha}")
    return ref.reference_kind(settings)


def _kind_writes_into_settings(settings):
    """The settings are changed (precomputed set to False when beta == 0): reference_kind must only read them; the
    trainer and the Reference read the same object later."""
    if settings.beta == 0:
        settings.precomputed = False
    return ref.reference_kind(settings)


@mistake("error")
def _kind_no_validation(settings):
    """Contradictory settings are accepted: raise a ValueError for syncing precomputed log-probs, re-training an
    adapter without LoRA, a sync with alpha outside (0, 1], and a negative beta."""
    if settings.beta <= 0:
        return "none", False
    if settings.retraining_adapter or (settings.lora and settings.sync_every
                                       and settings.lora_sync == "reference_only"):
        return "old_adapter", settings.precomputed
    return ("hooks_removed" if settings.lora else "frozen_copy"), settings.precomputed


@mistake("error")
def _kind_negative_beta_is_none(settings):
    """A negative beta is treated as beta == 0 ("none"): it is a mistake in the settings, so raise a ValueError."""
    return ref.reference_kind(dataclasses.replace(settings, beta=max(settings.beta, 0.0)))


@mistake("error")
def _kind_alpha_zero_allowed(settings):
    """alpha = 0 is accepted for a sync (0 <= alpha instead of 0 < alpha): a sync that never moves the reference is
    a contradiction; alpha must be in (0, 1]."""
    if settings.sync_every and settings.sync_alpha == 0:
        return ref.reference_kind(dataclasses.replace(settings, sync_every=0))
    return ref.reference_kind(settings)


@mistake("error")
def _kind_alpha_one_refused(settings):
    """alpha = 1 is refused (alpha < 1 instead of alpha <= 1): alpha = 1 is a valid sync (it replaces the reference
    by the policy); alpha must be in (0, 1]."""
    if settings.beta > 0 and settings.sync_every and settings.sync_alpha == 1:
        raise ValueError("sync_alpha must be in (0, 1)")
    return ref.reference_kind(settings)


def _kind_reference_only_merges(settings):
    """A LoRA run synced with lora_sync="reference_only" gets "hooks_removed": its reference would be the base,
    which a sync can only move by merging into it (and restarting the LoRA). The control's reference is the base
    + a frozen copy of the adapter, "old_adapter", which a sync moves alone."""
    kind, precomputed = ref.reference_kind(settings)
    if settings.lora_sync == "reference_only" and not settings.retraining_adapter:
        kind = {"old_adapter": "hooks_removed"}.get(kind, kind)
    return kind, precomputed


def _kind_reference_only_without_sync(settings):
    """lora_sync="reference_only" gives "old_adapter" even when the reference is never synced (sync_every == 0):
    no sync ever moves the copy of a fresh adapter (B = 0), so the reference is the bare base, "hooks_removed"
    (no copy, no adapter in the reference's forward pass)."""
    kind, precomputed = ref.reference_kind(settings)
    if kind == "hooks_removed" and settings.lora_sync == "reference_only":
        kind = "old_adapter"
    return kind, precomputed


def _kind_reference_only_full_fine_tuning(settings):
    """lora_sync="reference_only" gives "old_adapter" with full fine-tuning too (lora=False): there is no adapter
    to copy; a full fine-tuning sync (sync_full) always moves the reference alone, so it stays "frozen_copy"."""
    kind, precomputed = ref.reference_kind(settings)
    if kind == "frozen_copy" and settings.sync_every and settings.lora_sync == "reference_only":
        kind = "old_adapter"
    return kind, precomputed


@mistake("error")
def _kind_lora_sync_unchecked(settings):
    """A lora_sync that is neither "merge" nor "reference_only" is accepted (and run as a merge): refuse it with a
    ValueError that names the two, or a typo silently runs the other experiment."""
    if settings.lora_sync not in ref.LORA_SYNCS:
        settings = dataclasses.replace(settings, lora_sync="merge")
    return ref.reference_kind(settings)


# frozen_adapter_copy

def _copy_shares_tensors(adapters):
    """The adapters themselves are returned: the "copy" is the live adapters, so training moves the reference
    with the policy. Return copy.deepcopy(adapters), frozen."""
    return adapters


def _copy_not_frozen(adapters):
    """The copy is not frozen: its parameters still require grad. Call .requires_grad_(False) on the copy."""
    return copy.deepcopy(adapters)


def _copy_freezes_both(adapters):
    """The adapters are frozen before they are copied, so the live adapters are frozen too and would never train:
    copy first, then freeze only the copy."""
    adapters.requires_grad_(False)
    return copy.deepcopy(adapters)


def _copy_same_modules(adapters):
    """A new ModuleDict holding the same LoRA modules: a new container, but the same tensors, so training the
    adapters moves the copy (and it is not frozen). Copy the modules (copy.deepcopy), then freeze the copy."""
    return nn.ModuleDict(dict(adapters.items()))


def _copy_detached(adapters):
    """Each tensor is .detach()ed into the copy: detach makes a tensor without autograd history that shares the
    same memory, so the copy follows every training step. Clone the tensors (copy.deepcopy does)."""
    frozen = copy.deepcopy(adapters)
    for key, a in frozen.items():
        a.A = nn.Parameter(adapters[key].A.detach(), requires_grad=False)
        a.B = nn.Parameter(adapters[key].B.detach(), requires_grad=False)
    return frozen


def _copy_default_alpha(adapters):
    """Each copy is rebuilt as LoRA(d_in, d_out, rank) and given the tensors, so it has LoRA's default alpha and
    the wrong scale (alpha / rank): copy the whole module (copy.deepcopy), scale included."""
    frozen = nn.ModuleDict()
    for key, a in adapters.items():
        rank, d_in = a.A.shape
        lora = LoRA(d_in, a.B.shape[0], rank)
        lora.load_state_dict(a.state_dict())
        frozen[key] = lora.requires_grad_(False)
    return frozen


def _copy_plain_dict(adapters):
    """A plain dict of copies is returned: return an nn.ModuleDict (copy.deepcopy(adapters) is one), which the
    Reference and sync_old_adapter use as a module."""
    return {key: copy.deepcopy(a).requires_grad_(False) for key, a in adapters.items()}


# old_adapter_logprobs

@torch.no_grad()
def _old_adapter_bare_base(lora_model, old_adapters, samples):
    """The bare base model is used: the run started from base + old adapter, so that is what the KL must keep the
    policy near. Run the base with the old adapter's hooks on (lora_hooks(lora_model.base, old_adapters))."""
    return completion_logprobs(lora_model.base, samples)


@torch.no_grad()
def _old_adapter_current(lora_model, old_adapters, samples):
    """The adapters being trained are used (lora_model itself), not the frozen old ones: run lora_model.base with
    the hooks of old_adapters."""
    return completion_logprobs(lora_model, samples)


@mistake("lora")
@torch.no_grad()
def _old_adapter_both_adapters(lora_model, old_adapters, samples):
    """The old adapter's hooks are added to the LoRAModel, whose forward adds the live adapters' hooks too: both
    updates count. Run lora_model.base (no hooks of its own) with only the old adapter's hooks."""
    with lora_model.base.hooks(fwd_hooks=lora_hooks(lora_model.base, old_adapters)):
        return completion_logprobs(lora_model, samples)


@torch.no_grad()
def _old_adapter_no_completion_mask(lora_model, old_adapters, samples):
    """The log-probs after each completion's first EOS are not zeroed: multiply by samples.completion_mask (Part 0's
    completion_logprobs does)."""
    with lora_model.base.hooks(fwd_hooks=lora_hooks(lora_model.base, old_adapters)):
        logits = lora_model.base(samples.ids, attention_mask=samples.attention_mask)
    return get_logprobs(logits, samples.ids, prefix_len=samples.prompt_len)


@torch.no_grad()
def _old_adapter_no_attention_mask(lora_model, old_adapters, samples):
    """The forward pass runs without the attention mask, so left-padded prompts attend to their padding and get
    the wrong positions: pass attention_mask=samples.attention_mask (completion_logprobs does)."""
    with lora_model.base.hooks(fwd_hooks=lora_hooks(lora_model.base, old_adapters)):
        logits = lora_model.base(samples.ids)
    return get_logprobs(logits, samples.ids, prefix_len=samples.prompt_len) * samples.completion_mask


@mistake("gradient")
def _old_adapter_with_grad(lora_model, old_adapters, samples):
    """Computed outside torch.no_grad(): the reference's log-probs carry a graph back to the base weights, so a KL
    against them would train the reference side too. Decorate with @torch.no_grad()."""
    with lora_model.base.hooks(fwd_hooks=lora_hooks(lora_model.base, old_adapters)):
        return completion_logprobs(lora_model.base, samples)


@mistake("hooks")
@torch.no_grad()
def _old_adapter_hooks_left_on(lora_model, old_adapters, samples):
    """The old adapter's hooks are added with add_hook and never removed: every later forward pass of the base
    (the policy's too) runs them. Use `with lora_model.base.hooks(fwd_hooks=...):`, which removes them."""
    for name, hook in lora_hooks(lora_model.base, old_adapters):
        lora_model.base.add_hook(name, hook)
    return completion_logprobs(lora_model.base, samples)


@mistake("hooks")
@torch.no_grad()
def _old_adapter_reset_hooks(lora_model, old_adapters, samples):
    """The hooks are removed with reset_hooks(), which removes every hook, the caller's too: use
    `with lora_model.base.hooks(fwd_hooks=...):`, which removes only its own."""
    for name, hook in lora_hooks(lora_model.base, old_adapters):
        lora_model.base.add_hook(name, hook)
    try:
        return completion_logprobs(lora_model.base, samples)
    finally:
        lora_model.base.reset_hooks()


@mistake("hooks")
@torch.no_grad()
def _old_adapter_hooks_left_on_error(lora_model, old_adapters, samples):
    """The hooks are removed after the forward pass but not in a `finally:`, so when the forward pass raises they
    stay on: use `with lora_model.base.hooks(fwd_hooks=...):`, which removes them either way."""
    points = []
    for name, hook in lora_hooks(lora_model.base, old_adapters):
        points.append(lora_model.base.hook_dict[name])
        points[-1].add_hook(hook)
    out = completion_logprobs(lora_model.base, samples)
    for point in points:
        point.remove_hooks("fwd")
    return out


@mistake("inputs")
@torch.no_grad()
def _old_adapter_swaps_adapters(lora_model, old_adapters, samples):
    """The LoRAModel's adapters are swapped for the old ones and not put back: from now on the policy *is* the old
    adapter, and the optimiser trains tensors the model no longer uses. Leave lora_model as it is: run its base
    with the old adapter's hooks."""
    lora_model.adapters = old_adapters
    return completion_logprobs(lora_model, samples)


@mistake("inputs")
@torch.no_grad()
def _old_adapter_zeroes_padding_ids(lora_model, old_adapters, samples):
    """The padding of samples.ids is overwritten in place (set to 0): the caller's samples change. Padding is
    masked already; leave the samples as they are."""
    samples.ids.masked_fill_(samples.attention_mask == 0, 0)
    return ref.old_adapter_logprobs(lora_model, old_adapters, samples)


@mistake("inputs")
def _old_adapter_freezes_the_model(lora_model, old_adapters, samples):
    """Every parameter of the LoRAModel is set to requires_grad = False to get log-probs without gradients: the
    adapters being trained stop learning. Use torch.no_grad(), which changes no flag."""
    for p in lora_model.parameters():
        p.requires_grad = False
    return ref.old_adapter_logprobs(lora_model, old_adapters, samples)


# precompute_reference_logprobs

@mistake("lora")
@torch.no_grad()
def _precompute_with_hooks(model, kind, dataset):
    """The LoRAModel itself is run for every kind, adapter on: with a fresh LoRA the reference is model.base with
    no hooks ("hooks_removed")."""
    return [completion_logprobs(model, batch) for batch in dataset]


@torch.no_grad()
def _precompute_bare_base_while_retraining(model, kind, dataset):
    """"old_adapter" is computed from the bare base: while re-training an adapter the run starts from base + old
    adapter, and so does its reference, precomputed or not. Before training the adapter *is* the old one:
    old_adapter_logprobs(model, model.adapters, batch)."""
    return [completion_logprobs(model if kind == "frozen_copy" else model.base, batch) for batch in dataset]


def _precompute_full_ft_from_base(model, kind, dataset):
    """"frozen_copy" asks the model for .base, which a plain (fully fine-tuned) model does not have: for full
    fine-tuning the reference, before training, is the model itself."""
    if kind == "frozen_copy":
        return ref.precompute_reference_logprobs(model.base, "frozen_copy", dataset)
    return ref.precompute_reference_logprobs(model, kind, dataset)


@mistake("gradient")
def _precompute_with_grad(model, kind, dataset):
    """Computed outside torch.no_grad(): the table keeps an autograd graph (and its memory) for every batch, and a
    KL against it would send gradients into the reference. Decorate with @torch.no_grad()."""
    if kind == "hooks_removed":
        return [completion_logprobs(model.base, batch) for batch in dataset]
    if kind == "old_adapter":
        with model.base.hooks(fwd_hooks=lora_hooks(model.base, model.adapters)):
            return [completion_logprobs(model.base, batch) for batch in dataset]
    return [completion_logprobs(model, batch) for batch in dataset]


@torch.no_grad()
def _precompute_no_completion_mask(model, kind, dataset):
    """The log-probs after each completion's first EOS are not zeroed: multiply by the batch's completion_mask
    (Part 0's completion_logprobs does)."""
    net = model if kind == "frozen_copy" else model.base
    hooks = lora_hooks(model.base, model.adapters) if kind == "old_adapter" else []
    table = []
    with net.hooks(fwd_hooks=hooks):
        for batch in dataset:
            logits = net(batch.ids, attention_mask=batch.attention_mask)
            table.append(get_logprobs(logits, batch.ids, prefix_len=batch.prompt_len))
    return table


@torch.no_grad()
def _precompute_sorted_by_length(model, kind, dataset):
    """The batches are processed in another order (sorted by length) and the table kept in that order: training
    looks batch i up as table[i], so keep the dataset's order."""
    ordered = sorted(dataset, key=lambda batch: batch.ids.shape[1])
    return ref.precompute_reference_logprobs(model, kind, ordered)


@torch.no_grad()
def _precompute_skips_last_batch(model, kind, dataset):
    """The last batch is left out (range(len(dataset) - 1)): one tensor per batch, every batch."""
    return ref.precompute_reference_logprobs(model, kind, dataset[:-1])


@mistake("error")
@torch.no_grad()
def _precompute_none_is_empty(model, kind, dataset):
    """kind "none" returns an empty table instead of raising: there is no reference to precompute, and an empty
    table would only fail later, far from the cause. Raise a ValueError."""
    if kind == "none":
        return []
    return ref.precompute_reference_logprobs(model, kind, dataset)


@mistake("error")
@torch.no_grad()
def _precompute_unknown_kind_falls_through(model, kind, dataset):
    """Any kind that is not "hooks_removed" or "old_adapter" is treated as "frozen_copy" (an `else:`): raise a
    ValueError for a kind that is not one of the three."""
    if kind in ("hooks_removed", "old_adapter"):
        return ref.precompute_reference_logprobs(model, kind, dataset)
    return [completion_logprobs(model, batch) for batch in dataset]


@mistake("error")
@torch.no_grad()
def _precompute_key_error(model, kind, dataset):
    """The kind is looked up in a dict, so an unknown kind raises a KeyError: raise the ValueError the docstring
    promises, saying which kinds there are."""
    which = {"hooks_removed": lambda b: completion_logprobs(model.base, b),
             "old_adapter": lambda b: ref.old_adapter_logprobs(model, model.adapters, b),
             "frozen_copy": lambda b: completion_logprobs(model, b)}[kind]
    return [which(batch) for batch in dataset]


@mistake("inputs")
@torch.no_grad()
def _precompute_zeroes_B(model, kind, dataset):
    """For "hooks_removed" the adapter is switched off by zeroing B in place: that destroys the adapter (the policy
    the run trains). Run model.base, which has no hooks, instead."""
    if kind == "hooks_removed":
        for a in model.adapters.values():
            a.B.zero_()
        return [completion_logprobs(model, batch) for batch in dataset]
    return ref.precompute_reference_logprobs(model, kind, dataset)


@mistake("inputs")
@torch.no_grad()
def _precompute_pops_dataset(model, kind, dataset):
    """The dataset is consumed with dataset.pop(): the caller's list is emptied (the trainer still needs it), and
    the table comes out in reverse order. Loop over it: [... for batch in dataset]."""
    table = []
    while dataset:
        table.append(ref.precompute_reference_logprobs(model, kind, [dataset.pop()])[0])
    return table


@mistake("hooks")
@torch.no_grad()
def _precompute_hooks_left_on(model, kind, dataset):
    """For "old_adapter" the adapter's hooks are added with add_hook and never removed: every later forward pass of
    the base runs them, the reference's too. Use `with model.base.hooks(fwd_hooks=...):` (old_adapter_logprobs)."""
    if kind == "old_adapter":
        for name, hook in lora_hooks(model.base, model.adapters):
            model.base.add_hook(name, hook)
        return [completion_logprobs(model.base, batch) for batch in dataset]
    return ref.precompute_reference_logprobs(model, kind, dataset)


@mistake("inputs")
def _precompute_freezes_adapters(model, kind, dataset):
    """The adapters are frozen (requires_grad_(False)) to compute the table without gradients, and left frozen: the
    run would then train nothing. Use torch.no_grad(), which changes no flag."""
    if hasattr(model, "adapters"):
        model.adapters.requires_grad_(False)
    return ref.precompute_reference_logprobs(model, kind, dataset)


# sync_full

@torch.no_grad()
def _sync_moves_policy_too(policy, reference, alpha):
    """Both models are set to the mix, the policy too: a sync moves the reference only. Change the reference's
    weights in place and leave the policy's alone."""
    for r, p in zip(reference.parameters(), policy.parameters()):
        mixed = alpha * p + (1 - alpha) * r
        r.copy_(mixed)
        p.copy_(mixed)


@torch.no_grad()
def _sync_swapped(policy, reference, alpha):
    """alpha and 1 - alpha are swapped (ref <- (1 - alpha) * policy + alpha * ref): alpha is how far the reference
    moves towards the policy, ref <- alpha * policy + (1 - alpha) * ref (p_ref.lerp_(p_pol, alpha))."""
    for p_ref, p_pol in zip(reference.parameters(), policy.parameters()):
        p_ref.lerp_(p_pol, 1 - alpha)


@torch.no_grad()
def _sync_lerp_wrong_way(policy, reference, alpha):
    """The policy is moved towards the reference (p_pol.lerp_(p_ref, alpha)): the reference is the one that moves,
    p_ref.lerp_(p_pol, alpha)."""
    for p_ref, p_pol in zip(reference.parameters(), policy.parameters()):
        p_pol.lerp_(p_ref, alpha)


@torch.no_grad()
def _sync_rebinds_name(policy, reference, alpha):
    """The mix is assigned to the loop variable (p_ref = alpha * p_pol + ...), which changes nothing in the model:
    write into the reference's tensors in place (p_ref.lerp_(p_pol, alpha), or p_ref.copy_(...))."""
    for p_ref, p_pol in zip(reference.parameters(), policy.parameters()):
        p_ref = alpha * p_pol + (1 - alpha) * p_ref  # noqa: F841, PLW2901


@torch.no_grad()
def _sync_only_trainable(policy, reference, alpha):
    """Only parameters that require grad are synced, and the reference (frozen) has none: sync every weight,
    trainable or not."""
    for p_ref, p_pol in zip([p for p in reference.parameters() if p.requires_grad], policy.parameters()):
        p_ref.lerp_(p_pol, alpha)


@mistake("gradient")
def _sync_without_no_grad(policy, reference, alpha):
    """The sync runs with autograd recording, so each reference weight becomes the output of an operation on the
    policy's weights (with a graph back to them): run it under torch.no_grad()."""
    for p_ref, p_pol in zip(reference.parameters(), policy.parameters()):
        p_ref.copy_(alpha * p_pol + (1 - alpha) * p_ref)


@torch.no_grad()
def _sync_shares_when_alpha_one(policy, reference, alpha):
    """With alpha = 1 the reference is pointed at the policy's tensors (p_ref.data = p_pol.data), so from then on
    it moves with the policy: copy the values in (p_ref.copy_(p_pol), or lerp_ with alpha = 1)."""
    for p_ref, p_pol in zip(reference.parameters(), policy.parameters()):
        if alpha == 1:
            p_ref.data = p_pol.data
        else:
            p_ref.lerp_(p_pol, alpha)


@torch.no_grad()
def _sync_forgets_alpha_on_policy(policy, reference, alpha):
    """The reference is scaled by 1 - alpha and the whole policy added (ref <- (1 - alpha) * ref + policy): the
    policy's share is alpha * policy."""
    for p_ref, p_pol in zip(reference.parameters(), policy.parameters()):
        p_ref.mul_(1 - alpha).add_(p_pol)


# sync_lora

@torch.no_grad()
def _sync_lora_keeps_B(lora_model, alpha):
    """alpha of the update is merged into the base but B is left as it was, so the update counts twice (in the base
    and in the hooks) and the policy moves: shrink B to (1 - alpha) B."""
    for key, a in lora_model.adapters.items():
        weight, in_out = base_weight(lora_model.base, key)
        delta = alpha * a.scale * (a.B @ a.A)
        weight += delta.T if in_out else delta


@torch.no_grad()
def _sync_lora_full_merge(lora_model, alpha):
    """The whole update (scale * B A) is merged, not alpha of it, while B shrinks to (1 - alpha) B: merge
    alpha * scale * B A."""
    for key, a in lora_model.adapters.items():
        weight, in_out = base_weight(lora_model.base, key)
        delta = a.scale * (a.B @ a.A)
        weight += delta.T if in_out else delta
        a.B.mul_(1 - alpha)


@torch.no_grad()
def _sync_lora_B_times_alpha(lora_model, alpha):
    """B is scaled by alpha instead of 1 - alpha: after alpha of the update went into the base, the adapter must
    carry the rest, (1 - alpha) B."""
    for key, a in lora_model.adapters.items():
        weight, in_out = base_weight(lora_model.base, key)
        delta = alpha * a.scale * (a.B @ a.A)
        weight += delta.T if in_out else delta
        a.B.mul_(alpha)


@torch.no_grad()
def _sync_lora_no_scale(lora_model, alpha):
    """The merge leaves out the adapter's scale (alpha_lora / rank): the hooks add scale * B A, so the base must
    take alpha * scale * B A."""
    for key, a in lora_model.adapters.items():
        weight, in_out = base_weight(lora_model.base, key)
        delta = alpha * (a.B @ a.A)
        weight += delta.T if in_out else delta
        a.B.mul_(1 - alpha)


@torch.no_grad()
def _sync_lora_shrinks_first(lora_model, alpha):
    """B is shrunk before the update is computed, so the base takes alpha (1 - alpha) of it: compute
    alpha * scale * B A from the B as it was, merge it, then shrink B."""
    for key, a in lora_model.adapters.items():
        weight, in_out = base_weight(lora_model.base, key)
        a.B.mul_(1 - alpha)
        delta = alpha * a.scale * (a.B @ a.A)
        weight += delta.T if in_out else delta


@mistake("lora")
@torch.no_grad()
def _sync_lora_ignores_layout(lora_model, alpha):
    """The update B A ([d_out, d_in]) is added untransposed to every weight, but some base weights are stored
    [d_in, d_out] (base_weight's second answer, True for GPT-2's Conv1D-style weights): transpose it for those."""
    for key, a in lora_model.adapters.items():
        weight, _ = base_weight(lora_model.base, key)
        weight += alpha * a.scale * (a.B @ a.A)
        a.B.mul_(1 - alpha)


@torch.no_grad()
def _sync_lora_out_of_place(lora_model, alpha):
    """The merged weight is assigned to a name (weight = weight + delta), which leaves the base as it was while B
    shrinks, so the policy moves: add in place (weight += delta)."""
    for key, a in lora_model.adapters.items():
        weight, in_out = base_weight(lora_model.base, key)
        delta = alpha * a.scale * (a.B @ a.A)
        weight = weight + (delta.T if in_out else delta)  # noqa: F841
        a.B.mul_(1 - alpha)


@torch.no_grad()
def _sync_lora_new_B_parameter(lora_model, alpha):
    """B is replaced by a new nn.Parameter ((1 - alpha) B): the optimiser holds the old B and would go on updating
    a tensor the model no longer uses. Shrink it in place: B.mul_(1 - alpha)."""
    for key, a in lora_model.adapters.items():
        weight, in_out = base_weight(lora_model.base, key)
        delta = alpha * a.scale * (a.B @ a.A)
        weight += delta.T if in_out else delta
        a.B = nn.Parameter((1 - alpha) * a.B)


MUTANTS = {
    "reference_kind": [_kind_lora_even_without_beta, _kind_retraining_uses_base, _kind_precomputed_from_bare_base,
                       _kind_ignores_precomputed, _kind_precomputes_without_beta, _kind_lora_and_full_swapped,
                       _kind_validates_before_beta, _kind_checks_alpha_without_sync, _kind_writes_into_settings,
                       _kind_no_validation, _kind_negative_beta_is_none, _kind_alpha_zero_allowed,
                       _kind_alpha_one_refused, _kind_reference_only_merges, _kind_reference_only_without_sync,
                       _kind_reference_only_full_fine_tuning, _kind_lora_sync_unchecked],
    "frozen_adapter_copy": [_copy_shares_tensors, _copy_not_frozen, _copy_freezes_both, _copy_same_modules,
                            _copy_detached, _copy_default_alpha, _copy_plain_dict],
    "old_adapter_logprobs": [_old_adapter_bare_base, _old_adapter_current, _old_adapter_both_adapters,
                             _old_adapter_no_completion_mask, _old_adapter_no_attention_mask, _old_adapter_with_grad,
                             _old_adapter_hooks_left_on, _old_adapter_reset_hooks, _old_adapter_hooks_left_on_error,
                             _old_adapter_swaps_adapters, _old_adapter_zeroes_padding_ids,
                             _old_adapter_freezes_the_model],
    "precompute_reference_logprobs": [_precompute_with_hooks, _precompute_bare_base_while_retraining,
                                      _precompute_full_ft_from_base, _precompute_with_grad,
                                      _precompute_no_completion_mask, _precompute_sorted_by_length,
                                      _precompute_skips_last_batch, _precompute_none_is_empty,
                                      _precompute_unknown_kind_falls_through, _precompute_key_error,
                                      _precompute_zeroes_B, _precompute_pops_dataset, _precompute_hooks_left_on,
                                      _precompute_freezes_adapters],
    "sync_full": [_sync_moves_policy_too, _sync_swapped, _sync_lerp_wrong_way, _sync_rebinds_name,
                  _sync_only_trainable, _sync_without_no_grad, _sync_shares_when_alpha_one,
                  _sync_forgets_alpha_on_policy],
    "sync_lora": [_sync_lora_keeps_B, _sync_lora_full_merge, _sync_lora_B_times_alpha, _sync_lora_no_scale,
                  _sync_lora_shrinks_first, _sync_lora_ignores_layout, _sync_lora_out_of_place,
                  _sync_lora_new_B_parameter],
}
