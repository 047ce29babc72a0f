"""reference_kind: which reference a run's settings call for (and whether it is precomputed), on every case of the
table, beta == 0 first, and the contradictions it must refuse."""

import dataclasses

from solutions import part4_reference as ref
from tests.part4_reference.common import S, short
from tests.support import assert_equal, assert_raises, each_refusal, exercise, expect


WHY = {
    "none": "beta == 0 means no KL term: no reference, no forward pass, nothing to precompute, whatever else is set",
    "hooks_removed": "with hook-LoRA the reference is the same module with the LoRA hooks removed",
    "frozen_copy": "full fine-tuning changes the weights themselves, so the reference must be a frozen copy",
    "old_adapter": "re-training an adapter starts from base + old adapter, so that is the reference, precomputed "
                   "or not, synced or not; and a LoRA run synced with lora_sync='reference_only' keeps base + a "
                   "frozen adapter copy as its reference, which its syncs move (the policy untouched)",
}


def cases():  # (settings, the answer); new objects for every test, which a wrong version may change
    return [
        (S(beta=0.1), ("hooks_removed", False)),
        (S(beta=0.1, lora=False), ("frozen_copy", False)),
        (S(beta=2.0, lora=False), ("frozen_copy", False)),
        (S(beta=0.1, retraining_adapter=True), ("old_adapter", False)),
        (S(beta=0.1, precomputed=True), ("hooks_removed", True)),
        (S(beta=0.1, precomputed=True, retraining_adapter=True), ("old_adapter", True)),
        (S(beta=0.1, lora=False, precomputed=True), ("frozen_copy", True)),
        (S(beta=0.1, sync_every=10, sync_alpha=0.5), ("hooks_removed", False)),
        (S(beta=0.1, lora=False, sync_every=10, sync_alpha=1.0), ("frozen_copy", False)),  # alpha = 1 is allowed
        (S(beta=0.1, retraining_adapter=True, sync_every=10, sync_alpha=0.5), ("old_adapter", False)),
        (S(beta=0.1, sync_alpha=1.5), ("hooks_removed", False)),  # no sync (tau = 0): alpha is unused
        (S(beta=0.1, precomputed=True, sync_alpha=0.5), ("hooks_removed", True)),  # precomputed, never synced: fine
        (S(beta=0.1, sync_every=10, sync_alpha=1.0, lora_sync="reference_only"), ("old_adapter", False)),
        (S(beta=0.1, sync_every=3, sync_alpha=0.5, lora_sync="reference_only", retraining_adapter=True),
         ("old_adapter", False)),
        (S(beta=0.1, lora_sync="reference_only"), ("hooks_removed", False)),  # never synced: the copy stays B = 0
        (S(beta=0.1, lora=False, sync_every=5, sync_alpha=0.5, lora_sync="reference_only"), ("frozen_copy", False)),
    ]


def beta_zero():  # beta == 0 answers first: ("none", False), even where the other settings would be refused
    return [
        S(beta=0.0),
        S(beta=0.0, lora=False),
        S(beta=0.0, precomputed=True),
        S(beta=0.0, precomputed=True, retraining_adapter=True),
        S(beta=0.0, lora=False, retraining_adapter=True),
        S(beta=0.0, precomputed=True, sync_every=5, sync_alpha=0.5),
        S(beta=0.0, sync_every=5, sync_alpha=0.0),
        S(beta=0.0, sync_every=5, sync_alpha=0.5, lora_sync="adapter"),
    ]


def refusals():  # (settings, why it contradicts itself)
    return [
        (S(beta=-0.1), "a negative beta would reward moving away from the reference"),
        (S(beta=0.1, lora=False, retraining_adapter=True), "an adapter is a LoRA: re-training one needs lora=True"),
        (S(beta=0.1, lora=False, precomputed=True, retraining_adapter=True), "re-training an adapter needs lora=True, "
                                                                             "precomputed or not"),
        (S(beta=0.1, precomputed=True, sync_every=5, sync_alpha=0.5), "precomputed log-probs cannot be synced: the "
                                                                      "model they came from is gone"),
        (S(beta=0.1, sync_every=5, sync_alpha=0.0), "a sync with alpha = 0 does nothing: alpha must be in (0, 1]"),
        (S(beta=0.1, sync_every=5, sync_alpha=1.5), "alpha > 1 moves the reference past the policy: alpha must be in "
                                                    "(0, 1]"),
        (S(beta=0.1, sync_every=5, sync_alpha=-0.5), "a negative alpha moves the reference away from the policy"),
        (S(beta=0.1, sync_every=5, sync_alpha=0.5, lora_sync="adapter"), "lora_sync must be 'merge' or "
                                                                         "'reference_only'"),
    ]


def decide(impl, settings):
    """The answer, as a tuple if it is a sequence, or what the function raised."""
    try:
        got = impl.reference_kind(settings)
    except NotImplementedError:
        raise
    except Exception as error:  # noqa: BLE001 - a refusal where an answer was due is reported, not crashed on
        return f"raised {type(error).__name__}: {str(error)[:120]}"
    return tuple(got) if isinstance(got, (list, tuple)) else got


def table_finding(settings_list, answers, expected) -> tuple[str | None, str | None]:
    """(finding, aside): which settings got another answer than the reference's (measured), and why the reference
    answers each of them as it does (the table's reasons, which the learner's answers do not confirm)."""
    wrong = [(s, got, want) for s, got, want in zip(settings_list, answers, expected) if got != want]
    if not wrong:
        return None, None
    shown = "; ".join(f"{short(s)}: got {got}, expected {want}" for s, got, want in wrong[:2])
    finding = f"Wrong on {len(wrong)} of {len(settings_list)} settings: {shown}{'; ...' if len(wrong) > 2 else '.'}"
    why = "\n".join(f"{short(s)}: {WHY[want[0]]}" + ("; and it is precomputed, as the settings ask" if want[1] else "")
                    for s, _, want in wrong)
    return finding, why


def settings_unchanged(settings, before):
    after = [dataclasses.asdict(s) for s in settings]
    changed = [f"{short(s)} (was {b})" for s, a, b in zip(settings, after, before) if a != b]
    assert_equal(after, before, "the settings after reference_kind read them",
                 finding=f"reference_kind changed the settings it was given, e.g. {changed[0]}." if changed else None,
                 hint="reference_kind must only read its settings: the trainer and the Reference read the same object "
                      "later.")


@exercise("reference_kind")
def test_reference_kind_returns_kind_and_precomputed(impl):
    got = impl.reference_kind(S(beta=0.1, precomputed=True))
    expect(isinstance(got, tuple) and len(got) == 2, "reference_kind's result",
           f"expected a tuple (kind, precomputed), e.g. ('hooks_removed', True), got {got!r}", observed=repr(got))
    expect(got[0] in ref.KINDS, "reference_kind's kind", f"expected one of {ref.KINDS}, got {got[0]!r}",
           observed=got[0])


@exercise("reference_kind")
def test_reference_kind_decides_every_case(impl):
    table = cases()
    settings = [s for s, _ in table]
    before = [dataclasses.asdict(s) for s in settings]
    answers = [decide(impl, s) for s in settings]
    expected = [want for _, want in table]
    finding, why = table_finding(settings, answers, expected)
    assert_equal(answers, expected, f"reference_kind on {len(table)} settings with beta > 0", finding=finding,
                 hint=why)
    settings_unchanged(settings, before)


@exercise("reference_kind")
def test_reference_kind_beta_zero_answers_first(impl):
    settings = beta_zero()
    before = [dataclasses.asdict(s) for s in settings]
    answers = [decide(impl, s) for s in settings]
    expected = [("none", False)] * len(settings)
    finding, why = table_finding(settings, answers, expected)
    assert_equal(answers, expected, f"reference_kind on {len(settings)} settings with beta == 0", finding=finding,
                 hint=why)
    settings_unchanged(settings, before)


@exercise("reference_kind")
def test_reference_kind_refuses_contradictions(impl):
    with each_refusal():
        for settings, why in refusals():
            assert_raises(ValueError, impl.reference_kind, settings, what=f"reference_kind({short(settings)})", why=why)
