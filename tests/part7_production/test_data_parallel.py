"""Data parallelism, measured on this machine: the TRL script (solutions/production/trl_grpo.py) under `accelerate
launch --config_file cpu_2proc.yaml`, two CPU processes talking over gloo. It trains; its two processes sample for
different prompts (together, each step's prompts, each group_size times); and each step of 2 processes × b
completions makes the update that 1 process × 2b completions makes on the same completions, to float rounding.

The processes sample with different seeds (TRL seeds each with seed + its rank), so the one-process run cannot draw
the same completions itself: it replays them (`--replay`, the two processes' rows in rank order) and the comparison is
of what the trainer does with them: the gradient the optimizer takes (DDP's average over the processes against the
one process's), the gradient norm TRL logs, and the weights after the step. Two steps are compared, because the
first alone is weak: with B = 0 at the start, A's gradient is exactly zero, and Adam's first step is lr × sign(g) for
every entry, blind to how the gradient is scaled; the gradients themselves are not.

Slow (about a minute on 2 cores: two launches, most of it imports); skipped without TRL."""

import json
import os
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import replace

import pytest
import torch

from solutions.part3_grpo import GRPOConfig
from tests.part7_production.common import ACCELERATE_CONFIGS, EXTRAS
from tests.support import assert_close, assert_equal, expect
from utils.checker.layout import ROOT

pytest.importorskip("trl", reason=f"trl is not installed: {EXTRAS}")
pytestmark = pytest.mark.slow

STEPS = 2
CFG = replace(GRPOConfig(), steps=STEPS)  # what the script trains with --steps 2 (RLHF_SMOKE changes only eval_every)


def free_port() -> int:
    """A port no one listens on now, for the processes' rendezvous (accelerate's default, 29500, may be taken)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(command: list[str]) -> tuple[dict, float]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RLHF_SMOKE": "1"}
    start = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env, timeout=900)
    expect(result.returncode == 0, " ".join(command[:8]), f"failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1]), time.perf_counter() - start


# Grouped for pytest-xdist (the README's `--dist loadgroup`), with a session's fixture: the two-process run once for
# these tests (see tests/checker/test_gradebook.py).
pytestmark = pytest.mark.xdist_group("data_parallel")


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    """The two-process run (recorded), then one process replaying its completions (recorded too)."""
    from solutions.production.trl_grpo import read_record

    folder = tmp_path_factory.mktemp("data_parallel")
    script = ["-m", "solutions.production.trl_grpo", "--trl-only", "--steps", str(STEPS), "--json", "--plot", ""]
    two, two_seconds = run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                            str(ACCELERATE_CONFIGS / "cpu_2proc.yaml"), "--main_process_port", str(free_port()),
                            *script, "--record", str(folder / "two")])
    one, one_seconds = run([sys.executable, *script, "--replay", str(folder / "two"), "--record", str(folder / "one")])
    print(f"2 processes: {two_seconds:.0f} s, 1 process replaying them: {one_seconds:.0f} s")
    return {"figures": (two, one), "two": read_record(folder / "two"), "one": read_record(folder / "one")[0]}


def test_cpu_2proc_config_starts_two_processes_on_the_cpu():
    """cpu_2proc.yaml, read by accelerate's own reader: MULTI_GPU (the type whose launcher starts the processes,
    through torch.distributed.run; MULTI_CPU would need mpirun), 2 processes, on the CPU, float32."""
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(ACCELERATE_CONFIGS / "cpu_2proc.yaml"))
    assert_equal((config.distributed_type.value, config.num_processes, config.use_cpu, config.mixed_precision),
                 ("MULTI_GPU", 2, True, "no"), "cpu_2proc.yaml: (distributed_type, num_processes, use_cpu, "
                 "mixed_precision)")
    expect(CFG.n_prompts * CFG.group_size % config.num_processes == 0, "cpu_2proc.yaml's num_processes",
           "does not divide a step's completions", config.num_processes)


def test_two_processes_train_one_model(runs):
    """Both processes ran, both took STEPS optimizer steps, the LoRA moved, and DDP kept the two copies equal: the
    same (averaged) gradient and the same weights on both after every step."""
    two, _ = runs["figures"]
    assert_equal((two["processes"], two["steps"], two["trl_trainable_params"]), (2, STEPS, 8192),
                 "the launched run's (processes, steps, LoRA parameters)")
    rank0, rank1 = runs["two"]
    assert_equal((len(rank0["updates"]), len(rank1["updates"])), (STEPS, STEPS), "optimizer steps on each process")
    last = rank0["updates"][-1]["weights"]
    moved = max((last[n] - w).abs().max().item() for n, w in rank0["initial"].items())
    expect(moved > 1e-3, "the LoRA after training", "did not move: nothing was trained", moved)
    for step, (u0, u1) in enumerate(zip(rank0["updates"], rank1["updates"])):
        for name in u0["grad"]:
            assert_close(u1["grad"][name], u0["grad"][name], f"step {step}: {name}'s gradient on process 1 against "
                         "process 0", atol=0, rtol=0, hint="DDP averages the gradients: both must hold the same")
            assert_close(u1["weights"][name], u0["weights"][name], f"step {step}: {name} on process 1 against "
                         "process 0", atol=0, rtol=0)


def test_the_two_processes_sample_for_different_prompts(runs):
    """Each step, the two processes' prompts have none in common and together are the step's n_prompts prompts
    (the ones our trainer draws), each group_size times: half of the step's completions each."""
    from solutions.production.trl_grpo import training_prompts

    prompts = training_prompts(CFG)
    for step in range(STEPS):
        seen = [Counter(rank["rollouts"][step]["prompts"]) for rank in runs["two"]]
        assert_equal(sorted(set(seen[0]) & set(seen[1])), [], f"step {step}: prompts both processes sampled for")
        assert_equal([sum(c.values()) for c in seen], [CFG.n_prompts * CFG.group_size // 2] * 2,
                     f"step {step}: completions per process")
        step_prompts = prompts[step * CFG.n_prompts:(step + 1) * CFG.n_prompts]
        assert_equal(dict(seen[0] + seen[1]), {p: CFG.group_size for p in step_prompts},
                     f"step {step}: the two processes' prompts together, with their counts")


def test_two_processes_times_b_make_the_update_of_one_process_times_2b(runs):
    """On the same completions, each step's gradient (as the optimizer takes it), gradient norm and new weights are
    the same on 2 processes × 64 completions as on 1 process × 128, to float rounding (observed: gradients to a
    relative 1e-6, weights to 1e-6 while a step moves them by about 3e-3)."""
    rank0, rank1 = runs["two"]
    one = runs["one"]
    assert_equal((one["world_size"], len(one["updates"])), (1, STEPS), "the replaying run's (processes, steps)")
    for step in range(STEPS):
        assert_equal(one["rollouts"][step]["prompt_ids"],
                     rank0["rollouts"][step]["prompt_ids"] + rank1["rollouts"][step]["prompt_ids"],
                     f"step {step}: the one process's prompts against the two's, in rank order")
        assert_equal(one["rollouts"][step]["completion_ids"],
                     rank0["rollouts"][step]["completion_ids"] + rank1["rollouts"][step]["completion_ids"],
                     f"step {step}: the one process's completions against the two's")
    for name, weight in one["initial"].items():
        assert_close(weight, rank0["initial"][name], f"{name} before training, 1 process against 2", atol=0, rtol=0)
    for step, (two, ours) in enumerate(zip(rank0["updates"], one["updates"])):
        assert_close(torch.tensor(two["grad_norm"]), torch.tensor(ours["grad_norm"]),
                     f"step {step}: the gradient norm TRL logs, 2 processes × 64 against 1 × 128", atol=0, rtol=1e-5)
        for name in ours["grad"]:
            scale = ours["grad"][name].abs().max().item()
            if step > 0 or ".lora_B." in name:  # at step 0, B = 0 makes A's gradient exactly 0
                expect(scale > 1e-4, f"step {step}: {name}'s gradient", "is (nearly) zero: nothing to compare", scale)
            assert_close(two["grad"][name], ours["grad"][name],
                         f"step {step}: {name}'s gradient, 2 processes × 64 completions against 1 × 128",
                         atol=1e-6, rtol=1e-4, hint="a gradient summed over the processes is twice this one, one "
                         "process's own is that of its half of the batch")
            assert_close(two["weights"][name], ours["weights"][name],
                         f"step {step}: {name} after the step, 2 processes × 64 against 1 × 128", atol=1e-5, rtol=0)
