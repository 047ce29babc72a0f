"""What the run-time contracts cost: the main job's GRPO step, and single calls of the loss functions, with the
solutions' checks on (the default: jaxtyping + beartype shapes, and utils/contracts.py's values) and off
(RLHF_SHAPE_CHECKS=0 RLHF_VALUE_CHECKS=0), each in its own process (the checks are installed when `solutions` is
imported). A benchmark, not a test.

    python bench/shape_checks.py            # 20 GRPO steps of the main job's settings, 3 processes each way
    python bench/shape_checks.py --json     # ... ending with a JSON line of the figures
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the course on the path

from utils.checker.layout import ROOT  # noqa: E402

MEASURE = """
import json, sys, time, timeit
sys.path.insert(0, {root!r})
import torch
from solutions import part3_grpo as g
from solutions.part0_warmup import get_logprobs
torch.manual_seed(0)
lp, mask, adv = torch.randn(128, 5), torch.ones(128, 5, dtype=torch.bool), torch.randn(128)
logits, tokens = torch.randn(128, 12, 356), torch.randint(0, 356, (128, 12))
calls = {{
    "grpo_loss_us": lambda: g.grpo_loss(lp, None, None, adv, mask),
    "group_advantages_us": lambda: g.group_advantages(adv, 8),
    "get_logprobs_us": lambda: get_logprobs(logits, tokens, 7),
}}
out = {{k: min(timeit.repeat(f, number=200, repeat=5)) / 200 * 1e6 for k, f in calls.items()}}
trainer = g.GRPOTrainer(g.GRPOConfig(steps={steps}, eval_every=0, table_every=10**6))
trainer.step(0)  # warm-up
start = time.perf_counter()
for step in range(1, {steps} + 1):
    trainer.step(step)
out["step_s"] = (time.perf_counter() - start) / {steps}
print(json.dumps(out))
"""


def measure(checks: bool, steps: int) -> dict:
    flag = "1" if checks else "0"
    env = {**os.environ, "RLHF_SHAPE_CHECKS": flag, "RLHF_VALUE_CHECKS": flag, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", MEASURE.format(root=str(ROOT), steps=steps)], env=env,
                            capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3, help="processes each way, alternating; medians reported")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    runs = {True: [], False: []}
    for _ in range(args.repeats):  # alternate, so that a slower phase of the machine hits both sides
        for checks in (True, False):
            runs[checks].append(measure(checks, args.steps))
    on, off = ({k: statistics.median(r[k] for r in runs[c]) for k in runs[c][0]} for c in (True, False))
    figures = {f"{k}_checked": round(v, 4 if k == "step_s" else 1) for k, v in on.items()}
    figures |= {f"{k}_unchecked": round(v, 4 if k == "step_s" else 1) for k, v in off.items()}
    figures["step_ratio"] = round(on["step_s"] / off["step_s"], 3)
    for k, v in figures.items():
        print(f"{k:28s} {v}")
    if args.json:
        print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
