"""Pretrain the embedded tiny model on the synthetic corpus of `utils.data`, and save it.

    python -m utils.pretrain_tiny                 # rebuilds utils/tiny_model/ (about 85 s on 2 CPU cores)
    python -m utils.pretrain_tiny --arch llama    # rebuilds utils/tiny_llama/, the Llama-style one
    python -m utils.pretrain_tiny --out /tmp/m --max-steps 5   # a quick smoke run

The checkpoint we ship is deliberately an *early* one: it writes sentences that read like the toy language
and answers some 2-digit additions right, but not most, so that RL in Parts 1-3 has room to improve it.
Training stops as soon as greedy accuracy on *training* pairs reaches `target_train_accuracy`; the held-out
pairs are only measured at the end, never used to decide anything.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import time
from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm

from utils.data import (addition_accuracy, addition_pairs, build_tokenizer, make_addition_document,
                        make_text_document)
from utils.models import EMBEDDED, bridge_from_hf, set_cpu_threads, tiny_hf_config, tiny_llama_hf_config
from utils.sampling import sample


@dataclass
class PretrainConfig:
    seed: int = 0
    arch: str = "gpt2"                   # "gpt2", or "llama" (RMSNorm, RoPE, gated MLP, grouped-query attention)
    d_model: int = 128                   # ~0.85M parameters with 4 layers: trains in minutes on a laptop
    n_layers: int = 4
    n_heads: int = 4
    n_ctx: int = 64                      # long enough for a prompt and a 40-token completion
    batch_size: int = 64                 # sequences of n_ctx tokens per step
    lr: float = 3e-3
    warmup_steps: int = 50
    weight_decay: float = 0.01
    max_steps: int = 3000
    arithmetic_fraction: float = 0.8     # share of documents that are additions (short: ~40% of tokens)
    corpus_tokens: int = 2_000_000       # the token buffer that batches are cut from
    eval_every: int = 5                  # steps between accuracy checks: the jump in accuracy is abrupt
    eval_pairs: int = 256                # training pairs used by the stopping rule
    target_train_accuracy: float = 0.40  # stop here: an early checkpoint leaves room for RL
    threads: int | None = None           # torch CPU threads (None: one per core, at most 8)
    out: str = ""                        # default: the embedded model's folder for this architecture


def make_corpus(cfg: PretrainConfig, tokenizer) -> torch.Tensor:
    """One long stream of documents, each preceded by EOS, as GPT-2 was trained."""
    rng = random.Random(cfg.seed)
    train_pairs = addition_pairs("train")
    eos = tokenizer.eos_token_id
    stream: list[int] = []
    with tqdm(total=cfg.corpus_tokens, desc="corpus", unit="tok", leave=False) as bar:
        while len(stream) < cfg.corpus_tokens:
            docs = [make_addition_document(rng, train_pairs) if rng.random() < cfg.arithmetic_fraction
                    else make_text_document(rng) for _ in range(2048)]
            before = len(stream)
            for ids in tokenizer(docs, add_special_tokens=False).input_ids:
                stream += [eos] + ids
            bar.update(len(stream) - before)
    return torch.tensor(stream[:cfg.corpus_tokens], dtype=torch.long)


def as_bridge(hf_model, tokenizer):
    """A TransformerBridge over a *copy*: wrapping rewrites the HF module in place, and we keep training it."""
    return bridge_from_hf(copy.deepcopy(hf_model).eval(), tokenizer, "cpu")


ARCHITECTURES = ("gpt2", "llama")


def new_model(cfg: PretrainConfig, tokenizer):
    """A randomly initialised Hugging Face model of `cfg.arch`."""
    from transformers import GPT2LMHeadModel, LlamaForCausalLM

    if cfg.arch == "gpt2":
        return GPT2LMHeadModel(tiny_hf_config(len(tokenizer), tokenizer.eos_token_id, cfg.d_model, cfg.n_layers,
                                              cfg.n_heads, cfg.n_ctx))
    if cfg.arch == "llama":
        return LlamaForCausalLM(tiny_llama_hf_config(len(tokenizer), tokenizer.eos_token_id, cfg.d_model,
                                                     cfg.n_layers, cfg.n_heads, n_ctx=cfg.n_ctx))
    raise ValueError(f"unknown architecture {cfg.arch!r}: choose one of {ARCHITECTURES}")


def pretrain(cfg: PretrainConfig) -> dict:
    if cfg.arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {cfg.arch!r}: choose one of {ARCHITECTURES}")
    if not cfg.out:
        cfg.out = str(EMBEDDED["tiny" if cfg.arch == "gpt2" else "tiny-llama"][0])
    torch.manual_seed(cfg.seed)
    threads = set_cpu_threads(cfg.threads)
    tokenizer = build_tokenizer(cfg.out)
    hf_model = new_model(cfg, tokenizer)
    corpus = make_corpus(cfg, tokenizer)
    eval_pairs = random.Random(cfg.seed + 1).sample(addition_pairs("train"), cfg.eval_pairs)

    opt = torch.optim.AdamW(hf_model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg.warmup_steps))
    gen = torch.Generator().manual_seed(cfg.seed)
    history, start, train_acc, loss = [], time.perf_counter(), 0.0, torch.tensor(float("nan"))
    bar = tqdm(range(1, cfg.max_steps + 1), desc="pretraining")
    for step in bar:
        hf_model.train()
        starts = torch.randint(0, len(corpus) - cfg.n_ctx, (cfg.batch_size,), generator=gen)
        batch = torch.stack([corpus[s:s + cfg.n_ctx] for s in starts.tolist()])
        loss = hf_model(batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf_model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % cfg.eval_every == 0 or step == cfg.max_steps:
            train_acc = addition_accuracy(as_bridge(hf_model, tokenizer), eval_pairs)
            history.append({"step": step, "loss": loss.item(), "train_accuracy": train_acc,
                            "seconds": time.perf_counter() - start})
            bar.set_postfix(loss=f"{loss.item():.3f}", train_acc=f"{train_acc:.2f}")
            if train_acc >= cfg.target_train_accuracy:
                break
    seconds = time.perf_counter() - start
    hf_model.eval()
    hf_model.save_pretrained(cfg.out, safe_serialization=True)
    model = as_bridge(hf_model, tokenizer)

    held_out = addition_accuracy(model, addition_pairs("held_out"))
    torch.manual_seed(cfg.seed)
    texts = sample(model, ["This is"] * 4 + ["The", "My"], max_new_tokens=24, temperature=1.0).texts
    report = {"seconds": round(seconds, 1), "steps": step, "final_loss": round(loss.item(), 4),
              "train_accuracy": train_acc, "held_out_accuracy": round(held_out, 4), "threads": threads,
              "parameters": sum(p.numel() for p in hf_model.parameters()), "samples": texts,
              "config": asdict(cfg), "history": history}
    with open(f"{cfg.out}/training.json", "w") as f:
        json.dump(report, f, indent=1)
    return report


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for field, value in asdict(PretrainConfig()).items():
        kind = type(value) if value is not None else int
        choices = ARCHITECTURES if field == "arch" else None
        parser.add_argument("--" + field.replace("_", "-"), type=kind, default=value, choices=choices)
    cfg = PretrainConfig(**vars(parser.parse_args(argv)))
    report = pretrain(cfg)
    print(f"saved to {cfg.out}: {report['steps']} steps in {report['seconds']} s, final loss "
          f"{report['final_loss']}, accuracy on training pairs {report['train_accuracy']:.0%}, on held-out "
          f"pairs {report['held_out_accuracy']:.0%}")
    for text in report["samples"]:
        print("  ", repr(text))
    return report


if __name__ == "__main__":
    main()
