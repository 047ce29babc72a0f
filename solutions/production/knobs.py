"""Every knob of our GRPOConfig (solutions/part3_grpo.py), and where it lives in TRL and peft.

Plain data: importing this module needs neither TRL nor peft. tests/part7_production/ checks that every field
of our GRPOConfig has a row, and that every TRL and peft name below is a real field of the installed trl.GRPOConfig
and peft.LoraConfig (written against trl 1.16 and peft 0.21), so that the table cannot rot.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Knob:
    """Where one of our settings goes in TRL (or peft), and how its value is translated."""

    trl: str | None            # the trl.GRPOConfig field; None where it is no field of trl.GRPOConfig
    how: str                   # how our value becomes theirs, or why there is no counterpart
    peft: str | None = None    # the peft.LoraConfig field, for the LoRA's settings


# our GRPOConfig field -> its counterpart
GRPO_TO_TRL: dict[str, Knob] = {
    "model": Knob(None, "not a config field: `GRPOTrainer(model=...)` takes a Hub name or a loaded model "
                        "(`model_init_kwargs` holds `from_pretrained`'s options for a name)"),
    "task": Knob(None, "not a config field: the task is `GRPOTrainer(train_dataset=..., reward_funcs=...)`, a "
                       "dataset with a 'prompt' column and the reward functions"),
    "steps": Knob("max_steps", "steps × num_iterations: TRL counts optimizer steps, and each batch of rollouts "
                               "serves num_iterations of them (TRL reads 0 as 'not set': it then trains for "
                               "num_train_epochs)"),
    "n_prompts": Knob("per_device_train_batch_size", "TRL counts completions per process: n_prompts × group_size "
                                                     "/ number of processes (with gradient_accumulation_steps and "
                                                     "steps_per_generation at 1, one batch of rollouts per step)"),
    "group_size": Knob("num_generations", "the same"),
    "max_new_tokens": Knob("max_completion_length", "the same"),
    "temperature": Knob("temperature", "the same; TRL's top_p 1.0 and top_k 0 keep the whole vocabulary, as ours"),
    "lr": Knob("learning_rate", "the same, with lr_scheduler_type 'constant': TRL's default decays it linearly "
                                "to 0 over max_steps"),
    "lora_rank": Knob(None, "peft: `GRPOTrainer(peft_config=LoraConfig(r=...))`", peft="r"),
    "lora_alpha": Knob(None, "peft: LoraConfig(lora_alpha=...); the update is scaled by alpha / r on both sides",
                       peft="lora_alpha"),
    "lora_targets": Knob(None, "peft: LoraConfig(target_modules=...), GPT-2's module names: q, k, v -> attn.c_attn "
                               "(fused: one LoRA for all three, whose A is shared and which adapts k too), o -> "
                               "attn.c_proj, mlp_in -> mlp.c_fc, mlp_out -> mlp.c_proj", peft="target_modules"),
    "beta": Knob("beta", "the same; TRL's default is 0 too (no reference model is loaded). With beta > 0 the same "
                         "KL term needs use_bias_correction_kl=False (TRL_SETTINGS)"),
    "epsilon": Knob("epsilon", "the same (the ratio's clip below 1)"),
    "epsilon_high": Knob("epsilon_high", "the same; None means epsilon on both sides"),
    "loss_type": Knob("loss_type", "the same names and definitions (Part 3 checks ours against TRL's code)"),
    "scale_rewards": Knob("scale_rewards", "the same values: 'group', 'batch', 'none'"),
    "num_iterations": Knob("num_iterations", "the same (μ in the GRPO paper); see steps"),
    "mask_truncated_completions": Knob("mask_truncated_completions", "the same"),
    "format_weight": Knob("reward_weights", "[1.0, format_weight]: one weight per reward function, in the order "
                                            "of reward_funcs (exact answer, then format)"),
    "max_grad_norm": Knob("max_grad_norm", "the same"),
    "eval_every": Knob("eval_steps", "the nearest, not the same: TRL's evaluation (with eval_strategy 'steps' and "
                                     "an eval_dataset) samples completions of other prompts and reports their mean "
                                     "reward; our greedy held-out accuracy is a TrainerCallback in "
                                     "solutions/production/trl_grpo.py"),
    "table_every": Knob("logging_steps", "with log_completions=True, TRL prints a table of sampled completions at "
                                         "every logging step (num_completions_to_print rows)"),
    "seed": Knob("seed", "the same seed, not the same random numbers: TRL's sampler and peft's initial A draw "
                         "their own"),
    "device": Knob("use_cpu", "TRL (through accelerate) takes a GPU when there is one; use_cpu=True forces the CPU, "
                              "and several devices are `accelerate launch`'s job"),
    "wandb": Knob("report_to", "'wandb' or 'none'"),
}

# TRL settings with no knob of ours, each set to what our trainer does: (value, why). Some of TRL's defaults (trl 1.16)
# differ from it: TRL_DEFAULTS_THAT_DIFFER. The others are TRL's defaults already, written out so that the run does
# not depend on them (tests/test_upstream.py checks which is which against the installed TRL).
TRL_SETTINGS: dict[str, tuple[object, str]] = {
    "lr_scheduler_type": ("constant", "ours keeps the learning rate constant; TRL's default decays it linearly"),
    "warmup_steps": (0, "no warm-up in ours (TRL's default too)"),
    "weight_decay": (0.0, "our AdamW has no weight decay (TRL's default too)"),
    "activation_checkpointing": (False, "TRL turns gradient (activation) checkpointing on by default; ours keeps "
                                        "the activations"),
    "bf16": (False, "TRL trains in bfloat16 autocast by default; ours in float32"),
    "gradient_accumulation_steps": (1, "one optimizer step per batch of rollouts, as ours (TRL's default too)"),
    "steps_per_generation": (1, "a fresh batch of rollouts for every optimizer step (times num_iterations), as ours "
                                "(TRL's default: it takes gradient_accumulation_steps' value, 1)"),
    "shuffle_dataset": (False, "TRL shuffles the prompts by default; here they come in the order we draw them, so "
                               "that both runs see the same ones"),
    "top_p": (1.0, "no nucleus filtering, as ours (TRL's default too)"),
    "top_k": (0, "no top-k filtering, as ours (TRL's default too; 0 is its 'off')"),
    "save_strategy": ("no", "TRL saves a checkpoint every save_steps by default; none mid-run here (the script saves "
                            "the adapter at the end)"),
    "use_bias_correction_kl": (False, "ours adds beta × k3 per token; TRL's default (since trl 1.10) multiplies k3 by "
                                      "the ratio, which changes the KL term's gradient whenever beta > 0"),
}
TRL_DEFAULTS_THAT_DIFFER = ("lr_scheduler_type", "activation_checkpointing", "bf16", "shuffle_dataset",
                            "save_strategy", "use_bias_correction_kl")  # the rest of TRL_SETTINGS are its defaults

# Our LoRA targets -> the module each adapts in Hugging Face's GPT-2: HF_MODULES in solutions/part7_production.py.
# (q, k and v share one fused matrix there, attn.c_attn, so peft adapts the three together through one shared A.)

# peft settings with no knob of ours: (value, why)
PEFT_SETTINGS: dict[str, tuple[object, str]] = {
    "lora_dropout": (0.0, "our LoRA has no dropout"),
    "bias": ("none", "our LoRA trains no bias"),
    "fan_in_fan_out": (True, "GPT-2's Conv1D stores its weight as [in, out], the transpose of nn.Linear's"),
    "task_type": ("CAUSAL_LM", "a causal language model"),
}


def knob_rows() -> list[dict[str, str]]:
    """The table as rows (ours, TRL's, peft's, how), for tabulate or a markdown table."""
    return [{"GRPOConfig (ours)": ours, "trl.GRPOConfig": knob.trl or "–", "peft.LoraConfig": knob.peft or "–",
             "how": knob.how} for ours, knob in GRPO_TO_TRL.items()]
