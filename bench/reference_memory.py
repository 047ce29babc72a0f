"""Peak memory of one RLHF training step, by the form of its reference model (a benchmark, not a test).

    python bench/reference_memory.py                 # tiny model and a GPT-2-small-sized one, on CPU or GPU
    python bench/reference_memory.py --json          # ... ending with a JSON line of the figures

Each case runs in a fresh subprocess and makes two optimiser steps (so Adam's state exists) of: a policy forward
pass with a value head and backward, and the reference's log-probs of the same tokens for a KL term. Cases:

    lora_hooks      LoRA policy; the reference is the same module with the hooks removed (Part 2)
    none            LoRA policy, beta == 0: no reference forward pass at all
    old_adapter     LoRA policy re-training an adapter: the base with a frozen copy of the old adapter's hooks
    precomputed     LoRA policy; reference log-probs looked up in a table computed before training
    lora_copy       the same LoRA step, but with a frozen full copy of the model as the reference
    full_copy       full fine-tuning with a frozen full copy as the reference (Part 1)

Memory is the peak of torch.cuda.max_memory_allocated on a GPU. On CPU it is the process's peak resident set size
during the two steps (Linux's VmHWM, reset once the models are built) less its size after imports: it counts
allocator slack and the bridge's own overhead too, so it is rough for the tiny model, whose weights are 3 MB, and
clear for the GPT-2-sized one.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the course on the path

CASES = ("lora_hooks", "none", "old_adapter", "precomputed", "lora_copy", "full_copy")


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def reset_peak_rss() -> bool:
    """Linux resets a process's peak resident set size (VmHWM) when "5" is written to clear_refs."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_case(case: str, size: str, device: str, batch: int, seq: int) -> dict:
    import copy

    import torch
    from transformers import GPT2LMHeadModel

    from solutions.part1_ppo import PolicyWithValueHead
    from solutions.part2_lora import LoRAModel, freeze_base, make_adapters
    from utils.models import bridge_from_hf, count_parameters, load_tiny_hf, set_cpu_threads, tiny_hf_config

    set_cpu_threads()
    torch.manual_seed(0)
    baseline = rss_mib()
    hf_model, tokenizer = load_tiny_hf()
    if size == "gpt2":  # GPT-2 small's shapes, random weights: memory is all we measure
        hf_model = GPT2LMHeadModel(tiny_hf_config(50257, tokenizer.eos_token_id, d_model=768, n_layers=12,
                                                  n_heads=12, n_ctx=1024))
    hf_model.eval()
    base = bridge_from_hf(hf_model, tokenizer, device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()

    from solutions.part0_warmup import get_logprobs
    from solutions.part2_lora import lora_hooks
    from solutions.part4_reference import frozen_adapter_copy

    old_adapters = None
    if case == "full_copy":
        reference = copy.deepcopy(base).requires_grad_(False)
        model = base
    else:
        adapters = make_adapters(base, rank=8, alpha=16.0)
        freeze_base(base, adapters)
        model = LoRAModel(base, adapters)
        reference = copy.deepcopy(base).requires_grad_(False) if case == "lora_copy" else base
        if case == "old_adapter":
            old_adapters = frozen_adapter_copy(adapters)
    policy = PolicyWithValueHead(model).to(device)
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    tokens = torch.randint(0, len(tokenizer) - 1, (batch, seq), device=device)
    mask = torch.ones(batch, seq - 1, dtype=torch.bool, device=device)
    table = None
    if case == "precomputed":  # computed once, before training: the table is all that stays
        with torch.no_grad():
            table = get_logprobs(reference(tokens), tokens)
    if device == "cpu":
        reset_peak_rss()  # building the models has its own transient peak; measure the training steps only
    for _ in range(2):
        logits, values = policy(tokens)
        logprobs = get_logprobs(logits, tokens)
        if case == "none":
            kl = torch.zeros_like(logprobs)
        elif case == "precomputed":
            kl = logprobs - table
        else:
            with torch.no_grad():
                hooks = lora_hooks(base, old_adapters) if old_adapters is not None else []
                with base.hooks(fwd_hooks=hooks):
                    ref_logprobs = get_logprobs(reference(tokens), tokens)
            kl = logprobs - ref_logprobs  # the sampled-token (k1) form, as GRPO and RLOO use
        loss = (kl * mask).mean() + values.pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = peak_rss_mib() - baseline
    # count_parameters leaves out the bridge's fused c_attn copy, which requires grad but never computes anything.
    return {"case": case, "size": size, "device": device, "peak_mib": round(peak, 1),
            "trainable_params": count_parameters(policy, trainable_only=True)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["tiny", "gpt2"], choices=["tiny", "gpt2"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--_case", nargs=2, help=argparse.SUPPRESS)  # internal: run one case, print its JSON
    args = parser.parse_args(argv)

    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args._case:
        print(json.dumps(run_case(args._case[0], args._case[1], device, args.batch, args.seq)))
        return {}

    from tabulate import tabulate

    rows = []
    for size in args.sizes:
        results = {}
        for case in CASES:
            out = subprocess.run([sys.executable, __file__, "--_case", case, size, "--device", device, "--batch",
                                  str(args.batch), "--seq", str(args.seq)], capture_output=True, text=True,
                                 env={**os.environ, "HF_HUB_OFFLINE": "1"})
            if out.returncode != 0:
                raise RuntimeError(f"case {case} on {size} failed:\n{out.stderr[-3000:]}")
            results[case] = json.loads(out.stdout.strip().splitlines()[-1])
        hooks = results["lora_hooks"]["peak_mib"]
        for case in CASES:
            r = results[case]
            rows.append({"model": size, "reference": case, "peak MiB": r["peak_mib"],
                         "ratio to lora_hooks": round(r["peak_mib"] / hooks, 2), "trainable": r["trainable_params"]})
    print(f"peak memory of a training step (batch {args.batch} x {args.seq} tokens, {device})")
    print(tabulate(rows, headers="keys", tablefmt="simple_outline"))
    figures = {f"{r['model']}_{r['reference']}_mib": r["peak MiB"] for r in rows}
    figures |= {f"{r['model']}_{r['reference']}_ratio": r["ratio to lora_hooks"] for r in rows}
    figures["device"] = device
    if args.json:
        print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
