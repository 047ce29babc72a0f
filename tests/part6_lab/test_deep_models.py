"""lora_on_blocks on a model with 12 blocks (tests/support.py, deep_model): blocks 10 and 11 have two-digit keys
("L10_q"), which a layer read from one character or a prefix match ("L1") takes for block 1. The other test models
have 4 blocks, where neither can go wrong."""

from solutions import part6_lab as ref
from solutions.part2_lora import LoRAModel
from tests.support import assert_equal, calling, deep_adapters, deep_finding, deep_model, exercise


@exercise("lora_on_blocks")
def test_lora_on_blocks_of_a_model_with_twelve_blocks(impl):
    model = deep_model()
    lora_model = LoRAModel(model, deep_adapters(model, ("q", "v")))
    for blocks in ([1], [0, 10], [11], [2, 11, 1]):
        what = f"lora_on_blocks(a 12-block LoRA model, {blocks})"
        out = calling(impl.lora_on_blocks, lora_model, list(blocks), what=what)
        keys = sorted(out.adapters) if isinstance(out, LoRAModel) else type(out).__name__
        want = sorted(ref.lora_on_blocks(lora_model, list(blocks)).adapters)
        wrong = sorted({int(k[1:].split("_")[0]) for k in set(keys) ^ set(want)}) if isinstance(keys, list) else []
        finding, why = deep_finding(wrong) if wrong else (None, None)
        assert_equal(keys, want, f"the adapters' keys of {what}", finding=finding, hint=why)
