"""GRPO, ours against TRL's GRPOTrainer: the same weights, prompts and settings, one process (a benchmark, not a test).

    python bench/grpo_vs_trl.py                     # the embedded tiny model on CPU, 150 steps each
    python bench/grpo_vs_trl.py --json              # ... ending with a JSON line of the figures
    python bench/grpo_vs_trl.py --preset gpt2       # GPT-2 small on a GPU (add --random-weights offline)

Needs `pip install -r requirements-bench.txt` (TRL and peft).

What is the same on both sides:
- the model: the embedded tiny model is a Hugging Face GPT2LMHeadModel; TRL trains one copy of it, and ours wraps
  another copy in a TransformerBridge. The script checks that both give the same logits before it starts.
- the LoRA: rank, alpha, and the same modules. Ours adapts TransformerLens's `attn.o` by default, which is the very
  `attn.c_proj` that peft adapts in the Hugging Face model (GPT-2 fuses q, k and v into one `c_attn`, so peft can
  not adapt q and v alone the way our hooks can; the modules below exist unfused on both sides). Both start from
  the same A (ours, copied into peft's `lora_A`) and B = 0.
- the prompts (training additions), group size, completion length, temperature, learning rate (constant: TRL's
  default would decay it linearly), AdamW without weight decay, gradient clipping at 1, `beta`, loss type,
  epsilon, reward functions and weights, the seed and the torch thread count.
- TRL's defaults that would make it do more work than ours are turned off: gradient checkpointing and bf16
  autocast (both default to on in TRL 1.x; ours trains in float32 without checkpointing).

What is ours, and differs: our model loader gives GPT-2 PyTorch's one-kernel GELU (`utils.models.fuse_gelu`, the
same function), and our sampler decodes with `utils.decoder.LeanGPT2` while no hook is active. To see what each is
worth, `--engine bridge` samples through TransformerLens's `generate` instead, and `--trl-fused-gelu` gives TRL's
model the same GELU.

Held-out accuracy is measured for both by the same function (`utils.data.addition_accuracy`, greedy, 810
additions never trained on): for TRL, its current LoRA weights are copied into our hooks on a third copy of the
model. Evaluation time is excluded from the step times on both sides.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from solutions.part2_lora import LoRAModel, make_adapters  # noqa: E402
from solutions.part3_grpo import GRPOConfig, GRPOTrainer  # noqa: E402
from utils.data import addition_accuracy, addition_pairs, addition_prompt  # noqa: E402
import solutions.part3_grpo  # noqa: E402
from utils.models import (bridge_from_hf, fuse_gelu, load_tiny_hf, require_hub_model, set_cpu_threads,  # noqa: E402
                          tiny_hf_config)
from utils.real_configs import padded_tokenizer  # noqa: E402
from utils.sampling import sample  # noqa: E402

# Our LoRA target -> the Hugging Face GPT-2 module peft adapts (the end of its name inside each block).
HF_MODULES = {"o": "attn.c_proj", "mlp_in": "mlp.c_fc", "mlp_out": "mlp.c_proj"}


@dataclass
class Setting:
    """One comparison. The defaults are the main job's (solutions/part3_grpo.py), but for the adapted module."""

    preset: str = "tiny"
    task: str = "addition"                 # "addition" (held-out accuracy is tracked) or "periods"
    steps: int = 150
    n_prompts: int = 16
    group_size: int = 8
    max_new_tokens: int = 5
    lr: float = 3e-3
    lora_rank: int = 4
    lora_alpha: float = 8.0
    lora_targets: tuple[str, ...] = ("o",)
    beta: float = 0.0
    loss_type: str = "dapo"
    epsilon: float = 0.2
    format_weight: float = 0.1
    eval_every: int = 10                   # held-out accuracy every this many steps (addition task)
    target_accuracy: float = 0.70          # "time to reach": the first evaluation at or above this
    seed: int = 0
    threads: int | None = None             # CPU only; default: utils.models.set_cpu_threads's choice
    engine: str = "auto"                   # our sampler's engine (utils.sampling.sample): "auto" or "bridge"
    trl_fused_gelu: bool = False           # give TRL's model our one-kernel GELU too (utils.models.fuse_gelu)
    device: str | None = None

    @classmethod
    def gpt2(cls, **overrides) -> "Setting":
        """The settings of GRPOConfig.gpt2() (part 3's GPU preset): GPT-2 small, Part 1's full-stop reward."""
        return replace(cls(preset="gpt2", task="periods", steps=30, n_prompts=8, group_size=8, max_new_tokens=32,
                           lr=3e-4, lora_rank=16, lora_alpha=32.0, lora_targets=("o", "mlp_in", "mlp_out"),
                           beta=0.04, eval_every=0), **overrides)


# --- the model, handed to both ----------------------------------------------------------------------------------

def load_hf(setting: Setting, random_weights: bool):
    """(Hugging Face causal LM, tokenizer) for the preset."""
    if setting.preset == "tiny":
        return load_tiny_hf()
    if random_weights:  # GPT-2 small's shapes with random weights: for timing only
        torch.manual_seed(setting.seed)
        from transformers import GPT2LMHeadModel
        tokenizer = padded_tokenizer(50257)  # the embedded tokenizer, grown to GPT-2's vocabulary
        config = tiny_hf_config(50257, tokenizer.eos_token_id, d_model=768, n_layers=12, n_heads=12, n_ctx=1024)
        return GPT2LMHeadModel(config), tokenizer
    require_hub_model("gpt2", offline_choice="--random-weights (GPT-2 small's shapes, random weights)")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained("gpt2")
    tokenizer.pad_token = tokenizer.eos_token
    return AutoModelForCausalLM.from_pretrained("gpt2", use_safetensors=True), tokenizer


def prompt_stream(setting: Setting, n: int) -> list[str]:
    """The prompts, in order: additions from the training split, or Part 3's text prompts."""
    import random
    rng = random.Random(setting.seed)
    if setting.task == "addition":
        pairs = addition_pairs("train")
        return [addition_prompt(a, b) for a, b in (rng.choice(pairs) for _ in range(n))]
    return [rng.choice(GRPOTrainer.TEXT_PROMPTS) for _ in range(n)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# --- ours --------------------------------------------------------------------------------------------------------

def ours_config(setting: Setting, device: torch.device) -> GRPOConfig:
    return GRPOConfig(model=setting.preset, task=setting.task, steps=setting.steps, n_prompts=setting.n_prompts,
                      group_size=setting.group_size, max_new_tokens=setting.max_new_tokens, lr=setting.lr,
                      lora_rank=setting.lora_rank, lora_alpha=setting.lora_alpha, lora_targets=setting.lora_targets,
                      beta=setting.beta, epsilon=setting.epsilon, loss_type=setting.loss_type,
                      format_weight=setting.format_weight, eval_every=setting.eval_every, table_every=10**9,
                      seed=setting.seed, device=str(device))


def our_trainer(setting: Setting, hf_model, tokenizer, device: torch.device) -> tuple[GRPOTrainer, dict]:
    """Our GRPOTrainer on a copy of the model, and its adapters' initial state (for TRL to start from)."""
    trainer = GRPOTrainer(ours_config(setting, device), model=bridge_from_hf(copy.deepcopy(hf_model), tokenizer,
                                                                             device))
    return trainer, {k: v.detach().clone() for k, v in trainer.model.adapters.state_dict().items()}


def run_ours(setting: Setting, trainer: GRPOTrainer, device: torch.device, evaluate) -> dict:
    """Our GRPOTrainer, step by step: its figures."""
    # sample_groups calls sample() with its default engine; --engine bridge swaps in TransformerLens's generate
    solutions.part3_grpo.sample = lambda *args, **kwargs: sample(*args, **kwargs, engine=setting.engine)
    prompts = iter(prompt_stream(setting, setting.steps * setting.n_prompts))
    trainer.next_prompts = lambda: [next(prompts) for _ in range(setting.n_prompts)]  # the same prompts as TRL's
    step_times, accuracy, rewards = [], [], []
    for step in range(setting.steps + 1):
        if evaluate and (step % setting.eval_every == 0 or step == setting.steps):
            accuracy.append((step, evaluate(trainer.model.adapters)))
        if step == setting.steps:
            break
        sync(device)
        start = time.perf_counter()
        metrics = trainer.step(step)
        sync(device)
        step_times.append(time.perf_counter() - start)
        rewards.append(metrics["reward"])
    return {"step_times": step_times, "accuracy": accuracy, "rewards": rewards}


# --- TRL's ---------------------------------------------------------------------------------------------------------

def lora_pairs(peft_model, adapters) -> list[tuple[torch.Tensor, torch.Tensor, str]]:
    """(peft weight, our weight, name) for every A and B: peft's lora_A is [rank, d_in] and lora_B [d_out, rank],
    exactly our A and B, whatever GPT-2's Conv1D stores."""
    modules = dict(peft_model.named_modules())
    pairs = []
    for key, adapter in adapters.items():
        layer, target = key[1:].split("_", 1)
        module = next(m for name, m in modules.items() if name.endswith(f"h.{layer}.{HF_MODULES[target]}"))
        pairs += [(module.lora_A["default"].weight, adapter.A, f"{key}.A"),
                  (module.lora_B["default"].weight, adapter.B, f"{key}.B")]
    return pairs


def run_trl(setting: Setting, hf_model, tokenizer, device: torch.device, initial: dict, evaluate, eval_adapters,
            ) -> dict:
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import TrainerCallback
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer as TRLTrainer

    from solutions.production.trl_grpo import trl_reward_functions

    unknown = set(setting.lora_targets) - set(HF_MODULES)
    if unknown:
        raise ValueError(f"targets {sorted(unknown)} are fused in Hugging Face's GPT-2 (c_attn holds q, k and v), so "
                         f"peft cannot adapt them alone; compare on {sorted(HF_MODULES)}")
    peft_config = LoraConfig(r=setting.lora_rank, lora_alpha=setting.lora_alpha, lora_dropout=0.0, bias="none",
                             target_modules="|".join(rf".*\.{re.escape(HF_MODULES[t])}" for t in setting.lora_targets),
                             fan_in_fan_out=True, task_type="CAUSAL_LM")
    base = copy.deepcopy(hf_model).to(device)
    if setting.trl_fused_gelu:
        fuse_gelu(base)
    model = get_peft_model(base, peft_config)
    our_initial = copy.deepcopy(eval_adapters)
    our_initial.load_state_dict(initial)
    with torch.no_grad():  # the same starting A (and B = 0) as ours
        for theirs, ours, _ in lora_pairs(model, our_initial):
            theirs.copy_(ours)

    bos = tokenizer.bos_token  # our sampler starts every prompt with BOS; TRL gets it as text
    n_prompts = setting.steps * setting.n_prompts
    dataset = Dataset.from_dict({"prompt": [bos + p for p in prompt_stream(setting, n_prompts)]})

    reward_funcs = trl_reward_functions(ours_config(setting, device), bos)  # Part 3's rewards with TRL's signature (Part 7's script)
    weights = [1.0, setting.format_weight] if setting.task == "addition" else [1.0]

    def copy_to_eval():
        with torch.no_grad():
            for theirs, ours, _ in lora_pairs(model, eval_adapters):
                ours.copy_(theirs)
        return eval_adapters

    figures = {"step_times": [], "accuracy": [], "rewards": []}

    class Timer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            if evaluate:
                figures["accuracy"].append((0, evaluate(copy_to_eval())))

        def on_step_begin(self, args, state, control, **kwargs):
            sync(device)
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            sync(device)
            figures["step_times"].append(time.perf_counter() - self.start)
            step = state.global_step
            if evaluate and (step % setting.eval_every == 0 or step == setting.steps):
                figures["accuracy"].append((step, evaluate(copy_to_eval())))

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                figures["rewards"].append(logs["reward"])

    batch = setting.n_prompts * setting.group_size
    with tempfile.TemporaryDirectory() as out:
        args = TRLConfig(
            output_dir=out, max_steps=setting.steps, per_device_train_batch_size=batch,
            gradient_accumulation_steps=1, num_generations=setting.group_size, steps_per_generation=1,
            max_completion_length=setting.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
            learning_rate=setting.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
            max_grad_norm=1.0, beta=setting.beta, loss_type=setting.loss_type, epsilon=setting.epsilon,
            scale_rewards="group", num_iterations=1, reward_weights=weights, shuffle_dataset=False,
            bf16=False, gradient_checkpointing=False, use_cpu=device.type == "cpu", seed=setting.seed,
            report_to="none", logging_steps=1, save_strategy="no", disable_tqdm=True, log_completions=False,
            dataloader_num_workers=0)
        trainer = TRLTrainer(model=model, reward_funcs=reward_funcs, args=args, train_dataset=dataset,
                             processing_class=tokenizer, callbacks=[Timer()])
        trainer.train()
    return figures


# --- the comparison ---------------------------------------------------------------------------------------------

def check_same_model(hf_model, bridge, tokenizer, device: torch.device) -> float:
    """Max |logit difference| between the Hugging Face model and our bridge over a copy of it, on a prompt."""
    ids = torch.tensor([[tokenizer.bos_token_id] + tokenizer("12+34=", add_special_tokens=False).input_ids],
                       device=device)
    with torch.no_grad():
        return (bridge(ids) - hf_model.to(device)(ids).logits).abs().max().item()


def summarise(name: str, run: dict, setting: Setting) -> dict:
    times = run["step_times"]
    mean = statistics.fmean(times)
    reached = next((step for step, acc in run["accuracy"] if acc >= setting.target_accuracy), None)
    k = max(1, min(10, len(run["rewards"]) // 4))
    out = {f"{name}_step_s": round(mean, 4), f"{name}_step_median_s": round(statistics.median(times), 4),
           f"{name}_samples_per_s": round(setting.n_prompts * setting.group_size / mean, 1),
           f"{name}_total_s": round(sum(times), 1),
           f"{name}_reward_start": round(run["rewards"][0], 4) if run["rewards"] else None,
           f"{name}_reward_end": round(statistics.fmean(run["rewards"][-k:]), 4) if run["rewards"] else None}
    if run["accuracy"]:
        out |= {f"{name}_accuracy_start": round(run["accuracy"][0][1], 4),
                f"{name}_accuracy_end": round(run["accuracy"][-1][1], 4),
                f"{name}_accuracy_max": round(max(a for _, a in run["accuracy"]), 4),
                f"{name}_steps_to_target": reached,
                f"{name}_seconds_to_target": round(sum(times[:reached]), 1) if reached is not None else None}
    return out


def profiled(on: bool, name: str, fn, *args, sort: str = "cumulative", lines: int = 25):
    """fn(*args), and with `on`, the `lines` functions it spent the most time in (cProfile, sorted by `sort`)."""
    if not on:
        return fn(*args)
    import cProfile
    import io
    import pstats
    profile = cProfile.Profile()
    result = profile.runcall(fn, *args)
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats(sort).print_stats(lines)
    print(f"--- where {name} spends its time ---\n{text.getvalue()}")
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="GRPO step time and accuracy: ours against TRL's GRPOTrainer.")
    parser.add_argument("--preset", choices=["tiny", "gpt2"], default="tiny")
    parser.add_argument("--random-weights", action="store_true",
                        help="gpt2 preset: GPT-2 small's shapes with random weights (no download; timing only)")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--beta", type=float)
    parser.add_argument("--targets", help="comma-separated LoRA targets among o, mlp_in, mlp_out")
    parser.add_argument("--threads", type=int, help="torch threads on CPU (the same for both)")
    parser.add_argument("--only", choices=["ours", "trl"], help="run one side only (for profiling)")
    parser.add_argument("--engine", choices=["auto", "bridge"],
                        help="our sampler: auto (the lean decoder; the default) or bridge (TransformerLens's generate)")
    parser.add_argument("--trl-fused-gelu", action="store_true", help="give TRL's model our one-kernel GELU too")
    parser.add_argument("--trl-first", action="store_true", help="run TRL's side first (by default ours runs first)")
    parser.add_argument("--profile", action="store_true",
                        help="print where each side's steps spend their time (cProfile; on a GPU, set "
                             "CUDA_LAUNCH_BLOCKING=1 so that kernels are charged to the code that launched them)")
    parser.add_argument("--json", action="store_true", help="end with one line: a JSON object of the figures")
    args = parser.parse_args(argv)

    setting = Setting.gpt2() if args.preset == "gpt2" else Setting()
    overrides = {"steps": args.steps, "seed": args.seed, "beta": args.beta, "threads": args.threads,
                 "lora_targets": tuple(args.targets.split(",")) if args.targets else None, "engine": args.engine,
                 "trl_fused_gelu": args.trl_fused_gelu or None}
    setting = replace(setting, **{k: v for k, v in overrides.items() if v is not None})
    device = torch.device(setting.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    threads = set_cpu_threads(setting.threads) if device.type == "cpu" else None

    hf_model, tokenizer = load_hf(setting, args.random_weights)
    hf_model.eval()
    eval_base = bridge_from_hf(copy.deepcopy(hf_model), tokenizer, device)  # scores both sides' adapters
    logit_diff = check_same_model(hf_model, eval_base, tokenizer, device)
    if logit_diff > 1e-3:
        raise RuntimeError(f"the bridge and the Hugging Face model disagree by {logit_diff:.2e} in their logits")
    eval_model = LoRAModel(eval_base, make_adapters(eval_base, setting.lora_rank, setting.lora_alpha,
                                                    setting.lora_targets))
    held_out = addition_pairs("held_out")

    def evaluate(adapters) -> float:
        eval_model.adapters.load_state_dict(adapters.state_dict())
        return addition_accuracy(eval_model, held_out)

    evaluate = evaluate if setting.task == "addition" and setting.eval_every > 0 else None
    runs = {}
    print(f"ours: {setting.steps} steps of {setting.n_prompts} x {setting.group_size} on {device}", flush=True)
    trainer, initial = our_trainer(setting, hf_model, tokenizer, device)
    sides = {"ours": lambda: profiled(args.profile, "ours", run_ours, setting, trainer, device, evaluate),
             "trl": lambda: profiled(args.profile, "TRL", run_trl, setting, hf_model, tokenizer, device, initial,
                                     evaluate, eval_model.adapters)}
    for name in (["trl", "ours"] if args.trl_first else ["ours", "trl"]):
        if args.only in (None, name):
            print(f"{name}: {setting.steps} steps of {setting.n_prompts} x {setting.group_size} on {device}",
                  flush=True)
            runs[name] = sides[name]()

    figures = {"preset": setting.preset + ("-random" if args.random_weights else ""), "device": str(device),
               "threads": threads, "steps": setting.steps, "batch": f"{setting.n_prompts}x{setting.group_size}",
               "lora": f"rank {setting.lora_rank} on {','.join(setting.lora_targets)}", "beta": setting.beta,
               "engine": setting.engine, "trl_fused_gelu": setting.trl_fused_gelu, "trl_first": args.trl_first,
               "bridge_vs_hf_max_logit_diff": float(f"{logit_diff:.2e}")}
    for name, run in runs.items():
        figures |= summarise(name, run, setting)
    if "ours" in runs and "trl" in runs:
        figures["ratio"] = round(figures["ours_step_s"] / figures["trl_step_s"], 3)
        figures["ratio_median"] = round(figures["ours_step_median_s"] / figures["trl_step_median_s"], 3)
        if figures.get("ours_seconds_to_target") and figures.get("trl_seconds_to_target"):
            figures["ratio_to_target"] = round(figures["ours_seconds_to_target"] / figures["trl_seconds_to_target"], 3)
    print_table(figures, runs, setting)
    if args.json:
        print(json.dumps(figures))
    return figures


def print_table(figures: dict, runs: dict, setting: Setting) -> None:
    from tabulate import tabulate

    rows = []
    for name in runs:
        get = lambda key: figures.get(f"{name}_{key}")  # noqa: E731
        rows.append({"": name, "s/step (mean)": get("step_s"), "s/step (median)": get("step_median_s"),
                     "samples/s": get("samples_per_s"), "reward start -> end": f"{get('reward_start')} -> "
                     f"{get('reward_end')}", "held-out acc start -> end": f"{get('accuracy_start')} -> "
                     f"{get('accuracy_end')}" if get("accuracy_start") is not None else "-",
                     f"s to {setting.target_accuracy:.0%}": get("seconds_to_target")})
    print(tabulate(rows, headers="keys", tablefmt="simple_outline"))
    for key in ("ratio", "ratio_median", "ratio_to_target"):
        if key in figures:
            print(f"{key}: {figures[key]}  (ours / TRL)")


if __name__ == "__main__":
    main()
