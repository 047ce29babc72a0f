"""The GPU presets of Parts 1-3, a few updates each: seconds per update and peak GPU memory (a benchmark).

    python bench/gpu_presets.py                    # GPT-2 small (the Hub once, or a cached copy), e.g. on Colab
    python bench/gpu_presets.py --random-weights   # GPT-2 small's shapes, random weights: time and memory only
    python bench/gpu_presets.py --json             # ... ending with a JSON line of the figures

Each case builds its trainer from the preset the chapter's script uses (`--preset gpt2`) and runs it for a few
phases (PPO) or steps (GRPO), in this process, one after the other:

    ppo_full     Part 1: PPOConfig.gpt2(), full fine-tuning, the reference a frozen copy
    ppo_lora     Part 2: the same PPO with a rank-8 LoRA on q, k, v, o; the reference is the base without hooks
    grpo_lora    Part 3: GRPOConfig.gpt2(), LoRA, beta 0.04 (so the hook-free reference runs)

With random weights the rewards mean nothing (completions are random tokens); the figures are the cost of an
update at the preset's batch and lengths. The first update of each case is left out of the per-update time.
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
from utils.models import bridge_from_hf  # noqa: E402


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


def run_case(case: str, hf_model, tokenizer, device: torch.device, n: int) -> dict:
    from solutions.part1_ppo import PPOConfig, PPOTrainer
    from solutions.part2_lora import ppo_with_lora
    from solutions.part3_grpo import GRPOConfig, GRPOTrainer

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model = bridge_from_hf(copy.deepcopy(hf_model), tokenizer, device)
    if case in ("ppo_full", "ppo_lora"):
        cfg = PPOConfig.gpt2(phases=n, device=str(device), **({"lr_model": 1e-4} if case == "ppo_lora" else {}))
        trainer = PPOTrainer(cfg, model=model) if case == "ppo_full" else ppo_with_lora(cfg, model=model)[0]
        update, unit, batch = ppo_phase(trainer), "phase", f"{cfg.batch_size} samples x {cfg.max_new_tokens} tokens"
    elif case == "grpo_lora":
        cfg = replace(GRPOConfig.gpt2(), steps=n, table_every=10**9, device=str(device))
        trainer = GRPOTrainer(cfg, model=model)
        update, unit = trainer.step, "step"
        batch = f"{cfg.n_prompts} prompts x {cfg.group_size} x {cfg.max_new_tokens} tokens"
    else:
        raise ValueError(f"unknown case {case!r}")
    times = timed_updates(update, n, device)
    trainer.logger.finish()
    peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None
    return {"case": case, "unit": unit, "batch": batch, "first_s": round(times[0], 2),
            "per_update_s": round(statistics.median(times[1:] or times), 3),
            "peak_gpu_mib": round(peak) if peak is not None else None}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="Seconds per update and peak GPU memory of the GPT-2 presets.")
    parser.add_argument("--random-weights", action="store_true", help="GPT-2 small's shapes, random weights")
    parser.add_argument("--updates", type=int, default=4, help="phases (PPO) or steps (GRPO) per case")
    parser.add_argument("--cases", nargs="*", default=["ppo_full", "ppo_lora", "grpo_lora"])
    parser.add_argument("--json", action="store_true", help="end with one line: a JSON object of the figures")
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda":
        print("no GPU here: these presets are meant for one (they run, slowly, on CPU)", file=sys.stderr)
    hf_model, tokenizer = load_hf(Setting.gpt2(), args.random_weights)
    rows = [run_case(case, hf_model.eval(), tokenizer, device, args.updates) for case in args.cases]

    from tabulate import tabulate
    print(tabulate(rows, headers="keys", tablefmt="simple_outline"))
    figures = {"model": "gpt2" + ("-random" if args.random_weights else ""), "device": str(device),
               "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
               **{f"{r['case']}_{k}": r[k] for r in rows for k in ("per_update_s", "first_s", "peak_gpu_mib")}}
    if args.json:
        print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
