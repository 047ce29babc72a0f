"""Tests of Part 2's exercises (LoRA as hooks). Each runs against `impl` (see utils/harness.py).

MUTANTS, at the end, are the mistakes these tests are proven to catch (tests/test_harness.py runs them).
"""

import math

import pytest
import torch
import torch.nn as nn

from solutions import part2_lora as ref
from solutions.part0_warmup import completion_logprobs
from tests.helpers import active_hooks, assert_matches, run_script
from utils.models import load_model
from utils.sampling import sample

exercise = pytest.mark.exercise
ALL_TARGETS = tuple(ref.TARGETS)


@pytest.fixture
def fresh_model():
    """A model of our own: these tests change weights, which the shared tiny model must never see."""
    return load_model("tiny", device="cpu")


def random_adapters(model, targets=ALL_TARGETS, seed=0, rank=4, alpha=8.0):
    """Reference adapters with B drawn at random, so that they change the model."""
    torch.manual_seed(seed)
    adapters = ref.make_adapters(model, rank, alpha, targets)
    with torch.no_grad():
        for a in adapters.values():
            a.B.normal_(0, 0.05)
    return adapters


def some_tokens(model):
    tok = model.tokenizer
    return torch.tensor([[tok.bos_token_id] + tok(t, add_special_tokens=False).input_ids
                         for t in ("This is a happy dog.", "The cat is in the room")])


# --- LoRA --------------------------------------------------------------------------------------------------

@exercise("LoRA")
def test_lora_initialisation(impl):
    torch.manual_seed(0)
    lora = impl.LoRA(64, 96, rank=8, alpha=16.0)
    assert tuple(lora.A.shape) == (8, 64) and tuple(lora.B.shape) == (96, 8), (
        f"A should be [rank, d_in] = (8, 64) and B [d_out, rank] = (96, 8); got {tuple(lora.A.shape)} and "
        f"{tuple(lora.B.shape)}")
    assert isinstance(lora.A, nn.Parameter) and isinstance(lora.B, nn.Parameter), "A and B must be nn.Parameters"
    assert torch.all(lora.B == 0), "B must start at zero, so that the adapted model starts as the base model"
    bound = 1 / math.sqrt(64)  # kaiming_uniform_(a=sqrt(5)) draws from U(-1/sqrt(d_in), 1/sqrt(d_in))
    assert lora.A.abs().max() <= bound + 1e-6 and lora.A.std() > 0.8 * bound / math.sqrt(3), (
        "A should be Kaiming-uniform like nn.Linear's weight: nn.init.kaiming_uniform_(A, a=math.sqrt(5))")
    assert lora.scale == pytest.approx(2.0), "scale is alpha / rank"


@exercise("LoRA")
def test_lora_forward(impl):
    torch.manual_seed(0)
    lora = impl.LoRA(16, 12, rank=4, alpha=8.0)
    with torch.no_grad():
        lora.B.normal_()
    x = torch.randn(2, 5, 16)
    update = x @ lora.A.T @ lora.B.T
    assert_matches(lora(x), 2.0 * update, "LoRA(x)", mistakes={
        "the alpha / rank scaling was left out": update,
        "scaled by alpha, not alpha / rank": 8.0 * update,
    })


# --- lora_hooks --------------------------------------------------------------------------------------------

@exercise("lora_hooks")
def test_lora_hooks_with_zero_B_leave_the_model_unchanged(impl, tiny_model):
    torch.manual_seed(0)
    adapters = ref.make_adapters(tiny_model, 4, 8.0, ALL_TARGETS)
    tokens = some_tokens(tiny_model)
    hooks = impl.lora_hooks(tiny_model, adapters)
    assert active_hooks(tiny_model) == [], "lora_hooks must only *return* the hooks, not add them to the model"
    assert len(hooks) >= len(adapters), "at least one hook per adapter"
    with torch.no_grad():
        torch.testing.assert_close(tiny_model.run_with_hooks(tokens, fwd_hooks=hooks), tiny_model(tokens))


@exercise("lora_hooks")
def test_lora_hooks_match_the_reference(impl, tiny_model):
    tokens = some_tokens(tiny_model)
    for targets in (("q",), ("o",), ("mlp_in", "mlp_out"), ALL_TARGETS):
        adapters = random_adapters(tiny_model, targets)
        with torch.no_grad():
            expected = tiny_model.run_with_hooks(tokens, fwd_hooks=ref.lora_hooks(tiny_model, adapters))
            actual = tiny_model.run_with_hooks(tokens, fwd_hooks=impl.lora_hooks(tiny_model, adapters))
            unscaled = tiny_model.run_with_hooks(tokens, fwd_hooks=_hooks_no_scale(tiny_model, adapters))
        assert_matches(actual, expected, f"logits with LoRA on {targets}", mistakes={
            "the adapter's update was not scaled: call the adapter (its forward applies alpha / rank)": unscaled,
        }, atol=1e-4)
        assert active_hooks(tiny_model) == [], f"hooks left on the model: {active_hooks(tiny_model)}"


@exercise("lora_hooks")
def test_lora_hooks_act_in_generate_under_the_context_manager_only(impl, tiny_model):
    adapters = random_adapters(tiny_model, seed=1)
    torch.manual_seed(0)
    with tiny_model.hooks(fwd_hooks=ref.lora_hooks(tiny_model, adapters)):
        expected = sample(tiny_model, ["This is", "The"], max_new_tokens=10, temperature=0).ids
    plain = sample(tiny_model, ["This is", "The"], max_new_tokens=10, temperature=0).ids
    with tiny_model.hooks(fwd_hooks=impl.lora_hooks(tiny_model, adapters)):
        adapted = sample(tiny_model, ["This is", "The"], max_new_tokens=10, temperature=0).ids
    assert not torch.equal(expected, plain), "test set-up: the adapters should change greedy samples"
    assert torch.equal(adapted, expected), "generate with the hooks entered must sample from the adapted model"
    assert torch.equal(sample(tiny_model, ["This is", "The"], max_new_tokens=10, temperature=0).ids, plain), (
        "after the with-block the model must be the base model again: hooks were left behind")


# --- policy_and_reference_logprobs ---------------------------------------------------------------------------

@exercise("policy_and_reference_logprobs")
def test_reference_is_the_base_model_without_hooks(impl, tiny_model):
    adapters = random_adapters(tiny_model, seed=2)
    lora_model = ref.LoRAModel(tiny_model, adapters)
    torch.manual_seed(0)
    samples = sample(lora_model, ["This is", "The", "My friend"], max_new_tokens=12)
    with torch.no_grad():
        logprobs, ref_logprobs = impl.policy_and_reference_logprobs(lora_model, samples)
        base = completion_logprobs(tiny_model, samples)
        adapted = completion_logprobs(lora_model, samples)
    assert active_hooks(tiny_model) == [], f"hooks left on the model: {active_hooks(tiny_model)}"
    assert_matches(ref_logprobs, base, "reference log-probs", mistakes={
        "the reference was computed with the LoRA hooks still on": adapted})
    assert_matches(logprobs, adapted, "policy log-probs", mistakes={
        "the policy was computed without the LoRA hooks": base})


# --- freeze_base -------------------------------------------------------------------------------------------

@exercise("freeze_base")
def test_freeze_base_only_adapters_get_gradients(impl, fresh_model):
    adapters = random_adapters(fresh_model, ("q", "v"))
    adapters.requires_grad_(False)  # as after loading a frozen adapter: freeze_base must switch them on
    trainable, total = impl.freeze_base(fresh_model, adapters)
    assert trainable == sum(p.numel() for p in adapters.parameters()), "trainable should count the adapters"
    assert total == ref.count_parameters(fresh_model), "total should be count_parameters(model)"
    lora_model = ref.LoRAModel(fresh_model, adapters)
    lora_model(some_tokens(fresh_model)).logsumexp(-1).sum().backward()
    leaked = [n for n, p in fresh_model.named_parameters() if p.grad is not None]
    assert not leaked, f"gradients reached the base weights ({leaked[:2]}...): freeze the whole base model"
    assert all(p.grad is not None for p in adapters.parameters()), "every adapter parameter must get a gradient"


# --- merge_lora / unmerge_lora -------------------------------------------------------------------------------

@exercise("merge_lora")
def test_merge_matches_the_hooked_model(impl, fresh_model):
    tokens = some_tokens(fresh_model)
    adapters = random_adapters(fresh_model, ALL_TARGETS, seed=3)
    with torch.no_grad():
        hooked = ref.LoRAModel(fresh_model, adapters)(tokens)
        impl.merge_lora(fresh_model, adapters)
        merged = fresh_model(tokens)
    assert_matches(merged, hooked, "logits of the merged model", atol=1e-4)


@exercise("unmerge_lora")
def test_unmerge_restores_the_base_model(impl, fresh_model):
    tokens = some_tokens(fresh_model)
    adapters = random_adapters(fresh_model, ALL_TARGETS, seed=4)
    with torch.no_grad():
        base = fresh_model(tokens)
        ref.merge_lora(fresh_model, adapters)
        impl.unmerge_lora(fresh_model, adapters)
        after = fresh_model(tokens)
    assert_matches(after, base, "logits after merge then unmerge", atol=1e-4)


# --- save_adapter / load_adapter ------------------------------------------------------------------------------

@exercise("save_adapter")
def test_save_adapter_writes_safetensors(impl, tiny_model, tmp_path):
    from safetensors import safe_open

    adapters = random_adapters(tiny_model, ("q", "o"), rank=4, alpha=8.0)
    impl.save_adapter(adapters, tmp_path / "a.safetensors")
    with safe_open(str(tmp_path / "a.safetensors"), framework="pt") as f:
        assert set(f.keys()) == set(adapters.state_dict()), "save every adapter's A and B under its state_dict name"
        meta = f.metadata() or {}
    assert meta.get("rank") == "4" and float(meta.get("alpha", "nan")) == 8.0, (
        "store rank and alpha in the file's metadata (as strings)")
    fresh = ref.make_adapters(tiny_model, 4, 8.0, ("q", "o"))
    ref.load_adapter(fresh, tmp_path / "a.safetensors")
    for (n, p), q in zip(adapters.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(p, q), f"{n} changed in the round trip"


@exercise("load_adapter")
def test_load_adapter_round_trip_and_mismatch(impl, tiny_model, tmp_path):
    adapters = random_adapters(tiny_model, ("q", "o"), rank=4, alpha=8.0)
    ref.save_adapter(adapters, tmp_path / "a.safetensors")
    fresh = ref.make_adapters(tiny_model, 4, 8.0, ("q", "o"))
    out = impl.load_adapter(fresh, tmp_path / "a.safetensors")
    assert out is fresh, "return the adapters you loaded into"
    tokens = some_tokens(tiny_model)
    with torch.no_grad():
        torch.testing.assert_close(ref.LoRAModel(tiny_model, fresh)(tokens), ref.LoRAModel(tiny_model, adapters)(tokens))
    with pytest.raises(ValueError):
        impl.load_adapter(ref.make_adapters(tiny_model, 8, 8.0, ("q", "o")), tmp_path / "a.safetensors")
    with pytest.raises(ValueError):
        impl.load_adapter(ref.make_adapters(tiny_model, 4, 8.0, ("q", "k")), tmp_path / "a.safetensors")


@exercise("load_adapter")
def test_load_adapter_checks_alpha(impl, tiny_model, tmp_path):
    adapters = random_adapters(tiny_model, ("q", "o"), rank=4, alpha=8.0)
    ref.save_adapter(adapters, tmp_path / "a.safetensors")
    other_alpha = ref.make_adapters(tiny_model, 4, 16.0, ("q", "o"))  # same shapes, twice the scale
    try:
        impl.load_adapter(other_alpha, tmp_path / "a.safetensors")
    except ValueError as e:
        assert "alpha" in str(e), f"say in the error that alpha differs, and what to build instead: {e}"
    else:
        raise AssertionError("an adapter saved with alpha 8 loaded into adapters built with alpha 16 without an "
                             "error: the same A and B would then compute a different model. Compare the rank and "
                             "alpha in the file's metadata with the adapters' and raise a ValueError")


# --- PPO with LoRA (provided): the reference costs nothing and stays the base model --------------------------

@pytest.mark.slow
def test_ppo_with_lora_trains_only_the_adapters_and_shares_the_weights():
    cfg = ref.PPOConfig(phases=2, batch_size=8, minibatch_size=4, max_new_tokens=8, table_every=100, lr_model=1e-2)
    trainer, lora_model = ref.ppo_with_lora(cfg, rank=4, alpha=8.0)
    untouched = load_model("tiny", device="cpu")
    trainer.train()
    assert trainer.reference is lora_model.base, "the reference must be the LoRA model's own base module"
    policy_storage = {p.data_ptr() for p in trainer.model.parameters()}
    assert {p.data_ptr() for p in trainer.reference.parameters()} <= policy_storage, (
        "the reference holds weights of its own: no second copy may exist")
    tokens = some_tokens(untouched)
    with torch.no_grad():
        torch.testing.assert_close(trainer.reference(tokens), untouched(tokens), rtol=0, atol=0)
        assert not torch.allclose(lora_model(tokens), untouched(tokens), atol=1e-4), "the adapters did not train"


@pytest.mark.slow
def test_ppo_with_lora_trains_the_value_head_and_not_the_base():
    cfg = ref.PPOConfig(phases=1, batch_size=8, minibatch_size=4, max_new_tokens=8, table_every=100, lr_model=1e-2)
    trainer, lora_model = ref.ppo_with_lora(cfg, rank=4, alpha=8.0)
    base_before = {n: p.detach().clone() for n, p in lora_model.base.named_parameters()}
    head_before = [p.detach().clone() for p in trainer.policy.value_head.parameters()]
    trainer.learning_phase(trainer.rollout_phase())  # the last minibatch's gradients stay on the parameters
    head = list(trainer.policy.value_head.parameters())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in head), "the value head got no gradient"
    assert any(not torch.equal(p, q) for p, q in zip(head, head_before)), "the value head did not train"
    assert all(p.grad is not None for p in lora_model.adapters.parameters()), "an adapter got no gradient"
    leaked = [n for n, p in lora_model.base.named_parameters() if p.requires_grad or p.grad is not None]
    assert not leaked, f"base weights are trainable or got gradients: {leaked[:3]}"
    changed = [n for n, p in lora_model.base.named_parameters() if not torch.equal(p, base_before[n])]
    assert not changed, f"base weights changed: {changed[:3]}"


def test_script_rejects_an_unknown_preset(capsys):
    with pytest.raises(SystemExit):
        ref.main(["--preset", "gpt3"])  # never a silent fallback to the tiny preset
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.slow
def test_script_prints_json_figures(tmp_path):
    _, figures = run_script("solutions.part2_lora", "--json", "--plot", "",
                            "--save", str(tmp_path / "adapter.safetensors"))
    assert {"reward_start", "reward_end", "trainable_params", "total_params", "seconds"} <= set(figures)
    assert figures["trainable_params"] < figures["total_params"] / 10
    assert (tmp_path / "adapter.safetensors").exists()


# --- mutants: the mistakes these tests catch ---------------------------------------------------------------

class _LoRARandomB(ref.LoRA):
    """Initialises B at random."""

    def __init__(self, d_in, d_out, rank=8, alpha=16.0):
        super().__init__(d_in, d_out, rank, alpha)
        nn.init.normal_(self.B, std=0.02)


class _LoRANoScale(ref.LoRA):
    """Leaves out the alpha / rank scaling."""

    def forward(self, x):
        return x @ self.A.T @ self.B.T


class _LoRAScaleAlpha(ref.LoRA):
    """Scales by alpha instead of alpha / rank."""

    def __init__(self, d_in, d_out, rank=8, alpha=16.0):
        super().__init__(d_in, d_out, rank, alpha)
        self.scale = alpha


class _LoRAZeroA(ref.LoRA):
    """Initialises A to zeros too (then B never gets a gradient)."""

    def __init__(self, d_in, d_out, rank=8, alpha=16.0):
        super().__init__(d_in, d_out, rank, alpha)
        nn.init.zeros_(self.A)


def _hooks_no_scale(model, adapters):
    """Applies A and B without the adapter's scale."""
    hooks = []
    for key, a in adapters.items():
        layer, target = key[1:].split("_", 1)
        in_name, out_name = (f"blocks.{layer}.{suffix}" for suffix in ref.TARGETS[target])
        stash = {}
        hooks += [(in_name, lambda x, hook, stash=stash: stash.update(x=x.flatten(-2) if x.dim() == 4 else x)),
                  (out_name, lambda o, hook, stash=stash, a=a: o + (stash.pop("x") @ a.A.T @ a.B.T).view(o.shape))]
    return hooks


def _hooks_added_permanently(model, adapters):
    """Adds the hooks to the model with add_hook as well as returning them."""
    hooks = ref.lora_hooks(model, adapters)
    for name, fn in hooks:
        model.add_hook(name, fn)
    return hooks


def _hooks_q_only(model, adapters):
    """Handles only the q adapters."""
    return ref.lora_hooks(model, nn.ModuleDict({k: v for k, v in adapters.items() if k.endswith("_q")}))


def _reference_with_hooks_on(lora_model, samples):
    """Computes the reference through the LoRA model."""
    lp = completion_logprobs(lora_model, samples)
    return lp, lp.clone()


def _reference_hooks_left_behind(lora_model, samples):
    """Adds the LoRA hooks with add_hook for the policy pass and never removes them."""
    for name, fn in ref.lora_hooks(lora_model.base, lora_model.adapters):
        lora_model.base.add_hook(name, fn)
    logprobs = completion_logprobs(lora_model.base, samples)
    return logprobs, completion_logprobs(lora_model.base, samples)


def _freeze_nothing(model, adapters):
    """Only switches the adapters on; the base stays trainable."""
    adapters.requires_grad_(True)
    return ref.count_parameters(adapters), ref.count_parameters(model)


def _freeze_adapters_too(model, adapters):
    """Freezes the base but forgets to make the adapters trainable."""
    model.requires_grad_(False)
    return ref.count_parameters(adapters), ref.count_parameters(model)


@torch.no_grad()
def _merge_no_transpose(model, adapters):
    """Adds B A to every weight as if all were [d_out, d_in] (GPT-2's Conv1D weights are [d_in, d_out])."""
    for key, a in adapters.items():
        weight, _ = ref.base_weight(model, key)
        delta = a.scale * (a.B @ a.A)
        weight += delta if delta.shape == weight.shape else delta.T


@torch.no_grad()
def _merge_no_scale(model, adapters):
    """Merges B A without the scale."""
    for key, a in adapters.items():
        weight, in_out = ref.base_weight(model, key)
        weight += (a.B @ a.A).T if in_out else a.B @ a.A


def _unmerge_adds_again(model, adapters):
    """Merges a second time instead of subtracting."""
    ref.merge_lora(model, adapters)


def _unmerge_noop(model, adapters):
    """Does nothing."""


def _save_with_pickle(adapters, path):
    """Uses torch.save (a pickle), not safetensors."""
    torch.save(adapters.state_dict(), str(path))


def _save_without_metadata(adapters, path):
    """Writes the tensors without rank and alpha."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in adapters.state_dict().items()}, str(path))


def _load_ignores_alpha(adapters, path):
    """Checks names and shapes but not the rank and alpha in the metadata."""
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    expected = {name: tuple(p.shape) for name, p in adapters.state_dict().items()}
    if expected != {name: tuple(t.shape) for name, t in tensors.items()}:
        raise ValueError("the file does not fit these adapters")
    adapters.load_state_dict(tensors)
    return adapters


def _load_without_checks(adapters, path):
    """Loads with strict=False and no shape check."""
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    adapters.load_state_dict({k: v for k, v in tensors.items() if k in adapters.state_dict()
                              and v.shape == adapters.state_dict()[k].shape}, strict=False)
    return adapters


MUTANTS = {
    "LoRA": [_LoRARandomB, _LoRANoScale, _LoRAScaleAlpha, _LoRAZeroA],
    "lora_hooks": [_hooks_no_scale, _hooks_added_permanently, _hooks_q_only],
    "policy_and_reference_logprobs": [_reference_with_hooks_on, _reference_hooks_left_behind],
    "freeze_base": [_freeze_nothing, _freeze_adapters_too],
    "merge_lora": [_merge_no_transpose, _merge_no_scale],
    "unmerge_lora": [_unmerge_adds_again, _unmerge_noop],
    "save_adapter": [_save_with_pickle, _save_without_metadata],
    "load_adapter": [_load_without_checks, _load_ignores_alpha],
}
