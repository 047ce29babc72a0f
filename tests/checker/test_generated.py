"""Inputs drawn from each exercise's contract (tests/generated.py): each kind of mistake that no fixed input shows is
caught and said with the smallest input that shows it; the references pass; every refusal the references write is
reached by the drawn inputs; the same examples are drawn on every run, and nothing is written to disk."""

import inspect
import os
import re
import textwrap
import ast
import types

import pytest
import torch

from solutions import part0_warmup, part1_ppo, part3_grpo

from tests.generated import (EXAMPLES, EXAMPLES_WITH_MODEL, compared_constants, drawable, on_generated_inputs,
                             uses_model)
from utils.checker import implementations, layout
from utils.checker.compare import CheckFailure
from utils.contracts import contract

pytestmark = pytest.mark.usefixtures("only_solutions")


@pytest.fixture
def only_solutions(request):
    if request.config.getoption("--impl") != "solutions":
        pytest.skip("the checker's own tests run with --impl solutions only")


def failure(part: str, fn) -> str:
    with pytest.raises(CheckFailure) as raised:
        on_generated_inputs(types.SimpleNamespace(**{fn.__name__: fn}), part, fn.__name__)
    return str(raised.value).split("\n")[0]


# --- the four kinds, each written here for an exercise of its own ---------------------------------------------------

def test_a_squeeze_that_drops_a_batch_of_one_is_caught_at_batch_one():
    @contract(**part0_warmup.get_logprobs.contract)
    def get_logprobs(logits, tokens, prefix_len=1):
        if not 1 <= prefix_len < tokens.shape[1]:
            raise ValueError(f"prefix_len must be in [1, seq), got {prefix_len}")
        logprobs = logits[:, prefix_len - 1:-1].log_softmax(dim=-1)
        return logprobs.gather(dim=-1, index=tokens[:, prefix_len:, None]).squeeze()  # squeezes batch 1 away too

    message = failure("part0_warmup", get_logprobs)
    assert "with batch = 1" in message and "expected (1, 1)" in message, message


def test_a_log_of_an_underflowed_probability_is_caught_where_logits_are_far_apart():
    @contract(**part1_ppo.entropy.contract)
    def entropy(logits, completion_mask):
        p = logits.softmax(-1)
        return -(p * p.log()).sum(dim=-1) * completion_mask  # 0 * log 0 = NaN where p underflows

    message = failure("part1_ppo", entropy)
    assert "underflow to 0 in float32" in message and ("NaN at" in message or "got NaN" in message), message


def test_a_sampler_that_draws_where_the_reference_is_greedy_is_said_with_its_values():
    """With top_k=1 the reference is greedy; a version whose top-k filter keeps the other tokens draws among them from
    torch's global random state. Each call is seeded alike, so the failing input fails again when replayed and the
    message gives the values (it had been hypothesis's "FlakyFailure" wrapper around them)."""
    relations, tensors, rules = part0_warmup.sample_next_token.contract_whole

    @contract(*relations, **tensors, **rules)
    def sample_next_token(logits, temperature=1.0, top_k=None):
        if temperature == 0:
            return logits.argmax(dim=-1)
        logits = logits / temperature
        if top_k is not None:
            kth = logits.topk(top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, 0.0)  # 0 is no exclusion
        return torch.multinomial(logits.softmax(dim=-1), num_samples=1).squeeze(-1)

    message = failure("part0_warmup", sample_next_token)
    assert "top_k=1" in message and "got 1, expected 0" in message and "Flaky" not in message, message


def test_a_version_whose_result_changes_from_call_to_call_is_said_so():
    """A failure that does not come back when the same input is run again is said as such, after what differed, and
    not as hypothesis's exception group."""
    calls = []

    @contract(**part1_ppo.normalize_rewards.contract)
    def normalize_rewards(rewards, eps=1e-5):
        calls.append(1)
        wrong = eps * 1000 if len(calls) <= 2 else 0.0  # its first calls are off, none after
        return (rewards - rewards.mean()) / (rewards.std(unbiased=False) + eps) + wrong

    with pytest.raises(CheckFailure) as raised:
        on_generated_inputs(types.SimpleNamespace(normalize_rewards=normalize_rewards), "part1_ppo",
                            "normalize_rewards")
    message = str(raised.value)
    assert "Run again on the same input, your code passed" in message and "Flaky" not in message, message


def test_every_value_a_setting_offers_is_tried_on_an_exercise_that_runs_the_model():
    """An exercise that runs the model draws 10 examples, and may miss a class of a setting; after them, the first
    example is replayed with each other value each setting's draw offers. Here even with a single drawn example, a
    version that is wrong only when beta is 1 is caught, at beta=1."""
    from solutions.part0_warmup import completion_logprobs

    @torch.no_grad()
    def reference_logprobs(lora_model, samples, beta):
        if beta == 0:
            return None
        logprobs = completion_logprobs(lora_model.base, samples)
        return logprobs * 2 if beta == 1 else logprobs  # wrong at one value of beta only

    with pytest.raises(CheckFailure) as raised:
        on_generated_inputs(types.SimpleNamespace(reference_logprobs=reference_logprobs), "part3_grpo",
                            "reference_logprobs", examples=1)
    assert "beta=1" in str(raised.value), raised.value


def test_a_float32_result_for_float64_inputs_is_caught():
    @contract(**part1_ppo.normalize_rewards.contract)
    def normalize_rewards(rewards, eps=1e-5):
        if not torch.isfinite(rewards).all():
            raise ValueError("rewards contain NaN or inf")
        out = torch.zeros(rewards.shape)  # float32 on the CPU, whatever the rewards are
        out[:] = (rewards - rewards.mean()) / (rewards.std(unbiased=False) + eps)
        return out

    message = failure("part1_ppo", normalize_rewards)
    assert "float64 inputs" in message and "your result is float32" in message, message


def test_a_result_built_in_float32_from_adapters_in_float64_is_caught():
    """Adapters (modules) are drawn in each dtype too: what the exercise builds from them follows their dtype."""
    from solutions import part7_production

    def fuse_qkv(adapters):
        A, B, scale = part7_production.fuse_qkv(adapters)
        return A, B.float(), scale  # as from B = torch.zeros(...): float32 on the CPU, whatever A's dtype

    message = failure("part7_production", fuse_qkv)
    assert "fuse_qkv(...)[1]: your result is float32, the reference's float64 (from float64 inputs)" in message, message


def test_a_refusal_skipped_on_one_path_is_caught():
    @contract(**part3_grpo.group_advantages.contract)
    def group_advantages(rewards, group_size, scale="group", eps=1e-4):
        # an unknown scale is taken for "group": the documented ValueError is raised on no path
        return part3_grpo.group_advantages(rewards, group_size, scale if scale in ("batch", "none") else "group", eps)

    message = failure("part3_grpo", group_advantages)
    assert "should raise a ValueError" in message and "scale=" in message, message


def test_a_right_answer_written_another_way_passes():
    @contract(**part1_ppo.entropy.contract)
    def entropy(logits, completion_mask):
        dist = torch.distributions.Categorical(logits=logits)
        return torch.where(completion_mask, dist.entropy(), torch.zeros((), dtype=logits.dtype))

    on_generated_inputs(types.SimpleNamespace(entropy=entropy), "part1_ppo", "entropy")


# --- the references, the reach of the drawn inputs, and their determinism ------------------------------------------

def _exercises():
    return [(part, name) for part in layout.parts() for name in drawable(part)]


def _raise_lines(function) -> tuple[object, set[int]]:
    code = inspect.unwrap(function).__code__
    source = textwrap.dedent(inspect.getsource(inspect.unwrap(function)))
    first = code.co_firstlineno
    lines = {first + node.lineno - 1 for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Raise)}
    return code, lines


# Refusals that the shape annotations make first: tensors whose dimensions share a name must agree (jaxtyping, at
# every call of the reference and of the learner's version alike), so the body's own shape check is a second line.
BEHIND_THE_ANNOTATIONS = {("part5_dpo_rloo", "dpo_loss"): 1, ("part6_lab", "bradley_terry_loss"): 1}


def _documents_none(function) -> bool:
    """Whether the reference's contract promises None for some input: its return annotation admits None, or the
    Returns: part of its docstring names None."""
    doc = inspect.getdoc(function) or ""
    returns = doc.split("Returns:", 1)[1].split("Raises:", 1)[0] if "Returns:" in doc else ""
    annotation = str(inspect.signature(inspect.unwrap(function)).return_annotation)
    return bool(re.search(r"\bNone (for|if|when|where)\b|\bor None\b", returns)) \
        or annotation.replace(" ", "").endswith("|None")


def _holds_none(result) -> bool:
    return result is None or (isinstance(result, (list, tuple)) and any(v is None for v in result))


def _refusing_exercises():
    """The drawn exercises whose reference raises in its own body or documents a None result (the others have no
    refusal and no None to reach)."""
    found = []
    for part, name in _exercises():
        reference = getattr(implementations.solutions_module(part), name)
        if _raise_lines(reference)[1] or _documents_none(reference):
            found.append((part, name))
    return found


@pytest.mark.parametrize("part, name", _refusing_exercises())
def test_the_drawn_inputs_reach_every_refusal_the_reference_writes(part, name):
    """Each `raise` in the reference's own body is reached by some input of the drawn space, and so is the None its
    contract documents: the refusals are tried on the paths the reference's branches lead to, not on a list kept by
    hand (but the first `raise` of the exercises whose shape check the annotations make first)."""
    reference = getattr(implementations.solutions_module(part), name)
    code, raises = _raise_lines(reference)
    raises = set(sorted(raises)[BEHIND_THE_ANNOTATIONS.get((part, name), 0):])
    reached: set[int] = set()
    nones = []

    def traced(*args, **kwargs):  # the reference, its refusals recorded: the learner's side of every comparison
        try:
            result = reference(*args, **kwargs)
            nones.append(_holds_none(result))
            return result
        except Exception as error:
            tb = error.__traceback__
            while tb is not None:  # the line of the reference's own body that raised (no tracing: read afterwards)
                if tb.tb_frame.f_code is code:
                    reached.add(tb.tb_lineno)
                tb = tb.tb_next
            raise

    # more examples than a check draws: the space drawn from holds inputs that reach every refusal (which of them a
    # run of 100 examples meets depends on hypothesis's choices, not only on this space); four times as many where
    # each example runs the embedded model
    examples = 4 * (EXAMPLES_WITH_MODEL if uses_model(part, name) else EXAMPLES)
    on_generated_inputs(types.SimpleNamespace(**{name: traced}), part, name, examples=examples)
    assert raises <= reached, f"{part}.{name}: no drawn input reaches the raise on line(s) {sorted(raises - reached)}"
    if _documents_none(reference):
        assert any(nones), f"{part}.{name}: no drawn input gets the None its contract documents"


def test_the_constants_a_reference_branches_on_are_read_from_its_source():
    assert compared_constants(part3_grpo.group_advantages)["scale"] == ["group", "batch", "none"]


def _written(folder) -> set[str]:
    return {str(p) for p in folder.rglob("*")} if folder.exists() else set()


def test_the_same_examples_every_run_and_nothing_written(tmp_path, monkeypatch):
    from hypothesis.configuration import storage_directory

    home = storage_directory(intent_to_write=False).path  # where hypothesis would write: the folder it started in
    before = _written(home)
    monkeypatch.chdir(tmp_path)
    seen = []

    @contract(**part1_ppo.kl_k1.contract)
    def kl_k1(logprobs, ref_logprobs, completion_mask):
        seen.append((tuple(logprobs.shape), logprobs.dtype, float(logprobs.double().sum())))
        return part1_ppo.kl_k1(logprobs, ref_logprobs, completion_mask)

    impl = types.SimpleNamespace(kl_k1=kl_k1)
    on_generated_inputs(impl, "part1_ppo", "kl_k1")
    first, seen[:] = list(seen), []
    on_generated_inputs(impl, "part1_ppo", "kl_k1")
    assert seen == first and len(first) > 10
    assert {shape[0] for shape, _, _ in first} >= {1} and {dtype for _, dtype, _ in first} >= {torch.float64}
    assert not os.listdir(tmp_path), os.listdir(tmp_path)  # no .hypothesis folder where the learner works
    assert _written(home) == before  # no example database, no cache of constants


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU here: the tensors are drawn on the CPU alone")
def test_a_result_built_on_the_cpu_for_inputs_on_the_gpu_is_caught():
    @contract(**part1_ppo.normalize_rewards.contract)
    def normalize_rewards(rewards, eps=1e-5):
        if not torch.isfinite(rewards).all():
            raise ValueError("rewards contain NaN or inf")
        out = torch.zeros(rewards.shape, dtype=rewards.dtype)  # on the CPU, wherever the rewards are
        out[:] = ((rewards - rewards.mean()) / (rewards.std(unbiased=False) + eps)).cpu()
        return out

    message = failure("part1_ppo", normalize_rewards)
    assert "inputs on cuda" in message and "on cpu" in message, message
