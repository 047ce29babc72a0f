"""The main job (solutions/part3_grpo.py) trained with TRL's GRPOTrainer and a peft LoRA, next to ours.

    python -m solutions.production.trl_grpo                       # TRL's run, then ours: held-out accuracy of both
    python -m solutions.production.trl_grpo --steps 30 --seed 1 --json
    python -m solutions.production.trl_grpo --trl-only            # TRL's run alone
    python -m solutions.production.trl_grpo --model tiny-llama    # on the Llama-style model (its preset: LoRA on
                                                                  # every projection, 200 steps)
    accelerate launch --config_file solutions/production/accelerate_configs/cpu_1proc.yaml \\
        -m solutions.production.trl_grpo --trl-only --steps 5    # the same, under accelerate
    accelerate launch --config_file solutions/production/accelerate_configs/cpu_2proc.yaml \\
        -m solutions.production.trl_grpo --trl-only --steps 5    # two CPU processes, data parallel (gloo)
    accelerate launch --config_file solutions/production/accelerate_configs/multi_gpu_ddp.yaml \\
        -m solutions.production.trl_grpo --trl-only --vllm colocate   # GPUs only: not run for the course

On several processes only TRL's run is made (ours is one process), and under ZeRO-3 or FSDP no held-out accuracy is
measured during training (the weights are sharded). The GPU commands are in Part 7's notebook, section 4.
`--record FOLDER` writes what each process sampled and did (each step's prompts and completions, the gradient the
optimizer took, the weights after it), and `--replay FOLDER` trains on such a record's completions instead of sampling:
with both, tests/part7_production/test_data_parallel.py checks that 2 processes × b completions make the update that
1 process × 2b makes.

Needs `pip install -r requirements-bench.txt` (TRL, peft, accelerate); offline, on an embedded tiny model.

What is the same on both sides: the model (an embedded tiny model; TRL gets it as the plain Hugging Face
GPT2LMHeadModel or LlamaForCausalLM it is stored as), the prompts (the training additions our GRPOTrainer draws for
this seed, in its order), the reward functions (Part 3's reward_exact_answer and reward_format, weights 1 and
format_weight), and every knob of our GRPOConfig, translated by `solutions.part7_production.to_trl_config` (the
table: solutions/production/knobs.py). Held-out accuracy is measured for both by the same function,
`utils.data.addition_accuracy` (greedy, the 810 additions never trained on): for TRL, on a copy of its model with
the LoRA merged by peft (`merge_and_unload`), wrapped in a TransformerBridge.

What differs, and cannot be made the same:
- the LoRA, on GPT-2. Ours adapts q and v separately; GPT-2 computes q, k and v with one fused matrix
  (attn.c_attn), so peft adapts the three together: one shared A of rank 4 and one B for all three outputs. Same
  number of trainable parameters (8,192), not the same function: k is adapted too, and q and v share their input
  projection. On the Llama-style model (--model tiny-llama) every target is its own nn.Linear (q_proj, k_proj,
  v_proj, o_proj, gate_proj, up_proj, down_proj): there peft's LoRA is ours, module for module.
- the random numbers: TRL's sampling and peft's initial A draw their own, from the same seed.
- the sampler and the kernels: TRL samples with Hugging Face's `generate`, ours with its own decoder.
"""

from __future__ import annotations

import copy
import os
import random
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from solutions.part3_grpo import PRESETS, GRPOConfig, GRPOTrainer, reward_exact_answer, reward_format
from solutions.part1_ppo import reward_char_count
from solutions.part7_production import to_lora_config, to_trl_config
from utils.data import addition_accuracy, addition_pairs, addition_prompt
from utils import cli
from utils.logger import RunLogger, print_figures, tqdm
from utils.models import EMBEDDED, bridge_from_hf, count_parameters, load_tiny_hf, set_cpu_threads
from utils.plotting import pyplot_for

MISSING = "TRL is not installed: pip install -r requirements-bench.txt (trl, peft, accelerate)"


def trl_available() -> bool:
    try:
        import peft  # noqa: F401
        import trl  # noqa: F401
    except ImportError:
        return False
    return True


def training_prompts(cfg: GRPOConfig) -> list[str]:
    """The prompts our GRPOTrainer trains on with this config, in its order: cfg.steps draws of cfg.n_prompts
    training additions (GRPOTrainer.next_prompts: without replacement within a step, from random.Random(seed))."""
    if cfg.task != "addition":
        raise ValueError(f"cfg.task must be 'addition' (the task with a held-out accuracy), got {cfg.task!r}")
    rng, pairs = random.Random(cfg.seed), addition_pairs("train")
    return [addition_prompt(a, b) for _ in range(cfg.steps) for a, b in rng.sample(pairs, cfg.n_prompts)]


def trl_reward_functions(cfg: GRPOConfig, bos: str) -> list:
    """Part 3's reward functions with TRL's signature, f(prompts, completions, **kwargs) -> list of floats, in the
    order of to_trl_config's reward_weights. TRL's prompts carry the BOS text our sampler adds as a token."""
    def strip(prompts):
        return [p.removeprefix(bos) for p in prompts]

    def exact_answer(prompts, completions, **kwargs):
        return reward_exact_answer(strip(prompts), completions)

    def answer_format(prompts, completions, **kwargs):
        return reward_format(strip(prompts), completions)

    def periods(prompts, completions, **kwargs):
        return reward_char_count(completions).tolist()

    return [exact_answer, answer_format] if cfg.task == "addition" else [periods]


def held_out_accuracy(peft_model, tokenizer) -> float:
    """addition_accuracy of a peft model: on a copy with its LoRA merged into the weights, as a TransformerBridge.

    The global random state is left as it was (building a bridge draws from it), so that how often the accuracy is
    measured does not change what TRL samples."""
    device = next(peft_model.parameters()).device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        merged = copy.deepcopy(peft_model).merge_and_unload()
        return addition_accuracy(bridge_from_hf(merged, tokenizer, device), addition_pairs("held_out"))


def world() -> tuple[int, int]:
    """(number of processes, this one's rank), as `accelerate launch` (or torchrun) sets them."""
    return int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))


def trainable_weights(model) -> dict[str, torch.Tensor]:
    """A copy of the trainable parameters (the LoRA's), by name."""
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}


def read_record(folder: str | Path) -> list[dict]:
    """The files `--record folder` wrote, one per process, in rank order (see run_trl)."""
    files = sorted(Path(folder).glob("rank*.pt"), key=lambda f: int(f.stem.removeprefix("rank")))
    runs = [torch.load(f, weights_only=True) for f in files]
    if not runs or [r["rank"] for r in runs] != list(range(runs[0]["world_size"])):
        raise ValueError(f"{folder} must hold rank0.pt ... rank<N-1>.pt of one --record run, "
                         f"found {[f.name for f in files]}")
    return runs


def replayed_rollouts(folder: str | Path) -> list[tuple[list, list]]:
    """Each generation of a --record folder as (prompt ids, completion ids), all its processes' rows in rank order:
    the batch that one process draws when it alone trains on what several did (accelerate's data loader hands the
    first process the first rows of each step's batch from TRL's sampler, the second the next, and so on)."""
    runs = read_record(folder)
    return [([row for run in runs for row in run["rollouts"][i]["prompt_ids"]],
             [row for run in runs for row in run["rollouts"][i]["completion_ids"]])
            for i in range(min(len(run["rollouts"]) for run in runs))]


def run_trl(cfg: GRPOConfig, save: str | Path | None = None, translate=to_trl_config, *,
            record: str | Path | None = None, replay: str | Path | None = None, **trl_settings) -> dict:
    """Train cfg's run with TRL's GRPOTrainer and a peft LoRA, on the embedded model cfg.model names ("tiny" or
    "tiny-llama"). `translate(cfg, output_dir, world_size)` makes trl.GRPOConfig's arguments (the notebook passes
    yours); `trl_settings` are more of them (e.g. use_vllm=True), and `save` a folder for the trained adapter.

    record: a folder where each process writes rank<r>.pt: {"rank", "world_size", "initial": the LoRA's weights
        before training, "rollouts": per generation, this process's "prompts" (text), "prompt_ids" and
        "completion_ids", "updates": per optimizer step, the LoRA's "grad" as the optimizer takes it (averaged over
        the processes, clipped), the logged "grad_norm" (before clipping) and the "weights" after the step}.
    replay: a folder that `record` wrote: sample nothing, and train on its completions instead (this process's
        share of all its processes' rows, in rank order); a ValueError if the prompts differ from the recorded ones.
    Both go through TRL 1.16's GRPOTrainer._generate_single_turn (a private method: the one that samples).

    Returns {"logger": a RunLogger whose history has the reward every step and the held-out accuracy every
    cfg.eval_every steps (on the main process), "seconds" and "cpu_seconds": the training's wall and CPU time,
    accuracy evaluations excluded, "trainable": the LoRA's parameter count}."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import PrinterCallback, ProgressCallback, TrainerCallback
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer as TRLTrainer

    if cfg.model not in EMBEDDED:
        raise ValueError(f"run_trl trains an embedded model (cfg.model one of {', '.join(EMBEDDED)}), got "
                         f"{cfg.model!r}")
    world_size, rank = world()
    torch.manual_seed(cfg.seed)  # peft's initial A
    hf_model, tokenizer = load_tiny_hf(EMBEDDED[cfg.model][0])
    bos = tokenizer.bos_token
    dataset = Dataset.from_dict({"prompt": [bos + p for p in training_prompts(cfg)]})
    logger = RunLogger()  # no wandb here: TRL reports to it itself (report_to)
    timing = {"eval_seconds": 0.0, "eval_cpu_seconds": 0.0}
    mu = cfg.num_iterations  # TRL counts optimizer steps: mu of them per batch of rollouts

    class HeldOutAccuracy(TrainerCallback):
        """Our step's figures: TRL's mean reward each step, greedy held-out accuracy every cfg.eval_every steps."""

        def evaluate(self, state, model, step):
            if cfg.eval_every and state.is_world_process_zero and (step % cfg.eval_every == 0 or step == cfg.steps):
                start, cpu_start = time.perf_counter(), time.process_time()
                logger.log({"accuracy": held_out_accuracy(model, tokenizer)}, step=step)
                timing["eval_seconds"] += time.perf_counter() - start
                timing["eval_cpu_seconds"] += time.process_time() - cpu_start

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.bar = tqdm(total=cfg.steps, desc="TRL GRPO steps", disable=not state.is_world_process_zero)
            self.evaluate(state, model, 0)

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step % mu == 0:
                self.bar.update(1)
                self.evaluate(state, model, state.global_step // mu)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs and state.is_world_process_zero:
                logger.log({"reward": logs["reward"]}, step=(state.global_step - 1) // mu)
                self.bar.set_postfix({"reward": f"{logs['reward']:.3f}"})

        def on_train_end(self, args, state, control, **kwargs):
            self.bar.close()

    recorded = {"rank": rank, "world_size": world_size, "initial": {}, "rollouts": [], "updates": []}
    rollouts = replayed_rollouts(replay) if replay else None

    class RecordingTrainer(TRLTrainer):
        """TRL's trainer, whose sampling (one completion per row of prompt_ids) is recorded, or replayed."""

        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, *rest, **kwargs):
            if rollouts is None:
                completion_ids, logprobs = super()._generate_single_turn(prompt_ids, images, multimodal_fields,
                                                                         num_generations, *rest, **kwargs)
            else:
                step, rows = len(recorded["rollouts"]), len(prompt_ids)
                if step >= len(rollouts):
                    raise ValueError(f"--replay {replay}: the record has {len(rollouts)} steps, this run needs more")
                recorded_prompts, recorded_completions = rollouts[step]
                share = slice(rank * rows, (rank + 1) * rows)
                if [list(p) for p in prompt_ids] != recorded_prompts[share] or len(recorded_prompts) != rows * \
                        world_size:
                    raise ValueError(f"--replay {replay}: step {step}'s prompts on process {rank} are not the "
                                     "recorded ones (another seed, or another number of prompts per step?)")
                completion_ids, logprobs = recorded_completions[share], None  # logprobs: vLLM's only
            recorded["rollouts"].append({
                "prompts": [t.removeprefix(bos) for t in tokenizer.batch_decode([list(p) for p in prompt_ids])],
                "prompt_ids": [list(p) for p in prompt_ids], "completion_ids": [list(c) for c in completion_ids]})
            return completion_ids, logprobs

    class RecordUpdates(TrainerCallback):
        """The LoRA before training, and each optimizer step's gradient, gradient norm and resulting weights."""

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            recorded["initial"] = trainable_weights(model)

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):  # after clipping
            self.grad = {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}

        def on_step_end(self, args, state, control, model=None, **kwargs):
            recorded["updates"].append({"grad": self.grad, "weights": trainable_weights(model)})

        def on_log(self, args, state, control, logs=None, **kwargs):  # every process logs, after on_step_end
            if logs and "grad_norm" in logs and recorded["updates"]:
                recorded["updates"][-1]["grad_norm"] = float(logs["grad_norm"])

    recording = record is not None or replay is not None
    with tempfile.TemporaryDirectory() as out:
        args = TRLConfig(**translate(cfg, out, world_size) | trl_settings)
        trainer_class = RecordingTrainer if recording else TRLTrainer
        trainer = trainer_class(model=hf_model, reward_funcs=trl_reward_functions(cfg, bos), args=args,
                                train_dataset=dataset, processing_class=tokenizer,
                                peft_config=LoraConfig(**to_lora_config(cfg)),
                                callbacks=[HeldOutAccuracy()] + ([RecordUpdates()] if recording else []))
        for printer in (ProgressCallback, PrinterCallback):  # they print every log as a dict; the bar above suffices
            trainer.remove_callback(printer)
        start, cpu_start = time.perf_counter(), time.process_time()
        trainer.train()
        seconds = time.perf_counter() - start - timing["eval_seconds"]
        cpu_seconds = time.process_time() - cpu_start - timing["eval_cpu_seconds"]
        if save and trainer.is_world_process_zero():
            trainer.model.save_pretrained(str(save))  # a peft adapter folder: adapter_config.json + safetensors
        if record:
            Path(record).mkdir(parents=True, exist_ok=True)
            torch.save(recorded, Path(record) / f"rank{rank}.pt")
    return {"logger": logger, "seconds": seconds, "cpu_seconds": cpu_seconds,
            "trainable": count_parameters(trainer.model, trainable_only=True)}


def run_ours(cfg: GRPOConfig) -> dict:
    """Our GRPOTrainer on cfg (the main job, solutions/part3_grpo.py): the same figures as run_trl's, its held-out
    evaluations timed apart as there."""
    trainer = GRPOTrainer(cfg)
    evaluate, spent = trainer.evaluate, {"wall": 0.0, "cpu": 0.0}

    def timed_evaluate() -> float:  # timed apart, as run_trl's: the figures count training only
        start, cpu_start = time.perf_counter(), time.process_time()
        accuracy = evaluate()
        spent["wall"] += time.perf_counter() - start
        spent["cpu"] += time.process_time() - cpu_start
        return accuracy

    trainer.evaluate = timed_evaluate
    start, cpu_start = time.perf_counter(), time.process_time()
    logger = trainer.train()
    return {"logger": logger, "seconds": time.perf_counter() - start - spent["wall"],
            "cpu_seconds": time.process_time() - cpu_start - spent["cpu"], "trainable": trainer.trainable}


def figures_of(name: str, run: dict) -> dict:
    """A run's figures: held-out accuracy at the start, end and best; mean reward of the first and last 5 steps;
    wall and CPU seconds of the training (CPU seconds: this process's, all threads; with one thread, about the wall
    time on an idle machine)."""
    _, accuracy = run["logger"].curve("accuracy")
    _, rewards = run["logger"].curve("reward")
    k = max(1, min(5, len(rewards) // 4))
    out = {f"{name}_seconds": round(run["seconds"], 1), f"{name}_cpu_seconds": round(run["cpu_seconds"], 1),
           f"{name}_trainable_params": run["trainable"],
           f"{name}_reward_start": round(sum(rewards[:k]) / k, 4) if rewards else None,
           f"{name}_reward_end": round(sum(rewards[-k:]) / k, 4) if rewards else None}
    if accuracy:
        out |= {f"{name}_accuracy_start": round(accuracy[0], 4), f"{name}_accuracy_end": round(accuracy[-1], 4),
                f"{name}_accuracy_max": round(max(accuracy), 4)}
    return out


def plot_runs(runs: dict[str, dict], path: str | Path | None = None, title: str | None = None):
    """Held-out accuracy and mean reward against the step, one line per run. Returns the matplotlib Figure."""
    plt = pyplot_for(path or None)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.2))
    for ax, key, label in zip(axes, ("accuracy", "reward"), ("held-out accuracy (greedy)", "mean reward")):
        for name, run in runs.items():
            steps, values = run["logger"].curve(key)
            ax.plot(steps, values, marker="." if len(steps) < 40 else None, label=name)
        ax.set_title(label)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=100)
    return fig


def main(argv: list[str] | None = None) -> dict:
    parser = cli.ArgumentParser(description="The main job in TRL's GRPOTrainer with peft, next to ours.")
    parser.add_argument("--model", choices=["tiny", "tiny-llama"], default="tiny",
                        help="the embedded model, with its preset of solutions/part3_grpo.py (tiny-llama: LoRA on "
                             "every projection, 200 steps)")
    parser.add_argument("--steps", type=cli.at_least(1, "TRL reads max_steps 0 as 'not set' and trains by epochs"))
    parser.add_argument("--seed", type=int)
    parser.add_argument("--targets", help="comma-separated LoRA targets (default: the preset's, q,v on tiny). o, "
                                           "mlp_in and mlp_out are unfused in GPT-2 too, so there peft adapts "
                                           "exactly what ours does; on tiny-llama no target is fused")
    parser.add_argument("--trl-only", action="store_true", help="train with TRL only (not ours)")
    parser.add_argument("--save", help="save TRL's trained adapter to this folder (peft's format)")
    parser.add_argument("--vllm", choices=["colocate", "server"],
                        help="generate with vLLM (GPU only, pip install vllm): in the training processes, or on a "
                             "server started first with `trl vllm-serve --model utils/tiny_model` (utils/tiny_llama "
                             "with --model tiny-llama)")
    parser.add_argument("--vllm-server-url", help="with --vllm server: its address (default: TRL's, port 8000)")
    parser.add_argument("--record", metavar="FOLDER",
                        help="each process writes FOLDER/rank<r>.pt: its prompts and completions every step, the "
                             "gradient the optimizer took and the LoRA's weights after each step")
    parser.add_argument("--replay", metavar="FOLDER",
                        help="sample nothing: train on the completions of a --record folder (all its processes' "
                             "rows, shared out in rank order), e.g. on 1 process what 2 sampled")
    parser.add_argument("--plot", default="trl_grpo_curves.png", help="where to save the curves ('' for none)")
    parser.add_argument("--json", action="store_true", help="end with one line: a JSON object of the figures")
    args = parser.parse_args(argv)
    if not trl_available():
        raise SystemExit(MISSING)

    overrides = {k: v for k, v in {"steps": args.steps, "seed": args.seed,
                                   "lora_targets": tuple(args.targets.split(",")) if args.targets else None,
                                   }.items() if v is not None}
    if os.environ.get("RLHF_SMOKE"):
        overrides.setdefault("steps", 2)
        overrides["eval_every"] = 2
    cfg = replace(PRESETS[args.model](), **overrides)
    world_size, rank = world()
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # on this machine, as torch.distributed.run sets it
    if local_processes > 1 and not os.environ.get("RLHF_THREADS"):  # share the cores out: no oversubscription
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        threads = set_cpu_threads(max(1, min(cores, 8) // local_processes))
    else:
        threads = set_cpu_threads()
    if os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true" or os.environ.get("ACCELERATE_USE_FSDP") == "true":
        # the parameters are sharded across processes: a merged copy for the accuracy would need them gathered
        print("ZeRO-3 / FSDP: held-out accuracy is not measured during training (the weights are sharded)")
        cfg = replace(cfg, eval_every=0)
    if not torch.cuda.is_available():
        # use_cpu=True, on several processes too: without it accelerate finds no GPU and sets up no process group
        # (DistributedType.NO), and each launched process trains alone, all of them on the same prompts
        cfg = replace(cfg, device="cpu")

    if args.vllm and not torch.cuda.is_available():
        raise SystemExit("--vllm needs a CUDA GPU (vLLM generates on the GPU); on a CPU, leave it out")
    if args.vllm and args.replay:
        raise SystemExit("--replay samples nothing (it trains on recorded completions): leave out --vllm")
    vllm = {}
    if args.vllm:  # TRL's vLLM settings (trl.GRPOConfig): generation by vLLM, weights synced to it every step
        vllm = {"use_vllm": True, "vllm_mode": args.vllm}
        if args.vllm_server_url:
            vllm["vllm_server_base_url"] = args.vllm_server_url
    runs = {"TRL + peft": run_trl(cfg, save=args.save, record=args.record, replay=args.replay, **vllm)}
    if rank != 0:
        return {}
    if not args.trl_only and world_size == 1:
        runs["ours"] = run_ours(cfg)
    figures = {"model": cfg.model, "steps": cfg.steps, "seed": cfg.seed, "processes": world_size, "threads": threads,
               "lora": to_lora_config(cfg)["target_modules"]}
    for name, run in runs.items():
        figures |= figures_of("trl" if name.startswith("TRL") else "ours", run)
    if args.plot:
        plot_runs(runs, args.plot, title=f"GRPO on 2-digit additions, {cfg.model}, seed {cfg.seed}: TRL + peft "
                                         "against ours")
    print_figures(figures, args.json)
    return figures


if __name__ == "__main__":
    main()
