"""The exercise peft_state_dict: course adapters as the tensors of peft's adapter_model.safetensors (the keys,
q, k and v fused into c_attn, every B as it is, its scale left to peft's lora_alpha / r, and the adapters left
alone)."""

import torch

from solutions import part7_production as ref
from tests.part7_production.common import D_MLP, D_MODEL, D_OUT, random_lora
from tests.support import assert_close, assert_equal, assert_inputs_unchanged, exercise, expect


def adapters_of(spec, seed=0):
    """An nn.ModuleDict like make_adapters' for `spec` = {layer: targets}, with random A and B and, for each
    target, its own scale (alpha 6, 3, 1.5, ... over rank 2)."""
    dims = {"q": (D_MODEL, D_OUT), "k": (D_MODEL, D_OUT), "v": (D_MODEL, D_OUT), "o": (D_OUT, D_MODEL),
            "mlp_in": (D_MODEL, D_MLP), "mlp_out": (D_MLP, D_MODEL)}
    adapters = torch.nn.ModuleDict()
    for layer, targets in spec.items():
        for i, t in enumerate(targets):
            adapters[f"L{layer}_{t}"] = random_lora(2, 6.0 / 2 ** i, seed + 10 * layer + i, *dims[t])
    return adapters


# the main job's q and v in two blocks; and every target, o and the MLP included, in block 1 only
SPECS = {"q, v in blocks 0 and 1": {0: ("q", "v"), 1: ("q", "v")},
         "o, mlp_in, mlp_out, q, k, v in block 1": {1: ("o", "mlp_in", "mlp_out", "q", "k", "v")}}

PSD_HINT = ("Keys 'base_model.model.transformer.h.{layer}.{module}.lora_A.weight' and '....lora_B.weight', the module "
            "from HF_MODULES (q, k, v -> attn.c_attn, fused by fuse_qkv; o -> attn.c_proj; mlp_in -> mlp.c_fc; "
            "mlp_out -> mlp.c_proj); A and B as they are: peft's lora_alpha / r applies the scale, so B is not "
            "multiplied by it.")


@exercise("peft_state_dict")
def test_peft_state_dict_keys(impl):
    for label, spec in SPECS.items():
        adapters = adapters_of(spec)
        out = impl.peft_state_dict(adapters)
        assert_equal(sorted(out) if isinstance(out, dict) else type(out).__name__,
                     sorted(ref.peft_state_dict(adapters)), f"the keys of peft_state_dict({label})", hint=PSD_HINT)


@exercise("peft_state_dict")
def test_peft_state_dict_tensors(impl):
    for label, spec in SPECS.items():
        adapters = adapters_of(spec)
        out, expected = impl.peft_state_dict(adapters), ref.peft_state_dict(adapters)
        for key, tensor in expected.items():
            expect(key in out, f"peft_state_dict({label})", f"it has no {key!r}", observed=sorted(out))
            assert_close(out[key], tensor, f"peft_state_dict({label})[{key.removeprefix('base_model.model.')!r}]",
                         factors={"3 (the scale of the first target)": 3.0, "1/3": 1 / 3}, hint=PSD_HINT)


@exercise("peft_state_dict")
def test_peft_state_dict_leaves_the_adapters_alone(impl):
    adapters = adapters_of(SPECS["o, mlp_in, mlp_out, q, k, v in block 1"])
    # its tensors are its own: a state dict that shares the adapters' memory changes as they train on after export
    assert_inputs_unchanged(impl.peft_state_dict, adapters, what="peft_state_dict(adapters)", may_alias=False)
