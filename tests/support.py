"""What every part's tests share: the checker's assertions, the `exercise` mark, and the set-ups several parts use.

A test compares the learner's values with `assert_close` / `assert_equal` (which say *how* a value differs), checks
properties with the `assert_*` helpers of utils/checker/properties.py, and never uses a bare `assert` on a value:
what a check looks at is recorded, and that record is how a registered wrong version is recognised
(utils/checker/registry.py says how a part registers its wrong versions).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from utils.checker.compare import (CheckFailure, aside, assert_close, assert_equal, describe_difference, expect,  # noqa
                                   show)
from utils.checker import pool
from utils.checker.departure import raised_at
from utils.checker.layout import ROOT
from utils.checker.observe import anonymous
from utils.checker.properties import (assert_defaults_match, assert_gradients_match, assert_hooks_clean,  # noqa
                                      assert_inputs_unchanged, assert_outputs_match, assert_raises,
                                      assert_reproducible, each_refusal)
from utils.checker.registry import Exercise, Registry, mistake, only_on  # noqa: F401
from utils.checker.trace import course_helpers, namespaces_of, reference_trace, tracing  # noqa: F401
from utils.checker.trace_departure import assert_same_trace  # noqa: F401

exercise = pytest.mark.exercise  # @exercise("get_logprobs"): the test checks that exercise of its part


def active_hooks(model) -> list[str]:
    """Names of the hook points that still have forward hooks attached."""
    base = getattr(model, "base", model)
    return [name for name, hp in base.hook_dict.items() if hp.fwd_hooks]


def adapters_with_random_B(model, seed: int = 0, *, rank: int = 4, alpha: float = 8.0, targets=("q", "v"),
                           std: float = 0.3, seed_A: int | None = None, reseed: bool = False):
    """make_adapters' adapters with a random B (B = 0, LoRA's own start, would hide every mistake that involves B).

    By default A is LoRA's own random init, from the global random state (or from `seed_A` when given), and B is
    drawn from a generator seeded with `seed`. With `reseed`, the global random state is seeded with `seed` first
    and B is drawn from it after A (B.normal_(0, std)): the tests of Parts 1 to 3 were written that way, and their
    values depend on it."""
    from solutions.part2_lora import make_adapters

    if reseed or seed_A is not None:
        torch.manual_seed(seed if reseed else seed_A)
    adapters = make_adapters(model, rank, alpha, targets)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for adapter in adapters.values():
            if reseed:
                adapter.B.normal_(0.0, std)
            else:
                adapter.B.copy_(torch.randn(adapter.B.shape, generator=g) * std)
    return adapters


def assert_lean_decoder_matches_the_bridge(model, prompts: list[str], steps: int, monkeypatch, label: str = "") -> None:
    """Greedy sampling on the lean decoder (utils/decoder.py): the logits it hands to pick() at every decoding step
    equal the bridge's (model(...), hooks and all) on the finished rows, at the positions still live."""
    from utils.decoder import LeanDecoder
    from utils.sampling import sample

    seen = []  # the logits of every decoding step, as the decoder hands them to pick()
    monkeypatch.setattr(LeanDecoder, "pick", staticmethod(lambda logits, t, k: seen.append(logits) or logits.argmax(-1)))
    out = sample(model, prompts, max_new_tokens=steps, temperature=0, engine="lean", stop_at_eos=False)
    with torch.no_grad():
        expected = model(out.ids, attention_mask=out.attention_mask)
    assert len(seen) == steps
    for step, logits in enumerate(seen):
        position = out.prompt_len - 1 + step
        live = out.attention_mask[:, position].bool()  # a row past its EOS has no meaningful next token
        torch.testing.assert_close(logits[live], expected[live, position], atol=1e-4, rtol=1e-4,
                                   msg=lambda m: f"{label}decoding step {step}: {m}")


def lora_model_with_random_B(model, seed: int = 0, **options):
    """A LoRAModel of `model` whose adapters have a random B (see adapters_with_random_B for the options): a policy
    that differs from its reference."""
    from solutions.part2_lora import LoRAModel

    return LoRAModel(model, adapters_with_random_B(model, seed, **options))


def error_seen(error: BaseException) -> tuple[str, str]:
    """What a test records of an error: its type and the first line of its message, without the parts that change
    from run to run (file paths, addresses) or with the author (the name of the function or class that raised it),
    so that two runs of the same mistake record the same thing."""
    text = str(error).strip().splitlines()[0][:1000] if str(error).strip() else ""
    return type(error).__name__, anonymous(text)


def calling(fn, *args, what: str, explain=None, **kwargs):
    """fn(*args, **kwargs); an exception other than NotImplementedError (a stub) or a failed check becomes a failure
    that says what was raised, recorded (error_seen) so that a registered wrong version that crashes the same way is
    recognised. explain(text) may return a sentence on the usual cause of that exception, or ""."""
    try:
        return fn(*args, **kwargs)
    except (NotImplementedError, CheckFailure):
        raise
    except Exception as error:  # noqa: BLE001 - the learner's code may raise anything
        text = re.sub(r" at 0x[0-9a-f]+", "", f"{type(error).__name__}: {error}")[:300]
        why = explain(text) if explain else ""
        expect(False, what, f"raised {text}{raised_at(fn, error)}{'. ' + why if why else ''}",
               observed=error_seen(error))


def with_finding(message: str, finding: str) -> str:
    """A failure's `message` with the sentence `finding`, measured on the learner's run, added to what it says it
    measured: before its asides and details (utils/checker/compare.py), which check() shows only on request."""
    from utils.checker.compare import add_finding

    return add_finding(message, finding)


@contextlib.contextmanager
def function_checks_only():
    """Shape annotations are checked before a function's body runs (jaxtyping: on the reference by its import hook,
    on whatever the checker tests by utils/checker/shapes.py). For a refusal that the function itself promises,
    switch them off inside the block, so that the function's own check is what runs."""
    import jaxtyping

    before = jaxtyping.config.jaxtyping_disable
    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        yield
    finally:
        jaxtyping.config.update("jaxtyping_disable", before)


def run_script(module: str, *args: str, smoke: bool = True, timeout: int = 600) -> tuple[str, dict | None]:
    """Run `python -m module args` from the repository root, offline (and with RLHF_SMOKE=1 unless smoke=False);
    return its stdout and, when its last line is a JSON object (the scripts' --json), that object."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"} | ({"RLHF_SMOKE": "1"} if smoke else {})
    result = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                            timeout=timeout, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    last = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    return result.stdout, json.loads(last) if last.startswith("{") else None


# --- a model with ten blocks or more ------------------------------------------------------------------------------

DEEP_LAYERS = 12  # GPT-2 small's count: block 1 is not block 10 or 11, and a layer is no longer one digit


def deep_model():
    """A GPT-2-shaped TransformerBridge with 12 random blocks and d_model 16 (the embedded model's tokenizer), made
    once per process, held by the checker's model pool (utils/checker/pool.py) and put back as made (no hooks, its
    first weights and flags, eval mode) at every call.

    Every other test model has 4 blocks, where a layer read from one character of a key ("L10_q"[1]), or blocks
    chosen by a string prefix ("blocks.1" also starts "blocks.10"), cannot go wrong."""

    def make():
        from transformers import GPT2LMHeadModel

        from utils.models import bridge_from_hf, load_tiny_hf, tiny_hf_config

        _, tokenizer = load_tiny_hf()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            hf_model = GPT2LMHeadModel(tiny_hf_config(len(tokenizer), tokenizer.eos_token_id, d_model=16,
                                                      n_layers=DEEP_LAYERS, n_heads=2, n_ctx=32))
        return bridge_from_hf(hf_model, tokenizer, "cpu").eval()

    name = f"deep-{DEEP_LAYERS}"
    model = pool.shared(name, make)
    pool.restore(name)
    return model


def deep_adapters(model, targets=("q", "k", "v", "o", "mlp_in", "mlp_out"), seed: int = 0):
    """make_adapters on every block of `model` for `targets` (rank 2, alpha 4), B random (with B = 0, LoRA's own
    start, every adapter would be a no-op and a misplaced one would go unseen)."""
    from solutions.part2_lora import make_adapters

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        adapters = make_adapters(model, 2, 4.0, targets)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for adapter in adapters.values():
            adapter.B.copy_(torch.randn(adapter.B.shape, generator=g) * 0.5)
    return adapters


def deep_finding(blocks: list[int]) -> tuple[str, str | None]:
    """(finding, aside) when, on the 12-block model, the blocks `blocks` are the wrong ones. The finding is measured:
    which blocks, and, where they are all among 1, 10 and 11, that these are the blocks whose keys share "L1" (what a
    layer read from one character, or a prefix match, mixes up). The aside is the fix, which that does not prove."""
    finding = (f"On the 12-block model, blocks {blocks} are the wrong ones (the others are right)."
               if len(blocks) < DEEP_LAYERS else f"On the 12-block model, all {DEEP_LAYERS} blocks are wrong.")
    if not (blocks and all(b == 1 or b >= 10 for b in blocks)):
        return finding, None
    finding += (" Their keys all start \"L1\" (\"L1_...\", \"L10_...\", \"L11_...\"): the blocks that are mixed up "
                "when a layer is read from one character (\"L10_q\"[1] is \"1\") or found by a prefix "
                "(\"L10_q\".startswith(\"L1\")).")
    return finding, ("Blocks 10 and 11 are keyed \"L10_...\" and \"L11_...\" (and named \"blocks.10.\", "
                     "\"blocks.11.\"): read the whole number, int(key[1:].split(\"_\", 1)[0]).")
