"""Value contracts (utils/contracts.py): every setting is refused where it enters when its value means nothing, with a
message that names it, says what it must be, and what it got; every loss refuses an empty batch and a NaN the same
way. Shapes are the jaxtyping annotations' job (tests/test_utils.py, bench/shape_checks.py)."""

from __future__ import annotations

import dataclasses
import inspect
import math
import importlib
import re

import pytest
import torch

from solutions import (part0_warmup, part1_ppo, part2_lora, part3_grpo, part4_reference, part5_dpo_rloo,
                       part6_lab)
from utils.checker import layout
from utils import contracts
from utils.contracts import Rule, above, at_least, between, check_fields, contract, one_of, optional

MODULES = tuple(importlib.import_module(f"solutions.{part}") for part in layout.parts())  # every part, new ones too


# --- The rules themselves ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("rule, good, bad", [
    (at_least(0), [0, 3], [-1, 2.5, True, "3", None]),               # a whole number: not a float, not a bool
    (at_least(0.0), [0, 0.0, 1e9], [-1e-9, math.nan, False, "0"]),   # any number, NaN never
    (above(0.0), [1e-12, 5], [0.0, -1, math.nan]),
    (between(0.0, 1.0), [0.0, 0.5, 1], [-0.1, 1.01, math.nan]),
    (between(0.0, 1.0, low_open=True), [1e-9, 1.0], [0.0, 1.5]),
    (one_of("a", "b"), ["a", "b"], ["c", None]),
    (optional(at_least(1)), [None, 1, 7], [0, -3]),
])
def test_a_rule_allows_what_it_says_and_nothing_else(rule, good, bad):
    for value in good:
        rule.check("x", value)
    for value in bad:
        with pytest.raises(ValueError, match=r"^f: x must be "):
            rule.check("x", value, where="f: ")


def test_a_refusal_says_the_name_the_rule_the_reason_and_the_value():
    with pytest.raises(ValueError) as error:
        at_least(2, "a group of one has nothing to compare with").check("group_size", 1, where="GRPOConfig: ")
    assert str(error.value) == ("GRPOConfig: group_size must be a whole number >= 2 (a group of one has nothing to "
                                "compare with), got 1")


def test_rules_naming_a_field_that_does_not_exist_are_refused():
    @dataclasses.dataclass
    class Config:
        steps: int = 1

    with pytest.raises(TypeError, match="stpes"):
        check_fields(Config(), {"stpes": at_least(0)})


def test_a_contract_naming_an_argument_that_does_not_exist_is_refused():
    with pytest.raises(TypeError, match="epsilonn"):
        @contract(epsilonn=at_least(0.0))
        def loss(x, epsilon=0.2):
            return x


def test_a_contract_keeps_the_signature_and_lets_a_wrong_call_fail_as_python_says():
    @contract(epsilon=at_least(0.0))
    def loss(x, epsilon=0.2):
        """doc"""
        return x * epsilon

    assert list(inspect.signature(loss).parameters) == ["x", "epsilon"] and loss.__doc__ == "doc"
    assert loss(2.0) == 0.4 and loss(2.0, epsilon=0.5) == 1.0
    with pytest.raises(TypeError):
        loss(2.0, nope=1)


# --- Named rules: shared settings, each reason written once -------------------------------------------------------

NAMED_RULES = {name: rule for name in contracts.__all__ if isinstance(rule := getattr(contracts, name), Rule)}
NAMED_BAD = {"TEMPERATURE": [-0.1, math.nan], "TOP_K": [0, 2.5], "STEPS": [-1, 1.5], "PHASES": [-1], "SEEDS": [0],
             "LORA_ALPHA": [0.0, -8.0], "GROUP_SIZE": [1, 0, 2.0], "KL_WEIGHT": [-0.01], "PPO_CLIP_RANGE": [-0.2],
             "CLIP_RANGE": [-0.2, math.nan], "SYNC_ALPHA": [0.0, 1.5], "DPO_BETA": [0.0, -0.1], "GAMMA": [1.1, -0.1],
             "LAM": [1.5, math.nan], "VF_COEF": [-0.5], "ENT_COEF": [-0.01]}


def test_each_named_rule_refuses_a_bad_value_and_gives_its_reason():
    assert set(NAMED_BAD) == set(NAMED_RULES), "a named rule of utils/contracts.py has no bad value tried here"
    for name, values in NAMED_BAD.items():
        rule = NAMED_RULES[name]
        assert rule.why, f"{name} gives no reason"
        for value in values:
            with pytest.raises(ValueError, match=re.escape(f"({rule.why}), got {value!r}")):
                rule.check("x", value)


def test_the_named_relations_and_factories_refuse_with_their_reasons():
    mask = torch.ones(2, 4, dtype=torch.bool)
    assert "one prompt per completion" in contracts.ONE_PROMPT_PER_COMPLETION({"prompts": ["a"], "completions": []})
    assert contracts.ONE_PROMPT_PER_COMPLETION({"prompts": ["a"], "completions": ["b"]}) is None
    assert "completions' width" in contracts.DR_GRPO_LENGTH({"max_completion_length": 3, "mask": mask})
    assert contracts.DR_GRPO_LENGTH({"max_completion_length": None, "mask": mask}) is None
    with pytest.raises(ValueError, match=re.escape("clip must be None or a number >= 0 (each value moves at most clip "
                                                   "from its old value), got -0.1")):
        contracts.value_clip("clip").check("clip", -0.1)
    assert contracts.needs_old_values("clip")({"clip": 0.2, "old_values": None}) == (
        "clip=0.2 needs old_values: the values stored at rollout time, to clip around")


# where each rule factory (and each of utils/cli.py's argparse types) takes its reason: the index of the argument
REASON_AT = {"at_least": 1, "above": 1, "at_most": 1, "between": 2, "a_number": 0, "not_a_folder": 0, "nonempty": 0,
             "same_length": 2, "covers_width": 2, "at_most_size": 3, "needs": 2}


def _reasons() -> dict[str, list[str]]:
    """Each reason written in solutions/ or utils/contracts.py -> where (file:line), one entry per time written."""
    import ast

    found: dict[str, list[str]] = {}
    for path in sorted(layout.SOLUTIONS.rglob("*.py")) + [layout.ROOT / "utils" / "contracts.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "attr", getattr(node.func, "id", None))
            if name not in REASON_AT:
                continue
            args = node.args[REASON_AT[name]:REASON_AT[name] + 1] + [k.value for k in node.keywords if k.arg == "why"]
            for arg in args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value:
                    found.setdefault(arg.value, []).append(f"{path.relative_to(layout.ROOT)}:{node.lineno}")
    return found


def test_no_reason_is_written_twice():
    reasons = _reasons()
    assert "0 only evaluates the starting model" in reasons  # the scan finds them
    repeated = {text: where for text, where in reasons.items() if len(where) > 1}
    assert not repeated, ("the same reason is written more than once: name the rule once in utils/contracts.py "
                          f"(a script's flag takes its .why) and use the name: {repeated}")


# --- Configs: each setting checked when the config is made (or replaced) ---------------------------------------

CONFIG_CASES = [
    (part1_ppo.PPOConfig, {
        "reward": ["nope"], "prompts": [()], "phases": [-1], "batch_size": [0], "minibatch_size": [0], "epochs": [0],
        "max_new_tokens": [0, -5], "temperature": [-0.5], "lr_model": [-1e-4], "lr_head": [-1e-3],
        "warmup_steps": [-1], "final_lr_fraction": [1.5, -0.1], "clip_eps": [-0.2], "vf_coef": [-0.5],
        "ent_coef": [-0.01], "kl_coef": [-0.1], "gamma": [1.1, -0.1], "lam": [1.5], "max_grad_norm": [0.0, -1.0],
        "value_hidden": [0], "table_every": [0], "table_rows": [-1], "clip_value": [-0.2]}),
    (part3_grpo.GRPOConfig, {
        "task": ["subtraction"], "steps": [-1], "n_prompts": [0, 10**6], "group_size": [1, 0, -4],
        "max_new_tokens": [0],
        "temperature": [-1.0], "lr": [0.0, -3e-3], "lora_rank": [0], "lora_alpha": [0.0, -8.0], "beta": [-0.04],
        "epsilon": [-0.2], "epsilon_high": [-0.28], "loss_type": ["ppo"], "scale_rewards": ["batchwise"],
        "num_iterations": [0], "format_weight": [-0.1], "max_grad_norm": [0.0], "eval_every": [-10],
        "table_every": [0]}),
    (part5_dpo_rloo.RLOOConfig, {"group_size": [1], "beta": [-0.05], "epsilon": [-0.2], "steps": [-3]}),
    (part5_dpo_rloo.DPOConfig, {
        "steps": [-1], "n_pairs": [0, 10**6], "batch_pairs": [0], "rejected": ["random"], "lr": [0.0], "lora_rank": [0],
        "lora_alpha": [0.0], "beta": [0.0, -0.1], "loss_type": ["kto"], "reference": ["cached"],
        "sft_weight": [-1.0], "max_grad_norm": [0.0], "eval_every": [-1]}),
    (part4_reference.ReferenceSettings, {"sync_every": [-5], "beta": [math.nan], "sync_alpha": [math.nan]}),
]


def make(config_class, **settings):
    required = {"beta": 0.1} if config_class is part4_reference.ReferenceSettings else {}
    return config_class(**(required | settings))


@pytest.mark.parametrize("config_class, bad", CONFIG_CASES, ids=[c.__name__ for c, _ in CONFIG_CASES])
def test_each_config_refuses_each_meaningless_setting_by_name(config_class, bad):
    good = make(config_class)  # the defaults pass
    for field, values in bad.items():
        for value in values:
            message = rf"{config_class.__name__}.*\b{field} must be .*got {re.escape(repr(value))}"
            with pytest.raises(ValueError, match=message):
                make(config_class, **{field: value})
            with pytest.raises(ValueError, match=rf"\b{field} must be"):  # replace() re-checks
                dataclasses.replace(good, **{field: value})


@pytest.mark.parametrize("config_class, bad", CONFIG_CASES, ids=[c.__name__ for c, _ in CONFIG_CASES])
def test_every_rule_of_a_config_is_tested_here(config_class, bad):
    rules = set(config_class.RULES)
    assert set(bad) <= rules, f"{config_class.__name__} has no rule for {sorted(set(bad) - rules)}"
    if "RULES" in vars(config_class):  # its own rules (RLOOConfig inherits GRPOConfig's, tested above)
        assert rules <= set(bad), f"no bad value is tried here for {config_class.__name__}'s {sorted(rules - set(bad))}"


def test_the_presets_and_the_scripts_defaults_pass_their_own_contracts():
    part1_ppo.PPOConfig.gpt2(), part3_grpo.GRPOConfig.gpt2(), part5_dpo_rloo.RLOOConfig(), part5_dpo_rloo.DPOConfig()


def test_ppo_batch_must_split_into_whole_minibatches():
    with pytest.raises(ValueError, match="batch_size \\(60\\) must be a multiple of minibatch_size \\(16\\)"):
        part1_ppo.PPOConfig(batch_size=60)


# --- Losses: an empty batch or a NaN is refused, the same way in every one ----------------------------------------

def _ppo_inputs(batch=3, gen=4, vocab=7):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return dict(logits=r(batch, gen, vocab), values=r(batch, gen), logprobs=-r(batch, gen).abs(),
                old_logprobs=-r(batch, gen).abs(), advantages=r(batch, gen), returns=r(batch, gen),
                ref_logits=r(batch, gen, vocab), completion_mask=torch.ones(batch, gen, dtype=torch.bool))


def _loss_calls(batch=3):
    """Each loss, with valid inputs of `batch` rows: (name, function, keyword arguments)."""
    p = _ppo_inputs(batch)
    lp, old, mask, adv = p["logprobs"], p["old_logprobs"], p["completion_mask"], p["advantages"][:, 0]
    seq = lp.sum(1)
    return [
        ("value_loss", part1_ppo.value_loss, dict(values=p["values"], returns=p["returns"], completion_mask=mask)),
        ("clipped_surrogate", part1_ppo.clipped_surrogate,
         dict(logprobs=lp, old_logprobs=old, advantages=p["advantages"], completion_mask=mask)),
        ("ppo_loss", part1_ppo.ppo_loss, p),
        ("grpo_loss", part3_grpo.grpo_loss, dict(logprobs=lp, old_logprobs=old, ref_logprobs=old, advantages=adv,
                                                  mask=mask, beta=0.04)),
        ("dpo_loss", part5_dpo_rloo.dpo_loss, dict(policy_chosen_logps=seq, policy_rejected_logps=seq - 1,
                                                    ref_chosen_logps=seq + 0.5, ref_rejected_logps=seq)),
        ("rloo_loss", part5_dpo_rloo.rloo_loss, dict(seq_logprobs=seq, old_seq_logprobs=seq.detach() + 0.1,
                                                      advantages=adv)),
        ("bradley_terry_loss", part6_lab.bradley_terry_loss, dict(chosen_scores=seq, rejected_scores=seq - 1)),
        ("tis_grpo_loss", part6_lab.tis_grpo_loss, dict(logprobs=lp, old_logprobs=old, advantages=adv, mask=mask,
                                                        weights=torch.ones_like(lp))),
    ]


def test_every_loss_of_the_course_has_the_loss_contract():
    losses = {name for module in MODULES for name, obj in vars(module).items()
              if name.endswith("_loss") and inspect.isfunction(obj) and obj.__module__ == module.__name__}
    missing = losses - {name for name, _, _ in _loss_calls()}
    assert not missing, f"{sorted(missing)} missing from _loss_calls: add them"
    for name, fn, _ in _loss_calls():
        assert getattr(fn, "contract_tensors", None) == "loss", f"{name} lacks @contract(tensors='loss')"


@pytest.mark.parametrize("name, fn, kwargs", _loss_calls(), ids=[n for n, _, _ in _loss_calls()])
def test_a_loss_refuses_an_empty_batch_and_a_nan_naming_the_argument(name, fn, kwargs):
    assert torch.isfinite(fn(**kwargs) if name != "ppo_loss" else fn(**kwargs)[0])  # valid inputs: a finite loss
    empty = dict(next(c for c in _loss_calls(batch=0) if c[0] == name)[2])
    with pytest.raises(ValueError, match="empty batch"):
        fn(**empty)
    for arg, value in kwargs.items():
        if not (isinstance(value, torch.Tensor) and value.is_floating_point()):
            continue
        poisoned = value.clone()
        poisoned.view(-1)[-1] = float("nan")
        with pytest.raises(ValueError, match=rf"{name}: {arg} contains NaN"):
            fn(**(kwargs | {arg: poisoned}))


# --- Settings of functions: each bound, where it enters -----------------------------------------------------------

def _bound_cases():
    p = _ppo_inputs()
    lp, old, mask, adv = p["logprobs"], p["old_logprobs"], p["completion_mask"], p["advantages"][:, 0]
    seq = lp.sum(1)
    grpo = dict(logprobs=lp, old_logprobs=old, ref_logprobs=old, advantages=adv, mask=mask)
    surrogate = dict(logprobs=lp, old_logprobs=old, advantages=p["advantages"], completion_mask=mask)
    rewards = torch.tensor([0.0, 1.0, 1.0, 0.5])
    return [
        (part0_warmup.sample_next_token, dict(logits=p["logits"][:, 0]),
         dict(temperature=[-1.0, math.nan], top_k=[0, -2, 8])),  # the vocabulary here has 7 tokens
        (part1_ppo.normalize_rewards, dict(rewards=rewards), dict(eps=[0.0, -1e-5])),
        (part1_ppo.compute_advantages, dict(values=p["values"], rewards=rewards[:3], completion_mask=mask),
         dict(gamma=[1.5, -0.1], lam=[2.0, -1.0])),
        (part1_ppo.clipped_surrogate, surrogate, dict(clip_eps=[-0.2])),
        (part1_ppo.ppo_loss, p, dict(clip_eps=[-0.1], vf_coef=[-1.0], ent_coef=[-0.1], kl_coef=[-0.2],
                                     clip_value=[-0.1])),
        (part1_ppo.value_loss, dict(values=p["values"], returns=p["returns"], completion_mask=mask,
                                    old_values=p["values"]), dict(clip=[-0.2])),
        (part1_ppo.get_minibatch_indices, dict(n=8, minibatch_size=4), dict(minibatch_size=[0, -4])),
        (part3_grpo.group_advantages, dict(rewards=rewards, group_size=2), dict(group_size=[0, 1, -2], eps=[-1e-4])),
        (part3_grpo.grpo_loss, grpo, dict(epsilon=[-0.2], epsilon_high=[-0.1], beta=[-0.04],
                                           max_completion_length=[0, -5, 3])),  # 3 < the mask's 4 columns
        (part5_dpo_rloo.dpo_loss, dict(policy_chosen_logps=seq, policy_rejected_logps=seq, ref_chosen_logps=seq,
                                       ref_rejected_logps=seq), dict(beta=[0.0, -0.1])),
        (part5_dpo_rloo.kl_penalized_rewards, dict(rewards=rewards[:3], logprobs=lp, ref_logprobs=old, mask=mask,
                                                   beta=0.1), dict(beta=[-0.1])),
        (part5_dpo_rloo.rloo_loss, dict(seq_logprobs=seq, old_seq_logprobs=None, advantages=adv),
         dict(epsilon=[-0.2], epsilon_high=[-0.2])),
    ]


@pytest.mark.parametrize("fn, valid, bad", _bound_cases(), ids=[f.__name__ for f, _, _ in _bound_cases()])
def test_a_function_refuses_a_meaningless_setting_by_name(fn, valid, bad):
    fn(**valid)  # the valid call works
    for arg, values in bad.items():
        for value in values:
            with pytest.raises(ValueError, match=rf"^{fn.__name__}: {arg}"):
                fn(**(valid | {arg: value}))


def test_grpo_loss_accepts_a_max_completion_length_beyond_the_widest_completion():
    p = _ppo_inputs()
    args = dict(logprobs=p["logprobs"], old_logprobs=None, ref_logprobs=None, advantages=p["advantages"][:, 0],
                mask=p["completion_mask"], loss_type="dr_grpo")
    assert torch.isclose(part3_grpo.grpo_loss(**args, max_completion_length=8) * 2,
                         part3_grpo.grpo_loss(**args, max_completion_length=4))


def test_adapters_refuse_a_rank_or_alpha_that_switches_them_off(tiny_model):
    for bad in (dict(rank=0), dict(alpha=0.0), dict(alpha=-16.0)):
        with pytest.raises(ValueError, match="make_adapters: (rank|alpha) must be"):
            part2_lora.make_adapters(tiny_model, **bad)


def test_syncs_refuse_an_alpha_outside_zero_to_one():
    policy, reference = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    for alpha in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="sync_full: alpha must be in \\(0, 1\\]"):
            part4_reference.sync_full(policy, reference, alpha)


# --- Inputs that would give a silent wrong number or a raw internal error ---------------------------------------

def _refusals(model):
    """(what, call, words the message must hold): each call must raise a ValueError whose message holds them."""
    logits, tokens = torch.randn(2, 5, 7), torch.zeros(2, 5, dtype=torch.long)
    lp, mask = -torch.rand(2, 5), torch.ones(2, 5, dtype=torch.bool)
    nan_logits = logits.clone()
    nan_logits[1, 2, 3] = math.nan
    reward = part3_grpo.RewardFunction("r", lambda prompts, completions: [1.0] * len(completions))
    lora = part2_lora.LoRA(128, 128, 2, 4.0)
    return [
        ("token ids past the vocabulary", lambda: part0_warmup.get_logprobs(logits, tokens + 9), "vocabulary of 7"),
        ("a negative token id", lambda: part0_warmup.get_logprobs(logits, tokens - 1), "ids from -1"),
        ("NaN logits", lambda: part0_warmup.get_logprobs(nan_logits, tokens), "logits contains NaN"),
        ("NaN logits to sample from", lambda: part0_warmup.sample_next_token(nan_logits[:, 2]), "contains NaN"),
        ("a row of logits all masked out", lambda: part0_warmup.sample_next_token(
            torch.tensor([[0.0, 1.0], [-math.inf, -math.inf]])), "no finite value in row [1]"),
        ("a layer the model lacks", lambda: part0_warmup.steered_logprobs(model, tokens, 9, torch.ones(128), 1.0),
         "layer=9 is not a block"),
        ("a direction of the wrong width", lambda: part0_warmup.steered_logprobs(model, tokens, 0, torch.ones(64), 1.0),
         "d_model = 128"),
        ("generating past the context", lambda: part0_warmup.generate_no_cache(model, tokens, 10_000), "context of"),
        ("a NaN reward into GAE", lambda: part1_ppo.compute_advantages(torch.zeros(2, 5), torch.tensor([1.0, math.nan]),
                                                                        mask), "rewards contains NaN"),
        ("NaN log-probs into k3", lambda: part1_ppo.kl_k3(lp.log(), lp, mask), "contains NaN"),
        ("an empty character to count", lambda: part1_ppo.reward_char_count(["a.b"], char=""), "char must be"),
        ("no samples to split", lambda: part1_ppo.get_minibatch_indices(0, 4), "n must be"),
        ("a LoRA of rank 0", lambda: part2_lora.LoRA(8, 8, rank=0), "rank must be"),
        ("adapters with no target", lambda: part2_lora.make_adapters(model, 2, 4.0, ()), "targets must be"),
        ("an adapter key naming no weight", lambda: part2_lora.LoRAModel(model, torch.nn.ModuleDict({"L9_q": lora})),
         "names no weight"),
        ("merging an adapter the model lacks",
         lambda: part2_lora.merge_lora(model, torch.nn.ModuleDict({"L0_qq": lora})), "names no weight"),
        ("fewer completions than prompts", lambda: part3_grpo.reward_exact_answer(["1+1=", "2+2="], ["2"]),
         "2 prompts but 1 completions"),
        ("no reward function", lambda: part3_grpo.compose_rewards([], ["a"], ["b"]), "reward_functions must be"),
        ("two reward functions of one name", lambda: part3_grpo.compose_rewards([reward, reward], ["a"], ["b"]),
         "share the names ['r']"),
        ("a value clip with nothing to clip around",
         lambda: part1_ppo.value_loss(lp, lp, mask, clip=0.2), "clip=0.2 needs old_values"),
        ("a value clip in the PPO loss with nothing to clip around",
         lambda: part1_ppo.ppo_loss(**_ppo_inputs(), clip_value=0.2), "clip_value=0.2 needs old_values"),
        ("a NaN weight", lambda: part3_grpo.RewardFunction("r", print, weight=math.nan), "weight must be"),
        ("a NaN temperature", lambda: part3_grpo.sample_groups(model, ["1+1="], 2, 3, temperature=math.nan),
         "temperature must be"),
    ]


def test_bad_inputs_get_a_clear_error_that_names_what_is_wrong(tiny_model):
    for what, call, words in _refusals(tiny_model):
        with pytest.raises(ValueError, match=re.escape(words)):  # not a raw internal error: it says what is wrong
            call()


def test_saving_an_adapter_onto_a_folder_says_to_name_the_file(tmp_path, tiny_model):
    adapters = part2_lora.make_adapters(tiny_model, 2, 4.0, ("q",))
    with pytest.raises(ValueError, match="name it inside the folder"):
        part2_lora.save_adapter(adapters, tmp_path)


def test_the_shared_helpers_refuse_what_would_be_silently_wrong(tiny_model):
    from utils.data import addition_accuracy
    from utils.masks import masked_mean

    with pytest.raises(ValueError, match="must be the same"):  # a [B, 1] x would broadcast over the mask
        masked_mean(torch.ones(3, 1), torch.ones(3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="at least one"):
        addition_accuracy(tiny_model, [])


# --- Shapes: every annotated tensor argument of every public function is checked at the call --------------------

SIZES = {"batch": 3, "gen": 4, "seq": 6, "pos": 6, "vocab": 7, "d_model": 128, "n": 5, "total": 8, "minibatch": 2}
SETTINGS = {"group_size": 3, "beta": 0.1, "scale": 1.0}  # required settings that are not tensors, at valid values


def _annotated_functions():
    """(qualified name, function, {parameter: jaxtyping annotation}) for each public function of solutions/ whose
    required parameters are all tensors with a shape annotation (so that valid inputs can be made from it)."""
    import typing

    found = []
    for module in MODULES:
        for name, fn in vars(module).items():
            if name.startswith("_") or not inspect.isfunction(fn) or fn.__module__ != module.__name__:
                continue
            hints = typing.get_type_hints(inspect.unwrap(fn))
            shapes = {}
            for param in inspect.signature(fn).parameters.values():
                hint = hints.get(param.name)
                options = [h for h in (typing.get_args(hint) or (hint,)) if hasattr(h, "dims")]
                if options:
                    shapes[param.name] = options[0]
                elif param.default is inspect.Parameter.empty and param.name not in SETTINGS:
                    break  # a model, samples, ...: no valid input to make from annotations alone
            else:
                if shapes:
                    found.append((f"{module.__name__.split('.')[-1]}.{name}", fn, shapes))
    return found


def _tensor_for(annotation, sizes: dict, generator: torch.Generator) -> torch.Tensor:
    shape = [sizes.get(getattr(d, "name", None), 2) for d in annotation.dims if hasattr(d, "name")]
    if "bool" in annotation.dtypes:
        return torch.ones(shape, dtype=torch.bool)
    if "int64" in annotation.dtypes and "float32" not in annotation.dtypes:
        return torch.randint(0, 2, shape, generator=generator)
    return -torch.rand(shape, generator=generator)  # log-prob-like: finite, negative


ANNOTATED = _annotated_functions()


def test_the_shape_contract_survey_covers_the_losses():
    names = {name for name, _, _ in ANNOTATED}
    assert {"part3_grpo.grpo_loss", "part5_dpo_rloo.dpo_loss", "part5_dpo_rloo.rloo_loss", "part1_ppo.ppo_loss",
            "part1_ppo.compute_advantages", "part0_warmup.get_logprobs", "part3_grpo.group_advantages"} <= names


@pytest.mark.parametrize("name, fn, shapes", ANNOTATED, ids=[n for n, _, _ in ANNOTATED])
def test_a_wrong_shape_is_refused_at_the_call_naming_the_argument(name, fn, shapes):
    from jaxtyping import TypeCheckError

    generator = torch.Generator().manual_seed(0)
    settings = {p.name: SETTINGS[p.name] for p in inspect.signature(fn).parameters.values()
                if p.name in SETTINGS and p.default is inspect.Parameter.empty}
    valid = {p: _tensor_for(a, SIZES, generator) for p, a in shapes.items()}
    try:
        fn(**valid, **settings)
    except TypeCheckError as e:  # pragma: no cover - the survey made inputs that do not fit
        pytest.fail(f"{name}: inputs made from the annotations were refused: {e}")
    except (ValueError, RuntimeError):
        pass  # a value contract (e.g. group_size); the shapes passed
    for param, annotation in shapes.items():
        named = [d.name for d in annotation.dims if hasattr(d, "name")]
        others = {d.name for p, a in shapes.items() if p != param for d in a.dims if hasattr(d, "name")}
        shared = [d for d in named if d in others]
        wrong = [valid[param][..., None] if named else valid[param][None]]  # one dimension too many
        if shared:  # a dimension it shares with another argument one too long: they no longer agree
            wrong.append(_tensor_for(annotation, SIZES | {shared[-1]: SIZES.get(shared[-1], 2) + 1}, generator))
        for tensor in wrong:
            with pytest.raises(TypeCheckError, match=rf"parameter '{param}'|{param}"):
                fn(**(valid | {param: tensor}), **settings)


def test_shapes_are_checked_outside_the_tests_too():
    """In a script (no pytest, no conftest), advantages of shape [B, 1] are refused by name, not broadcast."""
    import subprocess
    import sys

    from utils.checker.layout import ROOT

    code = ("import torch\nfrom solutions.part3_grpo import grpo_loss\n"
            "lp, mask = torch.zeros(4, 5), torch.ones(4, 5, dtype=torch.bool)\n"
            "grpo_loss(lp, None, None, torch.ones(4, 1), mask)\n")
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("RLHF_SHAPE")}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env)
    assert result.returncode != 0 and "advantages" in result.stderr and "TypeCheckError" in result.stderr, \
        result.stderr[-2000:]
