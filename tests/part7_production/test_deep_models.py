"""peft_state_dict on adapters of a model with 12 blocks (tests/support.py, deep_model): the peft name of adapter
"L10_q" is "...transformer.h.10.attn.c_attn...", which a layer read from one character of the key puts on block 1.
The other tests use 4 blocks or fewer, where that cannot go wrong."""

from solutions import part7_production as ref
from tests.support import (CheckFailure, aside, assert_outputs_match, calling, deep_adapters, deep_finding, deep_model,
                           exercise, with_finding)


@exercise("peft_state_dict")
def test_peft_state_dict_of_a_model_with_twelve_blocks(impl):
    adapters = deep_adapters(deep_model(), ("q", "k", "v", "o", "mlp_in", "mlp_out"))
    got = calling(impl.peft_state_dict, adapters, what="peft_state_dict(the adapters of a 12-block model)")
    want = ref.peft_state_dict(adapters)
    wrong = []
    if isinstance(got, dict):
        wrong = sorted({int(k.split(".h.")[1].split(".")[0]) for k in set(got) ^ set(want) if ".h." in k})
    try:
        assert_outputs_match(got, want, "peft_state_dict(the adapters of a 12-block model)")
    except CheckFailure as failure:  # the keys are compared inside, where no finding of ours reaches: add it here
        if not wrong:
            raise
        finding, why = deep_finding(wrong)
        failure.args = (with_finding(str(failure.args[0]), finding) + (aside(why) if why else ""),)
        raise
