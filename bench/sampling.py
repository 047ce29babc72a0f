"""Sampling speed: our rollout sampler against raw Hugging Face `generate` on the same weights (a benchmark).

    python bench/sampling.py                        # the embedded tiny model (CPU, or GPU if there is one)
    python bench/sampling.py --preset gpt2 --random-weights   # GPT-2 small's shapes (a GPU recipe)
    python bench/sampling.py --json                 # ... ending with a JSON line of the figures

Ours is `utils.sampling.sample` as the trainers call it: with no hook active it decodes with `utils.decoder.LeanGPT2`
(the bridge's weights, a dozen operations per layer, each distinct prompt prefilled once). Beside it, the same
call with `engine="bridge"`: TransformerLens's `TransformerBridge.generate`, every hook point live, which is what
sampling costs while a hook (a steering vector, say) is on. Theirs is `GPT2LMHeadModel.generate` on an untouched
copy of the same weights, with the KV cache, sampling from the full softmax (top_k=0, temperature 1). Two
workloads:

    rollout   the GRPO main job's: 16 addition prompts x 8 completions, at most 5 new tokens, stop at EOS
    decode    128 rows of "This is", exactly 32 new tokens (no early stop on either side): decoding speed alone

Tokens per second count the completion tokens each side produced (up to and including EOS). Each repeat runs
both, alternating which goes first; the figures are medians over repeats.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.grpo_vs_trl import Setting, load_hf, profiled, prompt_stream, sync  # noqa: E402
from utils.models import bridge_from_hf, set_cpu_threads  # noqa: E402
from utils.sampling import completion_mask_from_ids, sample, tokenize_prompts  # noqa: E402

WORKLOADS = {  # name: (prompts, max_new_tokens, stop at EOS)
    "rollout": (lambda: [p for p in prompt_stream(Setting(), 16) for _ in range(8)], 5, True),
    "decode": (lambda: ["This is"] * 128, 32, False),
}


def ours(bridge, prompts, max_new_tokens, stop_at_eos, engine: str = "auto") -> int:
    out = sample(bridge, prompts, max_new_tokens=max_new_tokens, stop_at_eos=stop_at_eos, engine=engine)
    return int(out.completion_mask.sum()) if stop_at_eos else out.completion_ids.numel()


def raw_generate(hf_model, tokenizer, prompts, max_new_tokens, stop_at_eos) -> int:
    ids, mask = tokenize_prompts(tokenizer, prompts, hf_model.device)  # the same BOS + left padding as ours
    eos = tokenizer.eos_token_id
    out = hf_model.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                            max_new_tokens=max_new_tokens, min_new_tokens=0 if stop_at_eos else max_new_tokens,
                            eos_token_id=eos, pad_token_id=eos)
    completion = out[:, ids.shape[1]:]
    return int(completion_mask_from_ids(completion, eos).sum()) if stop_at_eos else completion.numel()


def measure(fn, device, repeats: int) -> tuple[list[float], list[int]]:
    times, tokens = [], []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        with torch.no_grad():
            tokens.append(fn())
        sync(device)
        times.append(time.perf_counter() - start)
    return times, tokens


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="Our sampler against raw Hugging Face generate, tokens per second.")
    parser.add_argument("--preset", choices=["tiny", "gpt2"], default="tiny")
    parser.add_argument("--random-weights", action="store_true", help="gpt2: GPT-2 small's shapes, random weights")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, help="torch threads on CPU")
    parser.add_argument("--profile", action="store_true", help="also print where our sampler spends its time")
    parser.add_argument("--json", action="store_true", help="end with one line: a JSON object of the figures")
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    threads = set_cpu_threads(args.threads) if device.type == "cpu" else None
    setting = Setting.gpt2() if args.preset == "gpt2" else Setting()
    hf_model, tokenizer = load_hf(setting, args.random_weights)
    hf_model = hf_model.eval()
    bridge = bridge_from_hf(copy.deepcopy(hf_model), tokenizer, device)  # the bridge rewires its own copy
    hf_model = hf_model.to(device)
    torch.manual_seed(0)

    figures = {"preset": args.preset + ("-random" if args.random_weights else ""), "device": str(device),
               "threads": threads, "repeats": args.repeats}
    rows = []
    for name, (make_prompts, max_new, stop) in WORKLOADS.items():
        prompts = make_prompts()
        runs = {"ours": lambda: ours(bridge, prompts, max_new, stop),
                "bridge": lambda: ours(bridge, prompts, max_new, stop, engine="bridge"),
                "hf": lambda: raw_generate(hf_model, tokenizer, prompts, max_new, stop)}
        for fn in runs.values():
            measure(fn, device, 2)  # warm-up
        times = {key: [] for key in runs}
        tokens = {key: [] for key in runs}
        for r in range(args.repeats):  # rotate which goes first
            order = list(runs)[r % 3:] + list(runs)[:r % 3]
            for key in order:
                t, n = measure(runs[key], device, 1)
                times[key] += t
                tokens[key] += n
        tps = {key: statistics.median(n / t for n, t in zip(tokens[key], times[key])) for key in runs}
        for key in runs:
            figures[f"{name}_{key}_tokens_per_s"] = round(tps[key])
            figures[f"{name}_{key}_ms"] = round(1000 * statistics.median(times[key]), 1)
        figures[f"{name}_ratio"] = round(tps["ours"] / tps["hf"], 3)
        figures[f"{name}_bridge_ratio"] = round(tps["bridge"] / tps["hf"], 3)
        rows.append({"workload": f"{name}: {len(prompts)} rows, {max_new} new tokens"
                     f"{', stop at EOS' if stop else ''}", "ours tokens/s": round(tps["ours"]),
                     "ours, engine='bridge'": round(tps["bridge"]), "HF generate tokens/s": round(tps["hf"]),
                     "ratio (ours / HF)": figures[f"{name}_ratio"],
                     "bridge / HF": figures[f"{name}_bridge_ratio"]})
        if args.profile:
            profiled(True, f"our sampler ({name})", runs["ours"], sort="tottime", lines=12)

    from tabulate import tabulate
    print(tabulate(rows, headers="keys", tablefmt="simple_outline"))
    if args.json:
        print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
