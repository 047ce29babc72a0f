"""Against the installed TRL (written against trl 1.16): the knob table names its settings, trl.GRPOConfig takes
to_trl_config's arguments and then holds our values (defaults and all), TRL's own loss on that config equals our
trainer's, TRL's reference sync is Part 4's, the chapter names only real settings and flags, and the TRL run trains."""

import dataclasses
import json
import os
import re
import subprocess
import sys
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from solutions import part7_production as ref
from solutions.part3_grpo import GRPOConfig
from solutions.production import knobs
from tests.against_trl import ONE_PROCESS, trl_compute_loss
from tests.part7_production.common import ACCELERATE_CONFIGS, EXTRAS
from tests.support import assert_close, assert_equal, expect, run_script
from utils.checker.layout import ROOT

trl = pytest.importorskip("trl", reason=f"trl is not installed: {EXTRAS}")


def test_knob_table_names_are_fields_of_the_installed_trl():
    theirs = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    named = ({k.trl for k in knobs.GRPO_TO_TRL.values() if k.trl} | set(knobs.TRL_SETTINGS)
             | {k.trl for k in knobs.REFERENCE_TO_TRL.values() if k.trl} | {"sync_ref_model"})
    assert_equal(sorted(named - theirs), [], f"names in knobs.py that trl {trl.__version__}'s GRPOConfig lacks")


def test_trl_accepts_the_translated_config(tmp_path):
    """trl.GRPOConfig takes to_trl_config's arguments as they are, and derives the same step: one batch of
    n_prompts × group_size completions per optimizer step, num_iterations optimizer steps per batch."""
    for cfg in (GRPOConfig(), GRPOConfig(num_iterations=2, epsilon_high=0.28, beta=0.04, device="cpu")):
        args = trl.GRPOConfig(**ref.to_trl_config(cfg, str(tmp_path)))
        assert_equal(args.generation_batch_size, cfg.n_prompts * cfg.group_size, "TRL's generation_batch_size")
        assert_equal((args.max_steps, args.num_generations, args.steps_per_generation, args.bf16),
                     (cfg.steps * cfg.num_iterations, cfg.group_size, 1, False),
                     "TRL's (max_steps, num_generations, steps_per_generation, bf16)")
        assert_equal(str(args.lr_scheduler_type).rsplit(".", 1)[-1].lower(), "constant", "TRL's learning rate schedule")


def plain(value):
    """transformers' enums (SchedulerType.CONSTANT, SaveStrategy.NO) as their strings."""
    return getattr(value, "value", value)


# Each trl.GRPOConfig field that to_trl_config fills from one of our knobs, and the value it must hold once
# trl.GRPOConfig has read it (its __post_init__ included), from our config and the number of processes
OUR_VALUES = {
    "max_steps": lambda cfg, w: cfg.steps * cfg.num_iterations,
    "per_device_train_batch_size": lambda cfg, w: cfg.n_prompts * cfg.group_size // w,
    "num_generations": lambda cfg, w: cfg.group_size,
    "max_completion_length": lambda cfg, w: cfg.max_new_tokens,
    "temperature": lambda cfg, w: cfg.temperature,
    "learning_rate": lambda cfg, w: cfg.lr,
    "beta": lambda cfg, w: cfg.beta,
    "epsilon": lambda cfg, w: cfg.epsilon,
    "epsilon_high": lambda cfg, w: cfg.epsilon_high,
    "loss_type": lambda cfg, w: cfg.loss_type,
    "scale_rewards": lambda cfg, w: cfg.scale_rewards,
    "num_iterations": lambda cfg, w: cfg.num_iterations,
    "mask_truncated_completions": lambda cfg, w: cfg.mask_truncated_completions,
    "reward_weights": lambda cfg, w: [1.0, cfg.format_weight] if cfg.task == "addition" else [1.0],
    "max_grad_norm": lambda cfg, w: cfg.max_grad_norm,
    "seed": lambda cfg, w: cfg.seed,
    "use_cpu": lambda cfg, w: cfg.device == "cpu",
    "report_to": lambda cfg, w: ["wandb"] if cfg.wandb else [],  # trl.GRPOConfig keeps a list; "none" is []
    "logging_steps": lambda cfg, w: 1,
}
# The knobs whose default in our GRPOConfig is trl 1.16's default too (the others differ, e.g. max_new_tokens 5
# against max_completion_length 512, lr 3e-3 against 1e-6): checked both ways, so that a change of TRL's defaults shows
SAME_DEFAULT_AS_TRL = ("num_generations", "temperature", "beta", "epsilon", "epsilon_high", "loss_type",
                       "scale_rewards", "num_iterations", "mask_truncated_completions", "max_grad_norm", "use_cpu",
                       "report_to")
# The settings of trl 1.16 that change the loss or the samples (read in GRPOTrainer.__init__, _generate and
# _compute_loss): to_trl_config must set each one, so that the run does not depend on TRL's default
LOSS_AND_SAMPLE_SETTINGS = (
    "beta", "epsilon", "epsilon_high", "delta", "loss_type", "importance_sampling_level", "use_bias_correction_kl",
    "top_entropy_quantile", "entropy_coef", "use_adaptive_entropy", "off_policy_mask_threshold", "scale_rewards",
    "multi_objective_aggregation", "reward_weights", "mask_truncated_completions", "max_completion_length",
    "num_generations", "num_iterations", "steps_per_generation", "gradient_accumulation_steps", "temperature",
    "top_p", "top_k", "min_p", "repetition_penalty", "generation_kwargs", "disable_dropout", "bf16",
    "vllm_importance_sampling_correction", "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max",
    "vllm_importance_sampling_clip_min", "sync_ref_model",
)


def test_trl_config_holds_our_values(tmp_path):
    """trl.GRPOConfig built from to_trl_config holds, field by field, the value our config means (TRL's own reading
    of it: report_to becomes a list, lr_scheduler_type an enum), every setting of TRL_SETTINGS included, and every
    setting that changes TRL's loss or samples is set explicitly."""
    from tests.part7_production.test_trl_config import TRL_CONFIGS

    for label, (cfg, world_size) in TRL_CONFIGS.items():
        if cfg.device == "cuda" and not torch.cuda.is_available():
            cfg = dataclasses.replace(cfg, device=None)  # trl.GRPOConfig refuses bf16=False on a GPU it cannot see
        kwargs = ref.to_trl_config(cfg, str(tmp_path), world_size)
        args = trl.GRPOConfig(**kwargs)
        what = f"trl.GRPOConfig(**to_trl_config({label}, world_size={world_size}))"
        for field, value in OUR_VALUES.items():
            assert_equal(plain(getattr(args, field)), value(cfg, world_size), f"{what}.{field}")
        for field, (value, _) in knobs.TRL_SETTINGS.items():
            assert_equal(plain(getattr(args, field)), value, f"{what}.{field} (TRL_SETTINGS)")
        assert_equal(sorted(set(LOSS_AND_SAMPLE_SETTINGS) - set(kwargs)), [],
                     f"{label}: settings of TRL's loss or sampling that to_trl_config leaves to TRL's default")


def test_our_defaults_against_trls(tmp_path):
    """Our GRPOConfig's defaults, translated, against trl.GRPOConfig's own defaults: equal for the knobs of
    SAME_DEFAULT_AS_TRL, different for the others."""
    ours = trl.GRPOConfig(**ref.to_trl_config(GRPOConfig(), str(tmp_path)))
    theirs = trl.GRPOConfig(output_dir=str(tmp_path), bf16=False)  # TRL's default bf16=True needs a GPU
    same = sorted(f for f in OUR_VALUES if plain(getattr(ours, f)) == plain(getattr(theirs, f)))
    table = {f: (plain(getattr(ours, f)), plain(getattr(theirs, f))) for f in OUR_VALUES}
    assert_equal(same, sorted(SAME_DEFAULT_AS_TRL), f"the knobs whose default is trl {trl.__version__}'s too "
                 f"((ours, TRL's) for each: {table})")


def trl_loss_with(args, logprobs, old_logprobs, ref_logprobs, advantages, mask):
    """TRL's own GRPOTrainer._compute_loss on a stand-in trainer whose settings are read from `args` (a
    trl.GRPOConfig) as trl 1.16's GRPOTrainer.__init__ reads them (grpo_trainer.py, "Training arguments" to the
    entropy settings), its model returning `logprobs`; `args` itself is the trainer's `args`."""
    accelerator = ONE_PROCESS
    trainer = SimpleNamespace(
        args=args, beta=args.beta, loss_type=args.loss_type, epsilon_low=args.epsilon,
        epsilon_high=args.epsilon_high if args.epsilon_high is not None else args.epsilon,
        importance_sampling_level=args.importance_sampling_level, top_entropy_quantile=args.top_entropy_quantile,
        off_policy_mask_threshold=args.off_policy_mask_threshold, use_vllm=args.use_vllm,
        vllm_importance_sampling_correction=args.vllm_importance_sampling_correction,
        entropy_coef=args.entropy_coef, use_adaptive_entropy=args.use_adaptive_entropy,
        _entropy_bonus_enabled=args.entropy_coef != 0.0 or args.use_adaptive_entropy,
        max_completion_length=args.max_completion_length, aux_loss_enabled=False,  # GPT-2 is no mixture of experts
        current_gradient_accumulation_steps=args.gradient_accumulation_steps, model=SimpleNamespace(training=True),
        accelerator=accelerator, _metrics={"train": defaultdict(list)},
        _get_per_token_logps_and_entropies=lambda *a, **k: (logprobs, torch.zeros_like(logprobs), None),
    )
    return trl_compute_loss(trainer, old_logprobs, ref_logprobs, advantages, mask)


def test_trl_computes_our_trainers_loss_with_the_translated_config(tmp_path):
    """to_trl_config(GRPOConfig(beta=0.04)) gives a TRL config under which TRL's own _compute_loss gives the loss
    and the gradient that our trainer's call of grpo_loss gives, on- and off-policy; so does a config with another
    loss type and clip-higher. TRL's default would multiply k3 by the ratio (use_bias_correction_kl); the last check
    shows that this default alone, left in, changes the gradient."""
    from solutions.part3_grpo import grpo_loss
    from tests.against_trl import loss_and_grad, loss_inputs

    logprobs, old, ref_lp, advantages, mask = loss_inputs(seed=5)
    for cfg in (GRPOConfig(beta=0.04), GRPOConfig(beta=0.5, epsilon_high=0.28, loss_type="dr_grpo", max_new_tokens=5)):
        args = trl.GRPOConfig(**ref.to_trl_config(cfg, str(tmp_path)))
        for policy, old_lp in (("on-policy", None), ("off-policy", old)):
            ours = loss_and_grad(grpo_loss, logprobs, old_lp, ref_lp, advantages, mask, epsilon=cfg.epsilon,
                                 epsilon_high=cfg.epsilon_high, beta=cfg.beta, loss_type=cfg.loss_type,
                                 max_completion_length=cfg.max_new_tokens)  # as GRPOTrainer's step calls it
            theirs = loss_and_grad(lambda lp, *rest: trl_loss_with(args, lp, *rest), logprobs, old_lp, ref_lp,
                                   advantages, mask)
            what = (f"TRL's loss with to_trl_config(beta={cfg.beta}, loss_type={cfg.loss_type!r}), {policy}, "
                    "against our trainer's")
            hint = "TRL_SETTINGS must set use_bias_correction_kl=False: our trainer adds beta × k3 alone"
            assert_close(theirs[0], ours[0], what, atol=1e-5, hint=hint)
            assert_close(theirs[1], ours[1], f"{what}: gradient", atol=1e-5, hint=hint)
    args = trl.GRPOConfig(**{**ref.to_trl_config(GRPOConfig(beta=0.04), str(tmp_path)), "use_bias_correction_kl": True})
    with_default = loss_and_grad(lambda lp, *rest: trl_loss_with(args, lp, *rest), logprobs, None, ref_lp, advantages,
                                 mask)
    ours = loss_and_grad(grpo_loss, logprobs, None, ref_lp, advantages, mask, beta=0.04)
    expect(not torch.allclose(with_default[1], ours[1], atol=1e-5), "TRL's default use_bias_correction_kl=True",
           "gives our gradient: the setting would not matter, and the test could not tell")


def test_trls_reference_sync_is_part4s(tmp_path, monkeypatch):
    """knobs.reference_to_trl's arguments are accepted by trl.GRPOConfig, and TRL's SyncRefModelCallback moves a
    reference as Part 4's sync_full does (ref <- alpha * policy + (1 - alpha) * ref), at optimizer steps that are
    multiples of ref_model_sync_steps. (Its DeepSpeed check needs a launched accelerator: the test calls TRL's own
    mixing, _sync_target_model, without it.)"""
    from solutions.part4_reference import ReferenceSettings, sync_full
    from trl.trainer.callbacks import SyncRefModelCallback

    settings = ReferenceSettings(beta=0.1, lora=False, sync_every=10, sync_alpha=0.3)
    cfg = GRPOConfig(beta=0.1, num_iterations=2)
    args = trl.GRPOConfig(**{**ref.to_trl_config(cfg, str(tmp_path)), **knobs.reference_to_trl(settings, 2)})
    assert_equal((args.sync_ref_model, args.ref_model_sync_steps, args.ref_model_mixup_alpha), (True, 20, 0.3),
                 "TRL's (sync_ref_model, ref_model_sync_steps, ref_model_mixup_alpha)")
    torch.manual_seed(0)
    policy, reference = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    ours, theirs = (torch.nn.Linear(4, 3) for _ in range(2))
    for copy in (ours, theirs):
        copy.load_state_dict(reference.state_dict())
    sync_full(policy, ours, settings.sync_alpha)
    synced_at = []
    monkeypatch.setattr(SyncRefModelCallback, "sync_target_model",
                        staticmethod(SyncRefModelCallback._sync_target_model))
    callback = SyncRefModelCallback(ref_model=theirs, accelerator=None)
    for step in range(1, 41):  # TRL's global_step after each optimizer step
        before = theirs.weight.detach().clone()
        callback.on_step_end(args, SimpleNamespace(global_step=step), None, model=policy)
        if not torch.equal(before, theirs.weight):
            synced_at.append(step)
        if step == 20:
            for a, b in zip(theirs.parameters(), ours.parameters()):
                assert_close(a.detach(), b.detach(), "TRL's synced reference against sync_full's", atol=1e-7)
    assert_equal(synced_at, [20, 40], "the optimizer steps at which TRL synced (our steps 10 and 20, 2 iterations "
                 "each)")


def test_the_chapter_names_only_real_trl_settings_and_launch_flags():
    """Section 4 names TRL's vLLM and ZeRO-3 settings and `accelerate launch` / `trl vllm-serve` flags in prose: each
    must exist in the installed versions."""
    from accelerate.commands.launch import launch_command_parser
    from trl.scripts.vllm_serve import make_parser

    text = (ROOT / "chapters" / "source" / "part7_production.py").read_text()
    settings = set(re.findall(r"`((?:use_)?vllm\w*|ds3_\w+)(?:=[^`]*)?`", text))
    expect(len(settings) >= 8, "TRL settings named in the chapter", f"found only {sorted(settings)}", len(settings))
    theirs = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    assert_equal(sorted(settings - theirs), [], f"settings the chapter names that trl {trl.__version__} lacks")
    launch = {o for a in launch_command_parser()._actions for o in a.option_strings}
    serve = {o for a in make_parser()._actions for o in a.option_strings}
    for tool, flags in (("accelerate launch", launch), ("trl vllm-serve", serve)):
        lines = [line for line in text.splitlines() if tool in line or (line.startswith("#     ") and "--" in line)]
        named = {f for line in lines for f in re.findall(r"(--[a-z_-]+)", line) if tool == "accelerate launch"
                 or "vllm-serve" in line}
        named -= {"--trl-only", "--vllm", "--steps", "--plot", "--seed", "--json"}  # our script's own flags
        assert_equal(sorted(named - flags), [], f"flags the chapter gives `{tool}` that it lacks")


@pytest.mark.slow
@pytest.mark.parametrize("model, modules", [("tiny", ["attn.c_attn"]),
                                            ("tiny-llama", sorted(ref.LLAMA_MODULES.values()))],
                         ids=["gpt2", "llama"])
def test_script_trains_both_and_prints_json_figures(tmp_path, model, modules):
    """Smoke setting: two steps of TRL's GRPOTrainer, two of ours, the same held-out accuracy at the start, on each
    embedded model with its preset's LoRA (on the Llama-style model, peft's modules are Llama's own projections)."""
    _, figures = run_script("solutions.production.trl_grpo", "--json", "--model", model, "--plot",
                            str(tmp_path / "c.png"))
    assert_equal((figures["model"], figures["lora"]), (model, modules), "the run's model and peft's LoRA modules")
    assert_equal(figures["trl_accuracy_start"], figures["ours_accuracy_start"], "both runs' starting accuracy")
    assert_equal(figures["trl_trainable_params"], figures["ours_trainable_params"], "both runs' LoRA sizes")
    expect((tmp_path / "c.png").exists(), "the curves", "were not saved to --plot's path")


@pytest.mark.slow
def test_script_runs_under_accelerate_launch_on_one_cpu_process(tmp_path):
    """`accelerate launch --config_file cpu_1proc.yaml -m solutions.production.trl_grpo` (smoke setting: 2 steps),
    and the adapter it saves is a peft adapter folder."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RLHF_SMOKE": "1"}
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ACCELERATE_CONFIGS / "cpu_1proc.yaml"), "-m", "solutions.production.trl_grpo", "--trl-only",
               "--json", "--plot", "", "--save", str(tmp_path / "adapter")]
    result = subprocess.run(command, cwd=ACCELERATE_CONFIGS.parents[2], capture_output=True, text=True, env=env,
                            timeout=900)
    expect(result.returncode == 0, "accelerate launch", f"failed:\n{result.stderr[-3000:]}")
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert_equal((figures["processes"], figures["steps"], "ours_accuracy_end" in figures), (1, 2, False),
                 "the launched run's (processes, steps, ran ours too)")
    assert_equal(sorted(p.name for p in (tmp_path / "adapter").iterdir()),
                 ["README.md", "adapter_config.json", "adapter_model.safetensors"], "the saved adapter folder")
