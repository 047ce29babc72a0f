"""What the course relies on from the libraries beneath it, and a check that they still do it here.

The course is tested with the exact versions in `constraints.txt` (the lock; `bash .ci/lock` remakes it). A newer
release can change what the course depends on without raising anything: transformers 5.24 renamed the KV-cache
argument `past_key_values` to `cache`, TransformerLens 4.3's attention bridge kept reading the old name, and the
bridge's cached `generate` then decoded from the wrong distribution, with a FutureWarning as the only sign. So:

- `require_cached_generate()` decodes a few tokens greedily with the KV cache and by full recompute, once per
  process, and raises `EnvironmentMismatch` (naming the packages, their versions and what to install) when the two
  disagree. `utils.sampling.sample` calls it before every decode through the bridge.
- `environment_report()` says how this machine's libraries differ from the lock; the checker prints it instead of
  blaming the learner when the course's own solution fails a test here.
- tests/test_upstream.py checks the rest of what the course relies on, each failure naming the library, and
  `.ci/canary` runs those tests against the newest versions, to notice when the world moves.
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
from pathlib import Path

from utils.checker.layout import ROOT  # the standard library only, as this module must stay (the Colab cell)

LOCK = ROOT / "constraints.txt"
INSTALL_TESTED = "pip install -r requirements.txt -c constraints.txt"
# The libraries whose behaviour the course's numbers depend on (trl only where it is installed).
COURSE_LIBRARIES = ("torch", "transformers", "transformer_lens", "peft", "safetensors", "trl")


class EnvironmentMismatch(RuntimeError):
    """The installed libraries do not do what the course relies on: the machine is at fault, not the code."""


def normal_name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()  # PEP 503: transformer_lens == transformer-lens


def installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def locked_versions(lock: Path = LOCK) -> dict[str, str]:
    """{normalised name: version} of the lock's lines that apply to this Python and platform ({} without a lock)."""
    from packaging.markers import Marker

    pins = {}
    if not lock.exists():
        return pins
    for line in lock.read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)\s*(?:;\s*(.+))?$", line.strip())
        if match and (match[3] is None or Marker(match[3]).evaluate()):
            pins[normal_name(match[1])] = match[2]
    return pins


def same_version(installed: str, locked: str) -> bool:
    return installed.split("+")[0] == locked.split("+")[0]  # torch 2.13.0+cpu is the lock's torch 2.13.0


def differences_from_lock(names=COURSE_LIBRARIES) -> list[str]:
    """One entry per course library whose installed version is not the tested one, e.g. 'transformers 5.24.0
    (tested: 5.23.0)'. Libraries that are not installed and not required (trl) are left out."""
    pins = locked_versions()
    found = []
    for name in names:
        have, tested = installed_version(name), pins.get(normal_name(name))
        if have is not None and tested is not None and not same_version(have, tested):
            found.append(f"{name} {have} (tested: {tested})")
        elif have is None and tested is not None:
            found.append(f"{name} not installed (tested: {tested})")
    return found


def versions(names=COURSE_LIBRARIES) -> str:
    """'torch 2.13.0+cpu, transformers 5.23.0, ...' for the installed course libraries."""
    return ", ".join(f"{name} {installed_version(name)}" for name in names if installed_version(name))


def environment_report() -> str:
    """One paragraph on how this machine's libraries compare with the tested ones, ending with what to install."""
    differ = differences_from_lock()
    if differ:
        return (f"The installed libraries differ from the tested ones: {'; '.join(differ)}. "
                f"Install the tested versions from the repository's root: {INSTALL_TESTED}")
    return (f"Installed: {versions()}. These are the tested versions, so something else about this machine differs "
            f"(another Python, platform or torch build); reinstall with `{INSTALL_TESTED}` and tell the course's "
            "maintainers what you see.")


def cached_generate_mismatch(steps: int = 4) -> str | None:
    """Decode `steps` tokens greedily with TransformerLens's cached `generate` and by recomputing the whole sequence
    at every step, on the embedded model (left-padded, as `sample` batches prompts). None when they agree; else what
    differs. Runs on the CPU in a fraction of a second, whatever device the course's model is on."""
    import torch

    from utils.models import bridge_from_hf, load_tiny_hf
    from utils.tokens import tokenize_prompts

    hf_model, tokenizer = load_tiny_hf()
    model = bridge_from_hf(hf_model, tokenizer, "cpu")
    ids, mask = tokenize_prompts(tokenizer, ["This is a", "The cat is in the"], "cpu")  # rows of unequal length
    with torch.no_grad():
        cached = model.generate(ids, attention_mask=mask, max_new_tokens=steps, do_sample=False, stop_at_eos=False,
                                return_type="tokens", verbose=False)[:, ids.shape[1]:]
        tokens, full_mask = ids, mask
        for _ in range(steps):
            next_token = model(tokens, attention_mask=full_mask)[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, next_token], 1)
            full_mask = torch.cat([full_mask, torch.ones_like(next_token)], 1)
    recomputed = tokens[:, ids.shape[1]:]
    if torch.equal(cached, recomputed):
        return None
    return (f"greedy decoding with the KV cache gave {cached.tolist()}, recomputing the whole sequence at each step "
            f"gave {recomputed.tolist()}")


@functools.cache
def _cached_generate_verdict(installed: str) -> str | None:
    import torch

    with torch.random.fork_rng(devices=[]):  # loading a model draws random numbers: the caller's stay untouched
        return cached_generate_mismatch()


def require_cached_generate() -> None:
    """Raise EnvironmentMismatch if TransformerLens's cached `generate` decodes wrongly with the installed libraries.
    Checked once per process (and again if the versions change under it)."""
    why = _cached_generate_verdict(versions(("torch", "transformers", "transformer_lens")))
    if why is not None:
        raise EnvironmentMismatch(
            f"TransformerLens's cached generate decodes wrongly with the installed libraries "
            f"({versions(('transformers', 'transformer_lens', 'torch'))}): {why}. Sampling through the bridge "
            f"would draw from the wrong distribution. This is the environment, not your code. "
            f"{environment_report()} (sample(..., engine='lean') is not affected, where it applies.)")


def colab_constraints(requirements: list[str], installed=installed_version, lock: Path = LOCK) -> list[str]:
    """The pins (`name==version` lines, for pip's `-c`) that install `requirements` (lines of requirements.txt) at the
    tested versions into an environment that has packages of its own, such as Colab's.

    From the lock's lines that apply to this Python and platform, it pins every package that is not installed yet,
    and every requirement whose installed version is outside its range (Colab's transformers 4.x). An installed
    package that satisfies the course (Colab's torch, numpy, its Jupyter) is left alone: a pin would make pip replace
    it, and replacing what the runtime itself runs on can break it. `installed` maps a package's name to its installed
    version, or None.

    The Colab cell calls this before anything is installed, so it imports nothing but the standard library and
    `packaging` (which pip needs too, and Colab has).
    """
    from packaging.requirements import Requirement

    ranges = {}
    for line in requirements:
        text = line.split("#", 1)[0].strip()  # "transformers>=5.9,<5.24  # canary: <6"
        if text:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate():
                ranges[normal_name(requirement.name)] = requirement.specifier
    pins = []
    for name, version in locked_versions(lock).items():
        have = installed(name)
        if have is None or (name in ranges and not ranges[name].contains(have, prereleases=True)):
            pins.append(f"{name}=={version}")
    return pins
