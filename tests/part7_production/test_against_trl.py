"""Against the installed TRL: the knob table names its settings, trl.GRPOConfig takes to_trl_config's arguments and
TRL's own loss then equals our trainer's, the chapter names only real settings and flags, and the TRL run trains."""

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest

from solutions import part7_production as ref
from solutions.part3_grpo import GRPOConfig
from solutions.production import knobs
from tests.part7_production.common import ACCELERATE_CONFIGS, EXTRAS
from tests.support import assert_close, assert_equal, expect, run_script
from utils.checker.layout import ROOT

trl = pytest.importorskip("trl", reason=f"trl is not installed: {EXTRAS}")


def test_knob_table_names_are_fields_of_the_installed_trl():
    theirs = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    named = {k.trl for k in knobs.GRPO_TO_TRL.values() if k.trl} | set(knobs.TRL_SETTINGS)
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


def test_trl_computes_our_trainers_loss_with_the_translated_config(tmp_path):
    """With beta > 0, TRL's own _compute_loss, set up by to_trl_config, gives the loss and the gradient that our
    trainer's call of grpo_loss gives, off-policy included: the KL term is the same (TRL's default would multiply k3
    by the ratio, use_bias_correction_kl, which our trainer does not)."""
    from solutions.part3_grpo import grpo_loss
    from tests.against_trl import loss_and_grad, loss_inputs, trl_loss

    logprobs, old, ref_lp, advantages, mask = loss_inputs(seed=5)
    for cfg in (GRPOConfig(beta=0.04), GRPOConfig(beta=0.5, epsilon_high=0.28, loss_type="dr_grpo", max_new_tokens=5)):
        args = trl.GRPOConfig(**ref.to_trl_config(cfg, str(tmp_path)))
        ours = loss_and_grad(grpo_loss, logprobs, old, ref_lp, advantages, mask, epsilon=cfg.epsilon,
                             epsilon_high=cfg.epsilon_high, beta=cfg.beta, loss_type=cfg.loss_type,
                             max_completion_length=cfg.max_new_tokens)  # as GRPOTrainer's step calls it
        theirs = loss_and_grad(trl_loss, logprobs, old, ref_lp, advantages, mask, epsilon=args.epsilon,
                               epsilon_high=args.epsilon_high, beta=args.beta, loss_type=args.loss_type,
                               max_completion_length=args.max_completion_length,
                               use_bias_correction_kl=args.use_bias_correction_kl)
        what = f"TRL's loss with to_trl_config(beta={cfg.beta}, loss_type={cfg.loss_type!r}) against our trainer's"
        hint = "TRL_SETTINGS must set use_bias_correction_kl=False: our trainer adds beta × k3 alone"
        assert_close(theirs[0], ours[0], what, atol=1e-5, hint=hint)
        assert_close(theirs[1], ours[1], f"{what}: gradient", atol=1e-5, hint=hint)


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
def test_script_trains_both_and_prints_json_figures(tmp_path):
    """Smoke setting: two steps of TRL's GRPOTrainer, two of ours, the same held-out accuracy at the start."""
    _, figures = run_script("solutions.production.trl_grpo", "--json", "--plot", str(tmp_path / "c.png"))
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
