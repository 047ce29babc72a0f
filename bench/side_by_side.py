"""Two course processes on one small machine: how much does each slow the other down? (a benchmark, not a test)

    python bench/side_by_side.py            # the course's own thread policy, then the settings it chose between
    python bench/side_by_side.py --json     # ... ending with a JSON line of the figures

A learner runs a notebook kernel and, in a terminal, the tests or a script. Each is a torch process that sets its
thread count to the machine's cores (utils.models.set_cpu_threads). Torch's OpenMP threads spin-wait for each
other between operations; two such processes on 2 cores each spin on a core the other needs, and a step can take
many times longer. The fair share is 2×: two equal jobs side by side, each at half the machine, take twice as long
as one alone. Each figure here is (one worker's time side by side) / (the same worker's time alone), measured on
the same machine in the same run, so the machine's speed cancels out.

The worker is the main job's hot path: forward and backward passes of the embedded model on a GRPO-sized batch.
Every worker is a fresh process, because OpenMP reads its wait policy once, when torch is first imported.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the course on the path

from utils.checker.layout import ROOT  # noqa: E402

WORKER = """
import sys, time
sys.path.insert(0, {root!r})
import utils  # the course's thread policy applies from here on, as in a notebook or a script
import torch
from utils.models import load_model
model = load_model("tiny")
ids = torch.randint(0, 300, (128, 20))
def step():
    model.zero_grad(set_to_none=True)
    model(ids).logsumexp(-1).mean().backward()
step()  # warm-up
start = time.perf_counter()
for _ in range({steps}):
    step()
print(time.perf_counter() - start, torch.get_num_threads())
"""


def run_workers(n: int, steps: int, env: dict[str, str]) -> list[tuple[float, int]]:
    """Start n workers at once; return each one's (seconds for `steps` steps, torch threads)."""
    environ = {k: v for k, v in os.environ.items()
               if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "RLHF_THREADS")}
    environ.update(env)
    code = WORKER.format(root=str(ROOT), steps=steps)
    procs = [subprocess.Popen([sys.executable, "-c", code], env=environ, stdout=subprocess.PIPE, text=True)
             for _ in range(n)]
    results = []
    for proc in procs:
        out, _ = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"a worker failed (exit {proc.returncode})")
        seconds, threads = out.split()
        results.append((float(seconds), int(threads)))
    return results


SETTINGS = {
    "course policy": {},                                              # what importing utils sets (cpu_policy.py)
    "OpenMP's default spin": {"GOMP_SPINCOUNT": "300000"},            # GNU OpenMP's own default
    "no spinning (passive)": {"OMP_WAIT_POLICY": "PASSIVE"},
    "one thread each": {"RLHF_THREADS": "1"},
    "one thread each, default spin": {"RLHF_THREADS": "1", "GOMP_SPINCOUNT": "300000"},
    "spin 10,000": {"GOMP_SPINCOUNT": "10000"},
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    alone = run_workers(1, args.steps, {})[0][0]
    print(f"one worker alone, course policy: {alone:.2f} s for {args.steps} steps ({os.cpu_count()} cores)")
    figures = {"alone_s": round(alone, 2), "cores": os.cpu_count()}
    for name, env in SETTINGS.items():
        solo = run_workers(1, args.steps, env)[0][0]
        pair = run_workers(2, args.steps, env)
        slowest = max(seconds for seconds, _ in pair)
        threads = pair[0][1]
        ratio = slowest / solo
        print(f"{name:>30}: alone {solo:6.2f} s, side by side {slowest:6.2f} s (torch threads {threads}): "
              f"{ratio:4.1f}× its time alone (fair share 2.0×)")
        figures[name] = {"alone_s": round(solo, 2), "side_by_side_s": round(slowest, 2), "ratio": round(ratio, 2),
                         "threads": threads}
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
