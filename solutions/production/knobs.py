"""Every knob of our GRPOConfig (solutions/part3_grpo.py), and where it lives in TRL and peft.

Plain data: importing this module needs neither TRL nor peft. tests/part7_production/ checks that every field
of our GRPOConfig and of Part 4's ReferenceSettings has a row, that every TRL and peft name below is a real field of
the installed trl.GRPOConfig and peft.LoraConfig (written against trl 1.16 and peft 0.21), and, with TRL installed,
that the config TRL builds from to_trl_config holds our values and computes our loss, so that the table cannot rot.
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
                               "attn.c_proj, mlp_in -> mlp.c_fc, mlp_out -> mlp.c_proj; a Llama-style model's: "
                               "q_proj, k_proj, v_proj, o_proj, gate_proj (mlp_gate), up_proj (mlp_in), down_proj "
                               "(mlp_out), one module each, as ours", peft="target_modules"),
    "beta": Knob("beta", "the same weight, not yet the same term: TRL's default is 0 too (no reference model is "
                         "loaded), but with beta > 0 TRL 1.16 multiplies each token's k3 by the ratio π/π_old by "
                         "default (use_bias_correction_kl=True: the per-token reverse KL's gradient); ours adds k3 "
                         "alone (the per-token forward KL's gradient), so TRL_SETTINGS sets it False"),
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
    "adam_beta1": (0.9, "torch.optim.AdamW's, as our optimizer (TRL's default too)"),
    "adam_beta2": (0.999, "torch.optim.AdamW's, as our optimizer (TRL's default too)"),
    "adam_epsilon": (1e-8, "torch.optim.AdamW's, as our optimizer (TRL's default too)"),
    # What the loss is made of (each read by trl 1.16's GRPOTrainer._compute_loss)
    "use_bias_correction_kl": (False, "ours adds beta × k3 per token; TRL 1.16's default multiplies k3 by the ratio "
                                      "(`per_token_kl * coef_1`, the ratio carrying gradient), which changes the KL "
                                      "term's gradient whenever beta > 0, on-policy too"),
    "importance_sampling_level": ("token", "one ratio per token, as ours (TRL's default too; 'sequence' is GSPO)"),
    "delta": (None, "no cap on the unclipped ratio (INTELLECT-2's two-sided clipping off), as ours (TRL's default)"),
    "top_entropy_quantile": (1.0, "every completion token in the loss, as ours (TRL's default too)"),
    "entropy_coef": (0.0, "no entropy bonus in the loss, as ours (TRL's default too)"),
    "use_adaptive_entropy": (False, "no entropy bonus, adaptive or not, as ours (TRL's default too)"),
    "off_policy_mask_threshold": (None, "no sequence dropped for drifting off-policy, as ours (TRL's default too)"),
    "multi_objective_aggregation": ("sum_then_normalize", "the weighted sum of the rewards is normalised per group, "
                                                          "as compose_rewards then group_advantages (TRL's default "
                                                          "too)"),
    "disable_dropout": (True, "our models sample and train in eval mode, without dropout; TRL's Trainer trains in "
                              "train mode, and GPT-2 small has dropout 0.1 (the tiny model has none)"),
    # What the samples are drawn from
    "repetition_penalty": (1.0, "no repetition penalty, as ours (TRL's default too)"),
    "min_p": (None, "no min-p filtering, as ours (TRL's default too)"),
    "generation_kwargs": (None, "nothing overrides the sampling settings above (TRL's default too)"),
    # Only with use_vllm=True (the script's --vllm): vLLM samples with other kernels than the trainer computes with,
    # and TRL re-weights for that mismatch; our sampler is the policy itself, so there is none to correct. TRL 1.16's
    # own correction, written out: each sequence's loss times the ratio of the trainer's probability of it to vLLM's,
    # and 0 where that ratio is above 3 (grpo_trainer.py, _generate_and_score_completions and _compute_loss)
    "vllm_importance_sampling_correction": (True, "with vLLM, TRL's correction on (TRL's default; no effect "
                                                  "without vLLM)"),
    "vllm_importance_sampling_mode": ("sequence_mask", "with vLLM, one ratio per sequence (the product of its "
                                                       "tokens'), the sequence dropped beyond the cap (TRL's "
                                                       "default; Part 6 compares it with per-token caps)"),
    "vllm_importance_sampling_clip_max": (3.0, "with vLLM, the cap (TRL's default)"),
    "vllm_importance_sampling_clip_min": (None, "with vLLM, no lower cap (TRL's default)"),
    # The reference
    "sync_ref_model": (False, "Part 3's trainer never moves its reference (TRL's default too); Part 4's syncs: "
                              "REFERENCE_TO_TRL"),
}
TRL_DEFAULTS_THAT_DIFFER = ("lr_scheduler_type", "activation_checkpointing", "bf16", "shuffle_dataset",
                            "save_strategy", "use_bias_correction_kl", "disable_dropout")  # the rest: TRL's defaults

# Part 4's ReferenceSettings (solutions/part4_reference.py) -> TRL (trl 1.16's GRPOTrainer.__init__ and
# SyncRefModelCallback). reference_to_trl below gives the arguments.
REFERENCE_TO_TRL: dict[str, Knob] = {
    "beta": Knob("beta", "the same (GRPO_TO_TRL's row): 0 loads no reference"),
    "lora": Knob(None, "True: GRPOTrainer(peft_config=LoraConfig(...)), whose reference is the model with its adapter "
                       "disabled (our 'hooks_removed'); False: no peft_config, and with beta > 0 TRL does not copy "
                       "the model it was given but loads the reference again from disk or the Hub, from the path in "
                       "its config (trl 1.16: GRPOTrainer.__init__ calls create_model_from_path(get_config_model_id("
                       "model.config)), trl/trainer/utils.py, which reads config._name_or_path). That is our "
                       "'frozen_copy' only when the model holds exactly the weights saved at that path: a model "
                       "changed in memory, or built with from_config (random weights, the path's name still in its "
                       "config), gets the saved weights as its reference, and one built from a bare config "
                       "(_name_or_path '') has nothing to load and fails. To start from other weights, save them "
                       "and pass GRPOTrainer the folder's path (model='folder'): the policy and the reference are "
                       "then both loaded from it"),
    "retraining_adapter": Knob(None, "pass GRPOTrainer a PeftModel that holds the trained adapter: with beta > 0 TRL "
                                     "copies it into a frozen adapter named 'ref' and computes the reference with "
                                     "it (our 'old_adapter')"),
    "precomputed": Knob(None, "no counterpart in GRPO, which samples new completions at every step (TRL's "
                              "DPOConfig has precompute_ref_log_probs, as Part 5's DPO)"),
    "sync_every": Knob("ref_model_sync_steps", "sync_every × num_iterations, with sync_ref_model=True (sync_every 0: "
                                               "sync_ref_model=False): TRL counts optimizer steps and syncs at the "
                                               "end of each one whose number is a multiple"),
    "sync_alpha": Knob("ref_model_mixup_alpha", "the same: every reference parameter <- alpha × policy's + (1 - "
                                                "alpha) × its own, as our sync_full (TRL's default alpha is 0.6)"),
    "lora_sync": Knob(None, "none: trl 1.16 refuses sync_ref_model with a peft model (NotImplementedError: its "
                            "reference is the adapter switched off, there is no reference model to move), so "
                            "neither our merge-sync nor our reference-only sync has a counterpart; a synced "
                            "reference in TRL needs full fine-tuning (lora=False)"),
}


def reference_to_trl(settings, num_iterations: int = 1) -> dict:
    """trl.GRPOConfig's arguments for the reference that Part 4's `settings` (a ReferenceSettings) describe, on a run
    of `num_iterations` optimizer steps per batch of rollouts: beta, sync_ref_model and, when it syncs,
    ref_model_sync_steps and ref_model_mixup_alpha. Raises a ValueError for what TRL cannot do: a synced reference
    with a LoRA, and a precomputed one."""
    syncs = settings.beta > 0 and settings.sync_every > 0  # beta == 0: no reference, nothing to sync
    if settings.beta > 0 and settings.precomputed:
        raise ValueError("TRL's GRPOTrainer cannot precompute reference log-probs: it samples new completions at "
                         "every step (DPOConfig(precompute_ref_log_probs=True) does, for a fixed dataset)")
    if syncs and settings.lora:
        raise ValueError("trl 1.16 refuses sync_ref_model with a peft model (its reference is the adapter switched "
                         "off): sync the reference with full fine-tuning (lora=False), or keep it static")
    out = {"beta": settings.beta, "sync_ref_model": syncs}
    if syncs:
        out |= {"ref_model_sync_steps": settings.sync_every * num_iterations,
                "ref_model_mixup_alpha": settings.sync_alpha}
    return out

# Our LoRA targets -> the module each adapts in the Hugging Face model: MODULES in solutions/part7_production.py.
# (In GPT-2, q, k and v share one fused matrix, attn.c_attn, so peft adapts the three together through one shared A;
# a Llama-style model has one nn.Linear per target. to_lora_config also sets fan_in_fan_out, true for GPT-2's Conv1D
# only, which stores its weight as [in, out], the transpose of nn.Linear's.)

# peft settings with no knob of ours, the same on every model: (value, why)
PEFT_SETTINGS: dict[str, tuple[object, str]] = {
    "lora_dropout": (0.0, "our LoRA has no dropout"),
    "bias": ("none", "our LoRA trains no bias"),
    "task_type": ("CAUSAL_LM", "a causal language model"),
}


def knob_rows() -> list[dict[str, str]]:
    """The table as rows (ours, TRL's, peft's, how), for tabulate or a markdown table."""
    return [{"GRPOConfig (ours)": ours, "trl.GRPOConfig": knob.trl or "–", "peft.LoraConfig": knob.peft or "–",
             "how": knob.how} for ours, knob in GRPO_TO_TRL.items()]
