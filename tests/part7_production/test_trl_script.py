"""The pieces of the TRL run (solutions/production/trl_grpo.py) that need no TRL: the prompts it trains on, its
held-out accuracy through peft, its refusal of a meaningless flag, and the accelerate configs it is launched with."""

import pytest
import torch

from solutions import part7_production as ref
from solutions.part3_grpo import GRPOConfig
from tests.part7_production.common import ACCELERATE_CONFIGS, needs
from tests.support import assert_close, assert_equal, expect


def test_training_prompts_are_the_prompts_our_trainer_draws():
    from solutions.part3_grpo import GRPOTrainer
    from solutions.production.trl_grpo import training_prompts

    cfg = GRPOConfig(steps=3, seed=5)
    trainer = GRPOTrainer(cfg)
    assert_equal(training_prompts(cfg), [p for _ in range(cfg.steps) for p in trainer.next_prompts()],
                 "training_prompts(cfg) against GRPOTrainer.next_prompts, step after step")


@needs("peft")
@pytest.mark.parametrize("model, correct", [("tiny", 346), ("tiny-llama", 336)], ids=["gpt2", "llama"])
def test_held_out_accuracy_of_a_fresh_peft_model_is_the_base_models(model, correct):
    """B = 0: the merged copy is the base model, whose held-out accuracy is 346 / 810 (GPT-2) or 336 / 810
    (Llama-style), with the LoRA of the model's preset."""
    from peft import LoraConfig, get_peft_model

    from solutions.part3_grpo import PRESETS
    from solutions.production.trl_grpo import held_out_accuracy
    from utils.models import EMBEDDED, load_tiny_hf

    hf_model, tokenizer = load_tiny_hf(EMBEDDED[model][0])
    peft_model = get_peft_model(hf_model, LoraConfig(**ref.to_lora_config(PRESETS[model]())))
    assert_close(torch.tensor(held_out_accuracy(peft_model, tokenizer)), torch.tensor(correct / 810),
                 f"held-out accuracy of the embedded model {model!r} through peft's merge")
    expect(any(".lora_" in n for n, _ in peft_model.named_parameters()), "the peft model after held_out_accuracy",
           "lost its LoRA: the accuracy must be measured on a merged copy, not by merging the model in training")


@needs("accelerate")
@pytest.mark.parametrize("name, kind, processes", [("cpu_1proc", "NO", 1), ("multi_gpu_ddp", "MULTI_GPU", 8),
                                                   ("deepspeed_zero3", "DEEPSPEED", 8), ("fsdp", "FSDP", 8)])
def test_accelerate_configs_are_read_by_accelerate(name, kind, processes):
    """Each config file loads with accelerate's own reader, and every key of its deepspeed_config / fsdp_config is an
    option of the installed `accelerate launch` (which is where they end up)."""
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import launch_command_parser

    config = load_config_from_file(str(ACCELERATE_CONFIGS / f"{name}.yaml"))
    assert_equal((config.distributed_type.value, config.num_processes, config.mixed_precision),
                 (kind, processes, "no"), f"{name}.yaml: (distributed_type, num_processes, mixed_precision)")
    options = vars(launch_command_parser().parse_args(["script.py"]))
    keys = list(config.deepspeed_config) + list(config.fsdp_config)
    assert_equal([k for k in keys if k not in options], [], f"{name}.yaml: keys that `accelerate launch` lacks")
    if kind == "DEEPSPEED":
        assert_equal(config.deepspeed_config["zero_stage"], 3, "deepspeed_zero3.yaml's ZeRO stage")


@pytest.mark.parametrize("flag, value", [("--steps", "0"), ("--steps", "ten"), ("--vllm", "offline"),
                                         ("--model", "gpt2")])
def test_the_trl_script_refuses_a_meaningless_flag_in_one_line(flag, value, capsys):
    from solutions.production import trl_grpo

    with pytest.raises(SystemExit) as exit_:
        trl_grpo.main([flag, value])
    assert_equal(exit_.value.code, 2, f"the exit status of `trl_grpo {flag} {value}`")
    assert_equal(len(capsys.readouterr().err.strip().splitlines()), 1, "the lines of its error message")
