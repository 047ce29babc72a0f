"""The exercise split_qkv: a c_attn LoRA that peft trained (one A, a dense B) as three course adapters q, k and v
(their factors, the output they compute, each with its own trainable A, the dtype kept, and its refusals)."""

import pytest
import torch

from solutions import part7_production as ref
from tests.part7_production.common import D_IN, D_OUT
from tests.support import (aside, assert_close, assert_equal, assert_inputs_unchanged, assert_raises, each_refusal,
                           exercise, expect)

SPLIT_HINT = ("Each of q, k, v gets a LoRA of the c_attn LoRA's rank R, on A's device and dtype, with its own copy "
              "of A, the rows of B that write its third of c_attn's output (q rows first, then k, then v), and "
              "`scale`.")


def c_attn_lora(rank=6, seed=0, dtype=torch.float32):
    """A c_attn LoRA as peft trains one: one A, and a dense B (no block structure)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rank, D_IN, generator=g).to(dtype), torch.randn(3 * D_OUT, rank, generator=g).to(dtype))


def fields_of(adapter, what):
    """adapter.A, adapter.B and adapter.scale, or a failure that says which is missing."""
    have = all(hasattr(adapter, name) for name in ("A", "B", "scale"))
    expect(have, what, f"expected a LoRA (with A, B and scale), got {type(adapter).__name__}",
           observed=type(adapter).__name__)
    return adapter.A, adapter.B, adapter.scale


@exercise("split_qkv")
def test_split_qkv_gives_q_k_and_v(impl):
    A, B = c_attn_lora()
    out = impl.split_qkv(A.clone(), B.clone(), 0.75)
    assert_equal(sorted(out) if isinstance(out, dict) else type(out).__name__, ["k", "q", "v"],
                 "the keys of split_qkv(A, B, 0.75)", hint="a dict {'q': LoRA, 'k': LoRA, 'v': LoRA}")


@exercise("split_qkv")
def test_split_qkv_factors_of_each_adapter(impl):
    for scale, rank in ((0.75, 6), (2.0, 3)):
        A, B = c_attn_lora(rank, seed=rank)
        out, expected = impl.split_qkv(A.clone(), B.clone(), scale), ref.split_qkv(A, B, scale)
        for t in ("q", "k", "v"):
            got_A, got_B, got_scale = fields_of(out[t], f"split_qkv(...)['{t}']")
            assert_close(got_A, expected[t].A, f"split_qkv(A, B, {scale})['{t}'].A (rank {rank})", hint=SPLIT_HINT)
            assert_close(got_B, expected[t].B, f"split_qkv(A, B, {scale})['{t}'].B (rank {rank})", hint=SPLIT_HINT)
            assert_equal(float(got_scale), scale, f"split_qkv(A, B, {scale})['{t}'].scale", hint=SPLIT_HINT)


@exercise("split_qkv")
def test_split_qkv_computes_what_the_c_attn_lora_does(impl):
    A, B = c_attn_lora(6, seed=3)
    x = torch.randn(4, 5, D_IN, generator=torch.Generator().manual_seed(9))
    out = impl.split_qkv(A.clone(), B.clone(), 0.75)
    with torch.no_grad():
        got = torch.cat([out[t](x) for t in ("q", "k", "v")], -1)
    assert_close(got, 0.75 * x @ A.T @ B.T, "the q, k and v adapters' outputs side by side, against the c_attn "
                 "LoRA's 0.75 * x A^T B^T", factors={"0.75 (the scale)": 0.75, "1/0.75": 1 / 0.75}, hint=SPLIT_HINT)


@exercise("split_qkv")
def test_split_qkv_each_adapter_owns_its_A(impl):
    """Three adapters that share one A tensor would train it together (and a learner's A would move the file's):
    peft trains one shared A, but three course adapters are three independent LoRAs."""
    A, B = c_attn_lora()
    out = impl.split_qkv(A, B.clone(), 0.75)
    pointers = [A.data_ptr()] + [fields_of(out[t], f"split_qkv(...)['{t}']")[0].data_ptr() for t in ("q", "k", "v")]
    given = [t for t, p in zip("qkv", pointers[1:]) if p == pointers[0]]
    among = [t for t, p in zip("qkv", pointers[1:]) if p != pointers[0] and pointers[1:].count(p) > 1]
    found = ([f"the A of {', '.join(given)} is the A given"] if given else []) + (
        [f"the A of {', '.join(among)} is one tensor"] if among else [])
    expect(len(set(pointers)) == 4, "the A of each adapter split_qkv returns", "the adapters' A share memory: "
           f"{'; '.join(found)}. Give each adapter its own copy (lora.A.copy_(A))" + aside(
               "Common cause: lora.A = A, which makes the adapter use the given tensor itself."),
           observed=len(set(pointers)))
    for t in ("q", "k", "v"):
        trainable = isinstance(out[t].A, torch.nn.Parameter) and out[t].A.requires_grad
        expect(trainable, f"split_qkv(...)['{t}'].A", "it is not a trainable Parameter: the adapters must train "
               "like make_adapters' (build each with LoRA(...) and copy into its A and B)", observed=trainable)


@exercise("split_qkv")
def test_split_qkv_keeps_the_dtype_and_leaves_its_inputs_alone(impl):
    A, B = c_attn_lora(4, seed=5, dtype=torch.float64)
    out = assert_inputs_unchanged(impl.split_qkv, A, B, 1.5, what="split_qkv(A, B, 1.5)")
    dtypes = [str(fields_of(out[t], f"split_qkv(...)['{t}']")[1].dtype) for t in ("q", "k", "v")]
    assert_equal(dtypes, ["torch.float64"] * 3, "the dtype of the adapters split_qkv makes from float64 A and B",
                 hint="make each LoRA, then .to(device=A.device, dtype=A.dtype), before copying A and B in")


@exercise("split_qkv")
def test_split_qkv_refuses_rows_that_are_not_three_thirds(impl):
    A, B = c_attn_lora()
    with each_refusal():
        for rows in (35, 32):  # neither a multiple of 3; 32 is one of 4 (and 2)
            assert_raises(ValueError, impl.split_qkv, A, B[:rows], 0.75, what=f"split_qkv(A, B with {rows} rows, 0.75)",
                          why="c_attn's output is q, k and v, three blocks of n_heads * d_head rows")


def test_split_qkv_refuses_a_scale_that_is_not_positive():
    A, B = c_attn_lora()
    with pytest.raises(ValueError, match="scale must be a number > 0"):
        ref.split_qkv(A, B, 0.0)
    with pytest.raises(ValueError, match="adapters must be non-empty"):
        ref.fuse_qkv({})
