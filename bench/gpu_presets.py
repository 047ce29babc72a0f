"""The GPU presets of Parts 1-3, a few updates each: seconds per update and peak GPU memory (a benchmark).

    python bench/gpu_presets.py                    # GPT-2 small (the Hub once, or a cached copy), e.g. on Colab
    python bench/gpu_presets.py --random-weights   # GPT-2 small's shapes, random weights: time and memory only
    python bench/gpu_presets.py --random-weights --cases grpo_qwen grpo_qwen_64x8 grpo_smollm2   # the real
                                                   # Llama-style models' shapes (utils/real_configs.py)
    python bench/gpu_presets.py --json             # ... ending with a JSON line of the figures
    python bench/gpu_presets.py --random-weights --saved-tensors --cases grpo_qwen grpo_smollm2   # no GPU needed:
                                                   # what a training step keeps for its backward pass, per completion

Each case builds its trainer from the preset the chapter's script uses (`--preset gpt2`, `--preset qwen`) and runs
it for a few phases (PPO) or steps (GRPO), in this process, one after the other:

    ppo_full        Part 1: PPOConfig.gpt2(), full fine-tuning, the reference a frozen copy
    ppo_lora        Part 2: the same PPO with a rank-8 LoRA on q, k, v, o; the reference is the base without hooks
    grpo_lora       Part 3: GRPOConfig.gpt2(), LoRA, beta 0.04 (so the hook-free reference runs)
    grpo_qwen       Part 3: GRPOConfig.qwen(), Qwen2.5-0.5B-Instruct, rank-16 LoRA on q, k, v, o, beta 0.04,
                    2 prompts x 8 completions x 128 new tokens
    grpo_qwen_64x8  the same with 64 prompts x 8 completions: one backward pass over 512 completions
    grpo_smollm2    GRPOConfig.qwen() on SmolLM2-135M

With random weights the rewards mean nothing (completions are random tokens, and run to the length limit); the
figures are the cost of an update at the preset's batch and lengths. The Llama-style models' random stand-ins are
`utils.real_configs.random_model`: their config.json's numbers, the embedded tokenizer grown to their vocabulary.
The first update of each case is left out of the per-update time. A case that runs out of GPU memory is reported
as such, with the peak it had reached, and the next case runs. `--saved-tensors` measures instead, on the CPU, the
bytes a GRPO case's training forward pass keeps for its backward pass (saved_for_backward): the same on every
device, it says how many completions one backward pass can hold before a GPU is at hand.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.grpo_vs_trl import Setting, load_hf, sync  # noqa: E402
from utils.models import bridge_from_hf, load_hub_hf  # noqa: E402
from utils.real_configs import random_model  # noqa: E402

QWEN, SMOLLM2 = "Qwen/Qwen2.5-0.5B-Instruct", "HuggingFaceTB/SmolLM2-135M"
# The model each case trains: "gpt2", or a Hub name of utils/real_configs.py.
CASES = {"ppo_full": "gpt2", "ppo_lora": "gpt2", "grpo_lora": "gpt2",
         "grpo_qwen": QWEN, "grpo_qwen_64x8": QWEN, "grpo_smollm2": SMOLLM2}


def timed_updates(update, n: int, device: torch.device) -> list[float]:
    times = []
    for i in range(n):
        sync(device)
        start = time.perf_counter()
        update(i)
        sync(device)
        times.append(time.perf_counter() - start)
    return times


def ppo_phase(trainer):
    """One PPO phase of Part 1's trainer, as its train() loop runs it."""
    def update(i: int) -> None:
        trainer.phase = i
        trainer.learning_phase(trainer.rollout_phase())
    return update


def grpo_config(case: str):
    """The GRPO preset of a case: GRPOConfig.gpt2() for GPT-2, GRPOConfig.qwen() (its model replaced) otherwise."""
    from solutions.part3_grpo import GRPOConfig

    if case == "grpo_lora":
        return GRPOConfig.gpt2()
    cfg = GRPOConfig.qwen(model=CASES[case])
    return replace(cfg, n_prompts=64) if case == "grpo_qwen_64x8" else cfg


def run_case(case: str, hf_model, tokenizer, device: torch.device, n: int, **overrides) -> dict:
    """`n` updates of the case's trainer on a copy of hf_model. overrides: fields of the case's config to replace
    (the CPU test's small batch); none for the benchmark."""
    from solutions.part1_ppo import PPOConfig, PPOTrainer
    from solutions.part2_lora import ppo_with_lora
    from solutions.part3_grpo import GRPOTrainer

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model = bridge_from_hf(copy.deepcopy(hf_model), tokenizer, device)
    if case in ("ppo_full", "ppo_lora"):
        cfg = PPOConfig.gpt2(phases=n, device=str(device), **({"lr_model": 1e-4} if case == "ppo_lora" else {}))
        cfg = replace(cfg, **overrides)
        trainer = PPOTrainer(cfg, model=model) if case == "ppo_full" else ppo_with_lora(cfg, model=model)[0]
        update, unit, batch = ppo_phase(trainer), "phase", f"{cfg.batch_size} samples x {cfg.max_new_tokens} tokens"
    elif case.startswith("grpo"):
        cfg = replace(grpo_config(case), steps=n, table_every=10**9, device=str(device), **overrides)
        trainer = GRPOTrainer(cfg, model=model)
        update, unit = trainer.step, "step"
        batch = f"{cfg.n_prompts} prompts x {cfg.group_size} x {cfg.max_new_tokens} tokens"
    else:
        raise ValueError(f"unknown case {case!r}; the cases are {', '.join(CASES)}")
    trainable = sum(p.numel() for group in trainer.optimizer.param_groups for p in group["params"])
    try:
        times = timed_updates(update, n, device)
    except torch.cuda.OutOfMemoryError:
        times = None  # the figures below say so; leaving this block frees what the failed update held
    trainer.logger.finish()
    peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None
    return {"case": case, "model": CASES[case], "unit": unit, "batch": batch, "trainable_params": trainable,
            "first_s": round(times[0], 2) if times else None,
            "per_update_s": round(statistics.median(times[1:] or times), 3) if times else None,
            "peak_gpu_mib": round(peak) if peak is not None else None, "out_of_memory": times is None}


def saved_for_backward(case: str, hf_model, tokenizer, rows: int = 2) -> dict:
    """What the training forward pass of a GRPO case keeps for its backward pass, per completion, on the CPU: the
    tensors autograd saves (the weights aside), with the LoRA of the case's preset, for `rows` completions of its
    full length (random tokens after a text prompt). A tensor takes the same bytes on every device, so this tells,
    without a GPU, how many completions one backward pass can hold; the peak adds the weights, the logits and the
    gradients of the backward pass itself."""
    from solutions.part0_warmup import get_logprobs
    from solutions.part2_lora import LoRAModel, freeze_base, make_adapters
    from solutions.part3_grpo import GRPOTrainer
    from utils.tokens import tokenize_prompts

    cfg = grpo_config(case)
    model = bridge_from_hf(copy.deepcopy(hf_model), tokenizer, "cpu")
    adapters = make_adapters(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets)
    freeze_base(model, adapters)
    prompt, _ = tokenize_prompts(model.tokenizer, [GRPOTrainer.TEXT_PROMPTS[0]] * rows, "cpu")
    ids = torch.cat([prompt, torch.randint(len(model.tokenizer), (rows, cfg.max_new_tokens))], dim=1)
    weights = {p.untyped_storage().data_ptr() for p in [*model.parameters(), *adapters.parameters()]}
    saved = {}  # storage -> bytes: views of one tensor count once

    def keep(tensor):
        if tensor.untyped_storage().data_ptr() not in weights:
            saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        logits = LoRAModel(model, adapters)(ids)
        get_logprobs(logits, ids, prompt.shape[1])
    return {"case": case, "model": CASES[case], "tokens": ids.shape[1], "lora": f"rank {cfg.lora_rank} on "
            f"{','.join(cfg.lora_targets)}", "saved_mib_per_completion": round(sum(saved.values()) / rows / 2**20, 1),
            "logits_mib_per_completion": round(logits[0].numel() * logits.element_size() / 2**20, 1),
            "completions_per_step": cfg.n_prompts * cfg.group_size}


def load_case_model(model: str, random_weights: bool, layers: int | None = None):
    """(Hugging Face model, tokenizer) for a case's model: from the Hub (or its cache), or of its shapes with random
    weights (`layers` of them; None: all)."""
    if model == "gpt2":
        return load_hf(Setting.gpt2(), random_weights)
    if random_weights:
        return random_model(model, n_layers=layers)
    return load_hub_hf(model, offline_choice=f"--random-weights ({model}'s shapes, random weights)")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="Seconds per update and peak GPU memory of the GPU presets.")
    parser.add_argument("--random-weights", action="store_true", help="the models' shapes, random weights")
    parser.add_argument("--layers", type=int, help="with --random-weights, the Llama-style models' layers "
                                                   "(default: all; fewer for a quick check of the code path)")
    parser.add_argument("--updates", type=int, default=4, help="phases (PPO) or steps (GRPO) per case")
    parser.add_argument("--cases", nargs="*", choices=list(CASES), default=["ppo_full", "ppo_lora", "grpo_lora"])
    parser.add_argument("--saved-tensors", action="store_true",
                        help="GRPO cases: instead of timing updates, what one training forward pass keeps for the "
                             "backward pass, per completion, measured on the CPU (saved_for_backward)")
    parser.add_argument("--json", action="store_true", help="end with one line: a JSON object of the figures")
    args = parser.parse_args(argv)
    if args.saved_tensors:
        return saved_tensors_main(args)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda":
        print("no GPU here: these presets are meant for one (they run, slowly, on CPU)", file=sys.stderr)
    models, rows = {}, []
    for case in args.cases:  # each model loaded once, when its first case comes
        if CASES[case] not in models:
            models[CASES[case]] = load_case_model(CASES[case], args.random_weights, args.layers)
        hf_model, tokenizer = models[CASES[case]]
        rows.append(run_case(case, hf_model.eval(), tokenizer, device, args.updates))

    from tabulate import tabulate
    print(tabulate(rows, headers="keys", tablefmt="simple_outline"))
    figures = {"models": list(models), "random_weights": args.random_weights, "layers": args.layers,
               "device": str(device), "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
               **{f"{r['case']}_{k}": r[k] for r in rows
                  for k in ("per_update_s", "first_s", "peak_gpu_mib", "trainable_params", "out_of_memory")}}
    if args.json:
        print(json.dumps(figures))
    return figures


def saved_tensors_main(args) -> dict:
    rows = []
    for case in (case for case in args.cases if case.startswith("grpo")):
        rows.append(saved_for_backward(case, *load_case_model(CASES[case], args.random_weights, args.layers)))

    from tabulate import tabulate
    print(tabulate(rows, headers="keys", tablefmt="simple_outline"))
    figures = {"random_weights": args.random_weights, "layers": args.layers,
               **{f"{r['case']}_{k}": r[k] for r in rows
                  for k in ("saved_mib_per_completion", "logits_mib_per_completion", "completions_per_step")}}
    if args.json:
        print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
