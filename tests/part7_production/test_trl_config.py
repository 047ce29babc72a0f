"""The knob table (solutions/production/knobs.py) covers our GRPOConfig and Part 4's ReferenceSettings, and the
exercise to_trl_config translates it into trl.GRPOConfig's arguments as the reference does (no TRL needed:
test_against_trl.py gives them to TRL)."""

import dataclasses

import pytest

from solutions import part7_production as ref
from solutions.part3_grpo import GRPOConfig
from solutions.part4_reference import ReferenceSettings
from solutions.production import knobs
from tests.support import assert_equal, assert_inputs_unchanged, assert_raises, each_refusal, exercise, expect


def test_knob_table_has_a_row_for_every_field_of_our_config():
    ours = [f.name for f in dataclasses.fields(GRPOConfig)]
    assert_equal(sorted(knobs.GRPO_TO_TRL), sorted(ours), "the fields of GRPOConfig in knobs.GRPO_TO_TRL",
                 hint="a new GRPOConfig field needs its row: its trl.GRPOConfig name, or None and why")
    for name, knob in knobs.GRPO_TO_TRL.items():
        expect(bool(knob.how.strip()), f"GRPO_TO_TRL[{name!r}].how", "says nothing")
        expect(knob.trl is not None or knob.how, f"GRPO_TO_TRL[{name!r}]", "has neither a TRL name nor a reason")


def test_knob_table_has_a_row_for_every_reference_setting():
    ours = [f.name for f in dataclasses.fields(ReferenceSettings)]
    assert_equal(sorted(knobs.REFERENCE_TO_TRL), sorted(ours), "the fields of ReferenceSettings in "
                 "knobs.REFERENCE_TO_TRL", hint="a new ReferenceSettings field needs its row")
    for name, knob in knobs.REFERENCE_TO_TRL.items():
        expect(bool(knob.how.strip()), f"REFERENCE_TO_TRL[{name!r}].how", "says nothing")


def test_reference_to_trl_maps_part4s_syncs():
    """Part 4's settings as TRL's: no sync (static, or beta 0), a full fine-tuning sync (TRL counts optimizer steps),
    and the refusals of what TRL 1.16 cannot do (a synced LoRA reference, a precomputed one)."""
    cases = {
        "static LoRA reference": (ReferenceSettings(beta=0.04), 1, {"beta": 0.04, "sync_ref_model": False}),
        "beta 0 (nothing to sync)": (ReferenceSettings(beta=0.0, sync_every=10, sync_alpha=1.0, lora=False), 1,
                                     {"beta": 0.0, "sync_ref_model": False}),
        "full fine-tuning, tau 10, alpha 0.5, 2 iterations": (
            ReferenceSettings(beta=0.1, lora=False, sync_every=10, sync_alpha=0.5), 2,
            {"beta": 0.1, "sync_ref_model": True, "ref_model_sync_steps": 20, "ref_model_mixup_alpha": 0.5}),
    }
    for label, (settings, iterations, expected) in cases.items():
        assert_equal(knobs.reference_to_trl(settings, iterations), expected, f"reference_to_trl({label})")
    for label, settings in (("a merge-synced LoRA", ReferenceSettings(beta=0.04, sync_every=10, sync_alpha=1.0)),
                            ("a reference-only synced LoRA", ReferenceSettings(beta=0.04, sync_every=10,
                                                                               sync_alpha=1.0,
                                                                               lora_sync="reference_only")),
                            ("a precomputed reference", ReferenceSettings(beta=0.04, precomputed=True))):
        with pytest.raises(ValueError):
            knobs.reference_to_trl(settings)


TRL_CONFIGS = {  # what each config shows: the defaults, then the knobs whose translation is not a copy
    "the defaults": (GRPOConfig(), 1),
    "4 processes": (GRPOConfig(), 4),
    "num_iterations=2, epsilon_high, beta, on cpu": (GRPOConfig(num_iterations=2, epsilon_high=0.28, beta=0.04,
                                                                device="cpu"), 1),
    "the periods task, wandb, on cuda, 2 processes": (GRPOConfig(task="periods", wandb=True, device="cuda",
                                                                 n_prompts=8, lr=3e-4), 2),
    "other numbers everywhere": (GRPOConfig(steps=7, n_prompts=6, group_size=4, max_new_tokens=9, temperature=0.7,
                                            lr=1e-4, epsilon=0.1, loss_type="grpo", scale_rewards="batch",
                                            mask_truncated_completions=True, format_weight=0.3, max_grad_norm=0.5,
                                            seed=3), 3),
}
# A group split between processes: the completions of a step divide among them, its prompts do not. Not among
# TRL_CONFIGS, which test_against_trl.py builds in one process, where TRL asks for whole groups.
SPLIT_GROUPS = {"3 prompts on 2 processes (a group split between them)": (GRPOConfig(n_prompts=3, group_size=4), 2)}

TRL_CONFIG_HINT = ("see the table knobs.GRPO_TO_TRL: TRL counts optimizer steps (steps × num_iterations) and "
                   "completions per process (n_prompts × group_size / world_size)")


@exercise("to_trl_config")
def test_to_trl_config_matches_reference(impl, tmp_path):
    for label, (cfg, world_size) in {**TRL_CONFIGS, **SPLIT_GROUPS}.items():
        what = f"to_trl_config({label}, world_size={world_size})"
        out = impl.to_trl_config(dataclasses.replace(cfg), str(tmp_path), world_size)
        expected = ref.to_trl_config(cfg, str(tmp_path), world_size)
        expect(isinstance(out, dict), what, f"should return a dict of trl.GRPOConfig's arguments, got {type(out)}")
        assert_equal(sorted(set(expected) - set(out)), [], f"{what}: the keys missing",
                     hint="every translated knob, every setting of TRL_SETTINGS and output_dir")
        assert_equal(sorted(set(out) - set(expected)), [], f"{what}: keys the reference does not set")
        for key, value in expected.items():
            assert_equal(out[key], value, f"{what}[{key!r}]", hint=TRL_CONFIG_HINT)


@exercise("to_trl_config")
def test_to_trl_config_refuses_an_uneven_split(impl, tmp_path):
    with each_refusal():
        for world_size in (3, 5):
            assert_raises(ValueError, impl.to_trl_config, GRPOConfig(), str(tmp_path), world_size,
                          what=f"to_trl_config(the defaults, world_size={world_size})",
                          why=f"128 completions a step cannot be shared equally by {world_size} processes")


@exercise("to_trl_config")
def test_to_trl_config_leaves_the_config_alone(impl, tmp_path):
    cfg = GRPOConfig(num_iterations=3, n_prompts=8)
    assert_inputs_unchanged(impl.to_trl_config, cfg, str(tmp_path), 2, what="to_trl_config(num_iterations=3)")


def test_to_trl_config_contract_refuses_no_process(tmp_path):
    for world_size in (0, -2):
        with pytest.raises(ValueError, match=r"^to_trl_config: world_size"):
            ref.to_trl_config(GRPOConfig(), str(tmp_path), world_size)
