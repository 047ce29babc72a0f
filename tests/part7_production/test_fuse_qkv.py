"""The exercise fuse_qkv: a block's separate q, k and v adapters as the one LoRA on GPT-2's fused c_attn that peft
stores (shapes, factors and scale, the update it computes, its inputs left alone, and its refusal of other
targets)."""

import torch

from solutions import part7_production as ref
from tests.part7_production.common import D_IN, D_OUT, random_lora
from tests.support import assert_close, assert_equal, assert_inputs_unchanged, assert_raises, exercise, expect


def block_of(targets, ranks=None, alphas=None):
    """{target: LoRA} for one block; by default rank 2 and alpha 6 (scale 3) for every target."""
    return {t: random_lora((ranks or {}).get(t, 2), (alphas or {}).get(t, 6.0), seed) for seed, t in
            enumerate(targets)}


def fused_update(adapters):
    """What a block's q, k and v adapters add to c_attn's output, as one [3 * d_out, d_in] matrix: rows q | k | v."""
    rows = []
    for t in ("q", "k", "v"):
        a = adapters.get(t)
        rows.append(a.scale * a.B.detach() @ a.A.detach() if a is not None else torch.zeros(D_OUT, D_IN))
    return torch.cat(rows)


FUSE_HINT = ("A stacks the adapters' A in the order q, k, v ([sum of ranks, d_model]); B is [3 * n_heads * d_head, "
             "sum of ranks]: c_attn's q rows, then k rows, then v rows, each target's rows holding its B in the "
             "columns of its own A, zeros elsewhere (all zeros for a target with no adapter); scale is the first "
             "adapter's (q, k, v order), and a target whose scale differs has its B times its scale / scale. peft's "
             "scaling (lora_alpha / r) applies the scale: B is not multiplied by it.")

# the blocks the fuse_qkv tests use: the main job's q and v (k's rows must stay 0), all three, one alone, and all
# three given in another order than c_attn's
BLOCKS = {"q, v": ("q", "v"), "q, k, v": ("q", "k", "v"), "k": ("k",), "v, q, k (another order)": ("v", "q", "k")}


@exercise("fuse_qkv")
def test_fuse_qkv_shapes(impl):
    for label, targets in BLOCKS.items():
        block = block_of(targets)
        A, B, _ = impl.fuse_qkv(block)
        rank = 2 * len(targets)
        what = f"fuse_qkv({{{label}}}): the shapes of (A, B)"
        shapes = (tuple(A.shape), tuple(B.shape))
        expect(shapes == ((rank, D_IN), (3 * D_OUT, rank)), what,
               f"expected A {(rank, D_IN)} and B {(3 * D_OUT, rank)} (rank = the sum of the adapters' ranks, "
               f"{len(targets)} x 2; B has c_attn's 3 x {D_OUT} output rows), got A {shapes[0]} and B {shapes[1]}. "
               "peft stores lora_A.weight as [rank, d_in] and lora_B.weight as [d_out, rank] also on GPT-2's Conv1D "
               "(fan_in_fan_out only transposes the update it merges into the weight)", observed=shapes)


@exercise("fuse_qkv")
def test_fuse_qkv_factors(impl):
    for label, targets in BLOCKS.items():
        block = block_of(targets, alphas={"q": 6.0, "k": 3.0, "v": 1.0})
        A, B, scale = impl.fuse_qkv(block)
        ref_A, ref_B, ref_scale = ref.fuse_qkv(block)
        assert_close(A, ref_A, f"A of fuse_qkv({{{label}}})", hint=FUSE_HINT)
        assert_close(B, ref_B, f"B of fuse_qkv({{{label}}}) (scales 3, 1.5 and 0.5 for q, k, v)",
                     factors={"3 (q's scale, alpha / rank)": 3.0, "1/3": 1 / 3}, hint=FUSE_HINT)
        assert_equal(float(scale), ref_scale, f"the scale of fuse_qkv({{{label}}}) (scales 3, 1.5 and 0.5 for q, k, "
                     "v: the first adapter's)", hint=FUSE_HINT)


@exercise("fuse_qkv")
def test_fuse_qkv_computes_what_the_separate_adapters_do(impl):
    """scale · B A (peft's scaling times its update) must be the update the separate adapters make to c_attn's
    output, whatever the order of A's blocks; with the same scale everywhere, so that a scale left out or applied
    twice shows as a named factor."""
    for label, targets in BLOCKS.items():
        block = block_of(targets)
        A, B, scale = impl.fuse_qkv(block)
        if tuple(A.shape)[-1:] != (D_IN,) or tuple(B.shape)[:1] != (3 * D_OUT,) or A.shape[0] != B.shape[1]:
            expect(False, f"fuse_qkv({{{label}}}): B @ A", f"B {tuple(B.shape)} and A {tuple(A.shape)} do not make "
                   f"a [{3 * D_OUT}, {D_IN}] update", observed=(tuple(A.shape), tuple(B.shape)))
        assert_close((float(scale) * B @ A).detach(), fused_update(block), f"scale * B @ A of fuse_qkv({{{label}}}), "
                     "c_attn's update (rows q | k | v)", factors={"3 (the adapters' scale, alpha / rank)": 3.0,
                                                  "1/3 (one over the adapters' scale)": 1 / 3}, hint=FUSE_HINT)


@exercise("fuse_qkv")
def test_fuse_qkv_leaves_the_adapters_alone(impl):
    block = block_of(("q", "k", "v"))
    assert_inputs_unchanged(impl.fuse_qkv, block, what="fuse_qkv({q, k, v})")


@exercise("fuse_qkv")
def test_fuse_qkv_refuses_a_target_c_attn_does_not_compute(impl):
    block = block_of(("q", "v")) | {"o": random_lora(2, 6.0, 7, D_OUT, D_IN)}
    assert_raises(ValueError, impl.fuse_qkv, block, what="fuse_qkv({q, v, o})",
                  why="c_attn computes q, k and v only; o is attn.c_proj, a module of its own")
