"""Tests of Part 7's exercises (the bridge to production). Each runs against `impl` (see utils/harness.py) and
compares with the reference.

The file has one section per topic. MUTANTS, NOT_APPLICABLE and ALWAYS_DEFAULT are filled in by the sections:
MUTANTS[name] are the known wrong versions of an exercise (the meta-test, tests/test_harness.py, proves each one
fails these tests; when a learner's version fails a test the same way, its docstring is what the learner reads).
Tests that need TRL are skipped, with the reason, when it is not installed (pip install -r requirements-bench.txt).
"""

import functools
import inspect

import pytest
import torch
from torch import Tensor

from solutions import part7_production as ref
from tests.helpers import (assert_close, assert_equal, assert_gradients_match, assert_hooks_clean,
                           assert_inputs_unchanged, assert_raises, expect, mistake, run_script)

exercise = pytest.mark.exercise

MUTANTS: dict[str, list] = {}          # exercise -> wrong versions (each section adds its own)
NOT_APPLICABLE: dict[tuple[str, str], str] = {}   # (exercise, kind) -> why that kind of mistake cannot happen
ALWAYS_DEFAULT: dict[tuple[str, str], str] = {}   # (exercise, parameter) -> why no test varies it


# === section: peft =================================================================================================
# Exercises: fuse_qkv, split_qkv. Then the provided export_peft_adapter / import_peft_adapter, shown equal to peft's
# own model (PeftModel.from_pretrained on the Hugging Face twin of the bridge), and their refusals. Helpers of this
# section start with _pf_.

import json  # noqa: E402
from pathlib import Path  # noqa: E402

from safetensors.torch import load_file, save_file  # noqa: E402

from solutions.part2_lora import LoRA, LoRAModel, make_adapters  # noqa: E402

D_IN, D_OUT = 10, 12  # a block's d_model and n_heads * d_head, small: these tests need no model


def _pf_lora(rank, alpha, seed, d_in=D_IN, d_out=D_OUT):
    """A LoRA whose A and B are both random (B = 0 would hide every mistake in B)."""
    g = torch.Generator().manual_seed(seed)
    lora = LoRA(d_in, d_out, rank=rank, alpha=alpha)
    with torch.no_grad():
        lora.A.copy_(torch.randn(rank, d_in, generator=g))
        lora.B.copy_(torch.randn(d_out, rank, generator=g))
    return lora


def _pf_block(targets, ranks=None, alphas=None):
    """{target: LoRA} for one block; by default rank 2 and alpha 6 (scale 3) for every target."""
    return {t: _pf_lora((ranks or {}).get(t, 2), (alphas or {}).get(t, 6.0), seed) for seed, t in
            enumerate(targets)}


def _pf_fused_update(adapters):
    """What a block's q, k and v adapters add to c_attn's output, as one [3 * d_out, d_in] matrix: rows q | k | v."""
    rows = []
    for t in ("q", "k", "v"):
        a = adapters.get(t)
        rows.append(a.scale * a.B.detach() @ a.A.detach() if a is not None else torch.zeros(D_OUT, D_IN))
    return torch.cat(rows)


FUSE_HINT = ("A stacks the adapters' A in the order q, k, v ([sum of ranks, d_model]); B is [3 * n_heads * d_head, "
             "sum of ranks]: c_attn's q rows, then k rows, then v rows, each target's rows holding its B times its "
             "scale in the columns of its own A, zeros elsewhere (all zeros for a target with no adapter).")

# the blocks the fuse_qkv tests use: the main job's q and v (k's rows must stay 0), all three, one alone, and all
# three given in another order than c_attn's
_PF_BLOCKS = {"q, v": ("q", "v"), "q, k, v": ("q", "k", "v"), "k": ("k",), "v, q, k (another order)": ("v", "q", "k")}


@exercise("fuse_qkv")
def test_fuse_qkv_shapes(impl):
    for label, targets in _PF_BLOCKS.items():
        block = _pf_block(targets)
        A, B = impl.fuse_qkv(block)
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
    for label, targets in _PF_BLOCKS.items():
        block = _pf_block(targets, alphas={"q": 6.0, "k": 3.0, "v": 1.0})
        A, B = impl.fuse_qkv(block)
        ref_A, ref_B = ref.fuse_qkv(block)
        assert_close(A, ref_A, f"A of fuse_qkv({{{label}}})", hint=FUSE_HINT)
        assert_close(B, ref_B, f"B of fuse_qkv({{{label}}}) (scales 3, 1.5 and 0.5 for q, k, v)", hint=FUSE_HINT)


@exercise("fuse_qkv")
def test_fuse_qkv_computes_what_the_separate_adapters_do(impl):
    """B A (peft's scaling is 1) must be the update the separate adapters make to c_attn's output, whatever the
    order of A's blocks; with the same scale everywhere, so that a scale left out shows as a named factor."""
    for label, targets in _PF_BLOCKS.items():
        block = _pf_block(targets)
        A, B = impl.fuse_qkv(block)
        if tuple(A.shape)[-1:] != (D_IN,) or tuple(B.shape)[:1] != (3 * D_OUT,) or A.shape[0] != B.shape[1]:
            expect(False, f"fuse_qkv({{{label}}}): B @ A", f"B {tuple(B.shape)} and A {tuple(A.shape)} do not make "
                   f"a [{3 * D_OUT}, {D_IN}] update", observed=(tuple(A.shape), tuple(B.shape)))
        assert_close((B @ A).detach(), _pf_fused_update(block), f"B @ A of fuse_qkv({{{label}}}), c_attn's update "
                     "(rows q | k | v)", factors={"3 (the adapters' scale, alpha / rank)": 3.0,
                                                  "1/3 (one over the adapters' scale)": 1 / 3}, hint=FUSE_HINT)


@exercise("fuse_qkv")
def test_fuse_qkv_leaves_the_adapters_alone(impl):
    block = _pf_block(("q", "k", "v"))
    assert_inputs_unchanged(impl.fuse_qkv, block, what="fuse_qkv({q, k, v})")


@exercise("fuse_qkv")
def test_fuse_qkv_refuses_a_target_c_attn_does_not_compute(impl):
    block = _pf_block(("q", "v")) | {"o": _pf_lora(2, 6.0, 7, D_OUT, D_IN)}
    assert_raises(ValueError, impl.fuse_qkv, block, what="fuse_qkv({q, v, o})",
                  why="c_attn computes q, k and v only; o is attn.c_proj, a module of its own")


SPLIT_HINT = ("Each of q, k, v gets a LoRA of the c_attn LoRA's rank R, on A's device and dtype, with its own copy "
              "of A, the rows of B that write its third of c_attn's output (q rows first, then k, then v), and "
              "`scale`.")


def _pf_c_attn(rank=6, seed=0, dtype=torch.float32):
    """A c_attn LoRA as peft trains one: one A, and a dense B (no block structure)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rank, D_IN, generator=g).to(dtype), torch.randn(3 * D_OUT, rank, generator=g).to(dtype))


def _pf_fields(adapter, what):
    """adapter.A, adapter.B and adapter.scale, or a failure that says which is missing."""
    have = all(hasattr(adapter, name) for name in ("A", "B", "scale"))
    expect(have, what, f"expected a LoRA (with A, B and scale), got {type(adapter).__name__}",
           observed=type(adapter).__name__)
    return adapter.A, adapter.B, adapter.scale


@exercise("split_qkv")
def test_split_qkv_gives_q_k_and_v(impl):
    A, B = _pf_c_attn()
    out = impl.split_qkv(A.clone(), B.clone(), 0.75)
    assert_equal(sorted(out) if isinstance(out, dict) else type(out).__name__, ["k", "q", "v"],
                 "the keys of split_qkv(A, B, 0.75)", hint="a dict {'q': LoRA, 'k': LoRA, 'v': LoRA}")


@exercise("split_qkv")
def test_split_qkv_factors_of_each_adapter(impl):
    for scale, rank in ((0.75, 6), (2.0, 3)):
        A, B = _pf_c_attn(rank, seed=rank)
        out, expected = impl.split_qkv(A.clone(), B.clone(), scale), ref.split_qkv(A, B, scale)
        for t in ("q", "k", "v"):
            got_A, got_B, got_scale = _pf_fields(out[t], f"split_qkv(...)['{t}']")
            assert_close(got_A, expected[t].A, f"split_qkv(A, B, {scale})['{t}'].A (rank {rank})", hint=SPLIT_HINT)
            assert_close(got_B, expected[t].B, f"split_qkv(A, B, {scale})['{t}'].B (rank {rank})", hint=SPLIT_HINT)
            assert_equal(float(got_scale), scale, f"split_qkv(A, B, {scale})['{t}'].scale", hint=SPLIT_HINT)


@exercise("split_qkv")
def test_split_qkv_computes_what_the_c_attn_lora_does(impl):
    A, B = _pf_c_attn(6, seed=3)
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
    A, B = _pf_c_attn()
    out = impl.split_qkv(A, B.clone(), 0.75)
    pointers = [A.data_ptr()] + [_pf_fields(out[t], f"split_qkv(...)['{t}']")[0].data_ptr() for t in ("q", "k", "v")]
    expect(len(set(pointers)) == 4, "the A of each adapter split_qkv returns", "the adapters' A share memory with "
           "each other or with the A given: give each adapter its own copy (lora.A.copy_(A), not lora.A = A)",
           observed=len(set(pointers)))
    for t in ("q", "k", "v"):
        trainable = isinstance(out[t].A, torch.nn.Parameter) and out[t].A.requires_grad
        expect(trainable, f"split_qkv(...)['{t}'].A", "it is not a trainable Parameter: the adapters must train "
               "like make_adapters' (build each with LoRA(...) and copy into its A and B)", observed=trainable)


@exercise("split_qkv")
def test_split_qkv_keeps_the_dtype_and_leaves_its_inputs_alone(impl):
    A, B = _pf_c_attn(4, seed=5, dtype=torch.float64)
    out = assert_inputs_unchanged(impl.split_qkv, A, B, 1.5, what="split_qkv(A, B, 1.5)")
    dtypes = [str(_pf_fields(out[t], f"split_qkv(...)['{t}']")[1].dtype) for t in ("q", "k", "v")]
    assert_equal(dtypes, ["torch.float64"] * 3, "the dtype of the adapters split_qkv makes from float64 A and B",
                 hint="make each LoRA, then .to(device=A.device, dtype=A.dtype), before copying A and B in")


@exercise("split_qkv")
def test_split_qkv_refuses_rows_that_are_not_three_thirds(impl):
    A, B = _pf_c_attn()
    assert_raises(ValueError, impl.split_qkv, A, B[:-1], 0.75, what="split_qkv(A, B with 35 rows, 0.75)",
                  why="c_attn's output is q, k and v, three blocks of n_heads * d_head rows")


def test_split_qkv_refuses_a_scale_that_is_not_positive():
    A, B = _pf_c_attn()
    with pytest.raises(ValueError, match="scale must be a number > 0"):
        ref.split_qkv(A, B, 0.0)
    with pytest.raises(ValueError, match="adapters must be non-empty"):
        ref.fuse_qkv({})


# --- fuse_qkv's wrong versions ---

@mistake("values")
def _fuse_qkv_scale_not_folded(adapters):
    """B holds each adapter's B without its scale (alpha / rank). peft multiplies lora_B(lora_A(x)) by its own
    scaling only, which is 1 here (lora_alpha = rank): fold each adapter's scale into its block of B."""
    A, B = ref.fuse_qkv(adapters)
    column = 0
    for t in (t for t in ("q", "k", "v") if t in adapters):
        rank = adapters[t].A.shape[0]
        B[:, column:column + rank] /= adapters[t].scale
        column += rank
    return A, B


@mistake("values")
def _fuse_qkv_rows_by_position(adapters):
    """Each adapter's block of B was put in the rows of its position among the adapters given, not of its target:
    with only q and v, v's update landed in k's rows. c_attn's rows are fixed, q then k then v, each n_heads * d_head
    rows: leave a target with no adapter as zero rows."""
    names = [t for t in ("q", "k", "v") if t in adapters]
    d_out = adapters[names[0]].B.shape[0]
    A = torch.cat([adapters[t].A.detach() for t in names])
    B = A.new_zeros(3 * d_out, A.shape[0])
    column = 0
    for i, t in enumerate(names):
        rank = adapters[t].A.shape[0]
        B[i * d_out:(i + 1) * d_out, column:column + rank] = adapters[t].B.detach() * adapters[t].scale
        column += rank
    return A, B


@mistake("values")
def _fuse_qkv_A_in_the_dicts_order(adapters):
    """A stacks the adapters' A in the order the dict gives them, while B's columns follow q, k, v: a target's rows
    of B then multiply another target's A. Stack A in the order q, k, v, as B's columns are."""
    names = [t for t in ("q", "k", "v") if t in adapters]
    _, B = ref.fuse_qkv(adapters)
    return torch.cat([adapters[t].A.detach() for t in adapters if t in names]), B


@mistake("values")
def _fuse_qkv_one_shared_A(adapters):
    """The rank was kept at r: the first adapter's A stands for all of them and B stacks their B's. That is right
    only if the adapters share one A, and separately trained q, k and v adapters do not: stack their A's (rank =
    the sum of the ranks) and make B block-structured."""
    names = [t for t in ("q", "k", "v") if t in adapters]
    first = adapters[names[0]]
    d_out = first.B.shape[0]
    B = first.A.new_zeros(3 * d_out, first.A.shape[0])
    for t in names:
        row = ("q", "k", "v").index(t) * d_out
        B[row:row + d_out] = adapters[t].B.detach() * adapters[t].scale
    return first.A.detach().clone(), B


@mistake("values")
def _fuse_qkv_B_not_block_diagonal(adapters):
    """Each target's rows of B hold its B in every column block, so its rows also read the other adapters' A: q's
    output gets B_q (A_q + A_k + A_v) x. Put a target's B only in the columns of its own A, zeros elsewhere."""
    names = [t for t in ("q", "k", "v") if t in adapters]
    A, B = ref.fuse_qkv(adapters)
    d_out = adapters[names[0]].B.shape[0]
    column = 0
    for t in names:
        rank = adapters[t].A.shape[0]
        row = ("q", "k", "v").index(t) * d_out
        block = B[row:row + d_out, column:column + rank].clone()
        for other in range(0, A.shape[0], rank):
            B[row:row + d_out, other:other + rank] = block
        column += rank
    return A, B


@mistake("values")
def _fuse_qkv_transposed_for_conv1d(adapters):
    """A and B were transposed because GPT-2's Conv1D stores its weight [d_in, d_out]. peft's lora_A and lora_B are
    nn.Linear layers on every module, Conv1D included: lora_A.weight is [rank, d_in], lora_B.weight [d_out, rank]
    (fan_in_fan_out only transposes the update when it is merged into the weight)."""
    A, B = ref.fuse_qkv(adapters)
    return B.T.contiguous(), A.T.contiguous()


@mistake("inputs")
def _fuse_qkv_scales_B_in_place(adapters):
    """Each adapter's scale was folded into its own B in place (adapter.B.data *= scale): the adapters the caller
    trains now compute scale² B A. Multiply a copy: B = adapter.B.detach() * adapter.scale."""
    scales = {t: adapter.scale for t, adapter in adapters.items()}
    for adapter in adapters.values():
        adapter.B.data.mul_(adapter.scale)
        adapter.scale = 1.0
    try:
        return ref.fuse_qkv(adapters)
    finally:
        for t, adapter in adapters.items():
            adapter.scale = scales[t]


@mistake("gradient")
def _fuse_qkv_not_detached(adapters):
    """A still carries the adapters' gradient graph (torch.cat of the parameters, without .detach()): A and B are
    values to write to a file, not part of a training step. Detach them (adapter.A.detach(), adapter.B.detach())."""
    _, B = ref.fuse_qkv(adapters)
    return torch.cat([adapters[t].A for t in ("q", "k", "v") if t in adapters]), B


@mistake("error")
def _fuse_qkv_ignores_other_targets(adapters):
    """An adapter on another target (o, mlp_in, ...) was silently left out. c_attn computes q, k and v only: refuse
    any other key with a ValueError that says so."""
    return ref.fuse_qkv({t: a for t, a in adapters.items() if t in ("q", "k", "v")})


MUTANTS["fuse_qkv"] = [_fuse_qkv_scale_not_folded, _fuse_qkv_rows_by_position, _fuse_qkv_A_in_the_dicts_order,
                       _fuse_qkv_one_shared_A, _fuse_qkv_B_not_block_diagonal, _fuse_qkv_transposed_for_conv1d,
                       _fuse_qkv_scales_B_in_place, _fuse_qkv_not_detached, _fuse_qkv_ignores_other_targets]


# --- split_qkv's wrong versions ---

def _pf_split(A, B, scale, rows, rank_slices=None, alpha=None, share=False, dtype=True):
    """split_qkv with a twist: `rows[t]` the rows of B for target t, `rank_slices[t]` a slice of the rank, `alpha`
    the LoRA's alpha (None: scale * rank), `share`: one A Parameter for all three, `dtype`: follow A's dtype."""
    out, shared = {}, None
    for t in ("q", "k", "v"):
        a, b = A, B[rows[t]]
        if rank_slices is not None:
            a, b = A[rank_slices[t]], b[:, rank_slices[t]]
        rank = a.shape[0]
        lora = LoRA(A.shape[1], b.shape[0], rank=rank, alpha=alpha if alpha is not None else scale * rank)
        if dtype:
            lora = lora.to(device=A.device, dtype=A.dtype)
        with torch.no_grad():
            lora.A.copy_(a)
            lora.B.copy_(b)
        if alpha is None:
            lora.scale = scale
        if share:
            shared = shared if shared is not None else torch.nn.Parameter(A)
            lora.A = shared
        out[t] = lora
    return out


def _pf_thirds(B):
    d = B.shape[0] // 3
    return {t: slice(i * d, (i + 1) * d) for i, t in enumerate(("q", "k", "v"))}


@mistake("values")
def _split_qkv_interleaved_rows(A, B, scale):
    """q, k and v were taken as every third row of B (a per-row interleaving, like some fused layouts). GPT-2's
    c_attn writes [q | k | v]: three contiguous blocks of n_heads * d_head rows, q first."""
    return _pf_split(A, B, scale, {t: slice(i, None, 3) for i, t in enumerate(("q", "k", "v"))})


@mistake("values")
def _split_qkv_chunks_the_rank(A, B, scale):
    """The rank was cut in three, q taking the first third of A's rows and of B's columns: that undoes the block
    structure fuse_qkv writes, but a c_attn LoRA that peft trained has one shared A and a dense B, where every
    target reads all of A. Give each adapter the whole A and its rows of B."""
    rank = A.shape[0]
    third = rank // 3
    cuts = {t: slice(i * third, (i + 1) * third) for i, t in enumerate(("q", "k", "v"))}
    return _pf_split(A, B, scale, _pf_thirds(B), rank_slices=cuts)


@mistake("values")
def _split_qkv_scale_dropped(A, B, scale):
    """The adapters were built with LoRA's default alpha (16), so their scale is 16 / rank, not the c_attn LoRA's
    `scale`: build each with alpha = scale * rank (and set lora.scale = scale)."""
    return _pf_split(A, B, scale, _pf_thirds(B), alpha=16.0)


@mistake("values")
def _split_qkv_shares_A(A, B, scale):
    """The three adapters share one A Parameter (wrapping the caller's A): training q would move k's and v's A, and
    the tensor read from the file. Give each adapter its own copy: lora.A.copy_(A) inside torch.no_grad()."""
    return _pf_split(A, B, scale, _pf_thirds(B), share=True)


@mistake("values")
def _split_qkv_float32_always(A, B, scale):
    """The adapters stay float32 (LoRA's default) whatever A's dtype: move each to A's device and dtype
    (lora.to(device=A.device, dtype=A.dtype)) before copying A and B in."""
    return _pf_split(A, B, scale, _pf_thirds(B), dtype=False)


@mistake("inputs")
def _split_qkv_folds_the_scale_into_B_in_place(A, B, scale):
    """The scale was folded into the caller's B in place (B.mul_(scale)) and the adapters given scale 1: the file's
    tensors change under the caller. Keep B as it is and give each adapter `scale`."""
    B.mul_(scale)
    return _pf_split(A, B, 1.0, _pf_thirds(B))


@mistake("error")
def _split_qkv_no_refusal(A, B, scale):
    """B with a number of rows that is not a multiple of 3 was cut anyway (rows // 3 each, the rest dropped): it is
    not a c_attn LoRA. Raise a ValueError that says what B's rows must be."""
    return _pf_split(A, B, scale, _pf_thirds(B))


MUTANTS["split_qkv"] = [_split_qkv_interleaved_rows, _split_qkv_chunks_the_rank, _split_qkv_scale_dropped,
                        _split_qkv_shares_A, _split_qkv_float32_always, _split_qkv_folds_the_scale_into_B_in_place,
                        _split_qkv_no_refusal]


# --- peft_state_dict ---

D_MODEL, D_MLP = 10, 16  # with D_OUT = 12 = n_heads * d_head: the dims of the blocks these tests make up


def _pf_adapters(spec, seed=0):
    """An nn.ModuleDict like make_adapters' for `spec` = {layer: targets}, with random A and B and, for each
    target, its own scale (alpha 6, 3, 1.5, ... over rank 2)."""
    dims = {"q": (D_MODEL, D_OUT), "k": (D_MODEL, D_OUT), "v": (D_MODEL, D_OUT), "o": (D_OUT, D_MODEL),
            "mlp_in": (D_MODEL, D_MLP), "mlp_out": (D_MLP, D_MODEL)}
    adapters = torch.nn.ModuleDict()
    for layer, targets in spec.items():
        for i, t in enumerate(targets):
            adapters[f"L{layer}_{t}"] = _pf_lora(2, 6.0 / 2 ** i, seed + 10 * layer + i, *dims[t])
    return adapters


# the main job's q and v in two blocks; and every target, o and the MLP included, in block 1 only
_PF_SPECS = {"q, v in blocks 0 and 1": {0: ("q", "v"), 1: ("q", "v")},
             "o, mlp_in, mlp_out, q, k, v in block 1": {1: ("o", "mlp_in", "mlp_out", "q", "k", "v")}}

PSD_HINT = ("Keys 'base_model.model.transformer.h.{layer}.{module}.lora_A.weight' and '....lora_B.weight', the module "
            "from HF_MODULES (q, k, v -> attn.c_attn, fused by fuse_qkv; o -> attn.c_proj; mlp_in -> mlp.c_fc; "
            "mlp_out -> mlp.c_proj); A as it is and B times the adapter's scale, so that peft's scaling is 1.")


@exercise("peft_state_dict")
def test_peft_state_dict_keys(impl):
    for label, spec in _PF_SPECS.items():
        adapters = _pf_adapters(spec)
        out = impl.peft_state_dict(adapters)
        assert_equal(sorted(out) if isinstance(out, dict) else type(out).__name__,
                     sorted(ref.peft_state_dict(adapters)), f"the keys of peft_state_dict({label})", hint=PSD_HINT)


@exercise("peft_state_dict")
def test_peft_state_dict_tensors(impl):
    for label, spec in _PF_SPECS.items():
        adapters = _pf_adapters(spec)
        out, expected = impl.peft_state_dict(adapters), ref.peft_state_dict(adapters)
        for key, tensor in expected.items():
            expect(key in out, f"peft_state_dict({label})", f"it has no {key!r}", observed=sorted(out))
            assert_close(out[key], tensor, f"peft_state_dict({label})[{key.removeprefix('base_model.model.')!r}]",
                         factors={"3 (the scale of the first target)": 3.0, "1/3": 1 / 3}, hint=PSD_HINT)


@exercise("peft_state_dict")
def test_peft_state_dict_leaves_the_adapters_alone(impl):
    adapters = _pf_adapters(_PF_SPECS["o, mlp_in, mlp_out, q, k, v in block 1"])
    assert_inputs_unchanged(impl.peft_state_dict, adapters, what="peft_state_dict(adapters)")


@mistake("values")
def _peft_state_dict_without_the_prefix(adapters):
    """The keys lack peft's prefix: PeftModel wraps the Hugging Face model twice (PeftModel.base_model is a
    LoraModel whose .model is yours), so peft's keys start with 'base_model.model.' before the module's name."""
    return {k.removeprefix("base_model.model."): t for k, t in ref.peft_state_dict(adapters).items()}


@mistake("values")
def _peft_state_dict_with_the_adapter_name(adapters):
    """The keys keep the adapter's name ('lora_A.default.weight'), as the parameters are named inside a PeftModel;
    peft's files leave it out ('lora_A.weight'), because the name is chosen when the adapter is loaded."""
    return {k.replace(".weight", ".default.weight"): t for k, t in ref.peft_state_dict(adapters).items()}


@mistake("values")
def _peft_state_dict_scale_only_in_c_attn(adapters):
    """The scale was folded into c_attn's B (by fuse_qkv) but not into the other modules' B: peft's scaling is 1
    for every module (lora_alpha = its rank), so o's, mlp_in's and mlp_out's B must carry their scale too."""
    tensors = ref.peft_state_dict(adapters)
    for key, adapter in adapters.items():
        layer, target = key[1:].split("_", 1)
        if target not in ("q", "k", "v"):
            name = f"base_model.model.transformer.h.{layer}.{ref.HF_MODULES[target]}.lora_B.weight"
            tensors[name] = adapter.B.detach().clone()
    return tensors


@mistake("values")
def _peft_state_dict_mlp_modules_swapped(adapters):
    """mlp_in and mlp_out went to each other's module: mlp_in is the MLP's first layer, mlp.c_fc (d_model ->
    d_mlp), and mlp_out its second, mlp.c_proj (d_mlp -> d_model)."""
    swap = {"mlp.c_fc": "mlp.c_proj", "mlp.c_proj": "mlp.c_fc"}
    out = {}
    for key, tensor in ref.peft_state_dict(adapters).items():
        module = next((m for m in swap if f".{m}." in key), None)
        out[key.replace(f".{module}.", f".{swap[module]}.") if module else key] = tensor
    return out


@mistake("values")
def _peft_state_dict_q_k_v_one_by_one(adapters):
    """q, k and v were each written under attn.c_attn's keys, one after the other, so the last one overwrote the
    others (and wrote its update into q's rows). c_attn computes all three: fuse a block's q, k and v adapters into
    one LoRA with fuse_qkv."""
    tensors = {}
    for key, adapter in adapters.items():
        layer, target = key[1:].split("_", 1)
        name = f"base_model.model.transformer.h.{layer}.{ref.HF_MODULES[target]}"
        B = adapter.B.detach() * adapter.scale
        if target in ("q", "k", "v"):
            B = torch.cat([B, torch.zeros_like(B), torch.zeros_like(B)])
        tensors[f"{name}.lora_A.weight"] = adapter.A.detach().clone()
        tensors[f"{name}.lora_B.weight"] = B
    return tensors


@mistake("inputs")
def _peft_state_dict_scales_in_place(adapters):
    """Each adapter's scale was folded into its own B in place, and its scale set to 1: the same function, but the
    caller's adapters are changed (a second export would fold the scale in again). Multiply a copy instead."""
    for adapter in adapters.values():
        adapter.B.data.mul_(adapter.scale)
        adapter.scale = 1.0
    return ref.peft_state_dict(adapters)


MUTANTS["peft_state_dict"] = [_peft_state_dict_without_the_prefix, _peft_state_dict_with_the_adapter_name,
                              _peft_state_dict_scale_only_in_c_attn, _peft_state_dict_mlp_modules_swapped,
                              _peft_state_dict_q_k_v_one_by_one, _peft_state_dict_scales_in_place]


# --- the provided export and import, against peft itself ---

def _pf_peft():
    return pytest.importorskip("peft", reason="peft is not installed: pip install -r requirements.txt")


def _pf_random_adapters(model, targets, rank=4, alpha=8.0, seed=0):
    """make_adapters' adapters with a random B (B = 0 would make every export look right)."""
    g = torch.Generator().manual_seed(seed)
    adapters = make_adapters(model, rank, alpha, targets)
    with torch.no_grad():
        for adapter in adapters.values():
            adapter.B.copy_(torch.randn(adapter.B.shape, generator=g) * 0.5)
    return adapters


def _pf_tokens(seed=0):
    return torch.randint(0, 350, (3, 12), generator=torch.Generator().manual_seed(seed))


def _pf_peft_logits(model, folder, tokens):
    peft_model = _pf_peft().PeftModel.from_pretrained(ref.hf_model_of(model), str(folder)).eval()
    with torch.no_grad():
        return peft_model(input_ids=tokens).logits


def test_hf_model_of_computes_what_the_bridge_does(tiny_model):
    tokens = _pf_tokens()
    hf = ref.hf_model_of(tiny_model)
    with torch.no_grad():
        assert_close(hf(input_ids=tokens).logits, tiny_model(tokens), "the plain Hugging Face twin's logits",
                     atol=1e-4)
    expect(hf is not tiny_model.original_model and type(hf).__name__ == "GPT2LMHeadModel", "hf_model_of(model)",
           "expected a separate GPT2LMHeadModel")


@pytest.mark.parametrize("targets", [("q",), ("k",), ("v",), ("o",), ("mlp_in",), ("mlp_out",), ("q", "v"),
                                     ("q", "k", "v", "o", "mlp_in", "mlp_out")], ids="+".join)
def test_export_then_peft_computes_what_the_hooks_compute(tiny_model, tmp_path, targets):
    """PeftModel.from_pretrained(Hugging Face model, exported folder) gives our hooked model's logits, for every
    target the course has, the main job's q and v included (k's rows of c_attn then stay 0)."""
    adapters = _pf_random_adapters(tiny_model, targets)
    tokens = _pf_tokens()
    ref.export_peft_adapter(tiny_model, adapters, tmp_path / "adapter")
    theirs = _pf_peft_logits(tiny_model, tmp_path / "adapter", tokens)
    with torch.no_grad():
        ours, base = LoRAModel(tiny_model, adapters)(tokens), tiny_model(tokens)
    expect((ours - base).abs().max().item() > 0.1, "the test's adapters", "they barely change the logits, so the "
           "comparison would show nothing")
    assert_close(theirs, ours, f"peft's logits with the exported {'+'.join(targets)} adapter", atol=1e-4)
    imported = ref.import_peft_adapter(tiny_model, tmp_path / "adapter")
    with torch.no_grad():
        assert_close(LoRAModel(tiny_model, imported)(tokens), theirs, "the exported folder read back", atol=1e-4)


def test_export_writes_peft_s_format(tiny_model, tmp_path):
    peft_lib = _pf_peft()
    adapters = _pf_random_adapters(tiny_model, ("q", "k", "v", "o"), rank=4, alpha=8.0)
    folder = ref.export_peft_adapter(tiny_model, adapters, tmp_path / "a" / "b")
    assert_equal(sorted(p.name for p in folder.iterdir()), ["adapter_config.json", "adapter_model.safetensors"],
                 "the files of the exported folder")
    config = json.loads((folder / "adapter_config.json").read_text())
    n = tiny_model.cfg.n_layers
    c_attn = [f"transformer.h.{i}.attn.c_attn" for i in range(n)]
    c_proj = [f"transformer.h.{i}.attn.c_proj" for i in range(n)]
    assert_equal({k: config[k] for k in ("peft_type", "r", "lora_alpha", "fan_in_fan_out", "bias", "use_dora")},
                 {"peft_type": "LORA", "r": 12, "lora_alpha": 12, "fan_in_fan_out": True, "bias": "none",
                  "use_dora": False}, "the exported config (c_attn: rank 3 x 4, scaling 1)")
    assert_equal(sorted(config["target_modules"]), sorted(c_attn + c_proj), "the exported target_modules")
    assert_equal(config["rank_pattern"], {m: 4 for m in c_proj}, "rank_pattern (c_proj has rank 4)")
    assert_equal(config["alpha_pattern"], {m: 4 for m in c_proj}, "alpha_pattern (scaling 1 on c_proj too)")
    assert_equal(config["base_model_name_or_path"], "utils/tiny_model", "base_model_name_or_path")
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    assert_equal(sorted((k, tuple(t.shape)) for k, t in tensors.items() if ".h.0." in k),
                 [("base_model.model.transformer.h.0.attn.c_attn.lora_A.weight", (12, 128)),
                  ("base_model.model.transformer.h.0.attn.c_attn.lora_B.weight", (384, 12)),
                  ("base_model.model.transformer.h.0.attn.c_proj.lora_A.weight", (4, 128)),
                  ("base_model.model.transformer.h.0.attn.c_proj.lora_B.weight", (128, 4))],
                 "the tensors of block 0")
    loaded = peft_lib.PeftConfig.from_pretrained(str(folder))  # peft's own reader takes it as it is
    assert_equal((type(loaded).__name__, loaded.r, loaded.fan_in_fan_out), ("LoraConfig", 12, True),
                 "peft's reading of the config")


def test_auto_peft_model_loads_the_export_with_its_base_model(tiny_model, tmp_path, monkeypatch):
    """AutoPeftModelForCausalLM loads the base model from base_model_name_or_path (the embedded model's folder,
    relative to the repository's root) and the adapter on top: the hooked model's logits again."""
    peft_lib = _pf_peft()
    from utils.harness import ROOT

    adapters = _pf_random_adapters(tiny_model, ("q", "v", "mlp_out"))
    ref.export_peft_adapter(tiny_model, adapters, tmp_path / "adapter")
    monkeypatch.chdir(ROOT)
    auto = peft_lib.AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "adapter")).eval()
    tokens = _pf_tokens(2)
    with torch.no_grad():
        assert_close(auto(input_ids=tokens).logits, LoRAModel(tiny_model, adapters)(tokens),
                     "AutoPeftModelForCausalLM's logits with the exported adapter", atol=1e-4)


def test_script_refuses_a_meaningless_flag_before_loading_anything(capsys):
    with pytest.raises(SystemExit) as exit_:
        ref.main(["--steps", "-1"])
    assert_equal(exit_.value.code, 2, "the exit status of `python -m solutions.part7_production --steps -1`")
    expect("--steps: expected an integer >= 0" in capsys.readouterr().err, "the refusal of --steps -1",
           "it should say what --steps must be")


def test_export_refuses_what_the_model_lacks(tiny_model, tmp_path):
    adapters = _pf_random_adapters(tiny_model, ("q",))
    adapters["L9_q"] = adapters["L0_q"]
    with pytest.raises(ValueError, match="names no weight of this model"):
        ref.export_peft_adapter(tiny_model, adapters, tmp_path / "a")
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError, match="a peft adapter is a folder"):
        ref.export_peft_adapter(tiny_model, _pf_random_adapters(tiny_model, ("q",)), tmp_path / "file")


_PF_PEFT_CONFIGS = {
    "c_attn only": dict(target_modules=["c_attn"]),
    "every module, c_proj naming both": dict(target_modules=["c_attn", "c_proj", "c_fc"]),
    "rank and alpha patterns": dict(target_modules=["c_attn", "c_fc"], rank_pattern={"c_fc": 2},
                                    alpha_pattern={"transformer.h.1.attn.c_attn": 3}),
    "rsLoRA": dict(target_modules=["c_attn", "c_proj"], use_rslora=True),
    "layers 1 and 3": dict(target_modules=["c_attn", "c_fc"], layers_to_transform=[1, 3]),
    "a regular expression": dict(target_modules=r".*\.(0|2)\.mlp\.c_proj"),
    "all-linear": dict(target_modules="all-linear"),
}


@pytest.mark.parametrize("name", list(_PF_PEFT_CONFIGS))
def test_import_of_a_folder_peft_wrote(tiny_model, tmp_path, name):
    """peft's get_peft_model + save_pretrained, with A and B both random (init_lora_weights=False), read back into
    course adapters: the hooked model's logits equal peft's."""
    peft_lib = _pf_peft()
    torch.manual_seed(1)
    config = peft_lib.LoraConfig(r=4, lora_alpha=6, fan_in_fan_out=True, init_lora_weights=False,
                                 **_PF_PEFT_CONFIGS[name])
    peft_model = peft_lib.get_peft_model(ref.hf_model_of(tiny_model), config).eval()
    peft_model.save_pretrained(str(tmp_path))
    tokens = _pf_tokens(1)
    adapters = ref.import_peft_adapter(tiny_model, tmp_path)
    with torch.no_grad():
        theirs, ours = peft_model(input_ids=tokens).logits, LoRAModel(tiny_model, adapters)(tokens)
        base = tiny_model(tokens)
    expect((theirs - base).abs().max().item() > 0.1, f"peft's adapter ({name})", "it barely changes the logits")
    assert_close(ours, theirs, f"the hooked model with peft's adapter ({name}) read back", atol=1e-4)
    if name == "c_attn only":
        assert_equal(list(adapters), [f"L{i}_{t}" for i in range(4) for t in ("q", "k", "v")],
                     "the adapters a c_attn LoRA becomes")
        a = adapters["L0_q"].A
        expect(a.data_ptr() not in (adapters["L0_k"].A.data_ptr(), adapters["L0_v"].A.data_ptr()),
               "the q, k and v adapters of a c_attn LoRA", "they share one A tensor: each must keep its own copy")


def _pf_write(folder: Path, config: dict | None = None, tensors: dict | None = None):
    folder.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (folder / "adapter_config.json").write_text(json.dumps(config))
    if tensors is not None:
        save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def _pf_exported(model, folder, targets=("q", "v")):
    """A valid folder (ours), and its config and tensors to spoil."""
    ref.export_peft_adapter(model, _pf_random_adapters(model, targets), folder)
    return (json.loads((folder / "adapter_config.json").read_text()),
            load_file(str(folder / "adapter_model.safetensors")))


def _pf_peft_saved(model, folder, **settings):
    peft_lib = _pf_peft()
    kind = settings.pop("kind", "LoraConfig")
    config = getattr(peft_lib, kind)(**settings)
    peft_lib.get_peft_model(ref.hf_model_of(model), config).save_pretrained(str(folder))
    return folder


@pytest.mark.parametrize("case, match", [
    ("DoRA", "use_dora=True: DoRA"),
    ("the token embedding", "the token embedding, which the course has no LoRA hook for"),
    ("the unembedding", "the unembedding \\(lm_head\\), which the course has no LoRA hook for"),
    ("modules_to_save", "modules_to_save"),
    ("bias all", "bias='all'"),
    ("LoHa", "'LOHA' adapter, not a LoRA"),
])
def test_import_refuses_what_peft_can_write_but_a_course_adapter_cannot_hold(tiny_model, tmp_path, case, match):
    settings = {
        "DoRA": dict(target_modules=["c_attn"], use_dora=True, fan_in_fan_out=True),
        "the token embedding": dict(target_modules=["c_attn", "wte"], fan_in_fan_out=True),
        "the unembedding": dict(target_modules=["lm_head"]),
        "modules_to_save": dict(target_modules=["c_attn"], modules_to_save=["ln_f"], fan_in_fan_out=True),
        "bias all": dict(target_modules=["c_attn"], bias="all", fan_in_fan_out=True),
        "LoHa": dict(kind="LoHaConfig", target_modules=["lm_head"]),  # LoHa has no Conv1D layer
    }[case]
    folder = _pf_peft_saved(tiny_model, tmp_path / "a", **settings)
    with pytest.raises(ValueError, match=match):
        ref.import_peft_adapter(tiny_model, folder)


def test_import_refuses_configs_that_are_not_plain_lora(tiny_model, tmp_path):
    config, tensors = _pf_exported(tiny_model, tmp_path / "good")
    for field, value, match in [("init_lora_weights", "pissa", "changes the base weights"),
                                ("lora_bias", True, "its B has a bias"),
                                ("alora_invocation_tokens", [5, 6], "aLoRA"),
                                ("a_future_variant", {"x": 1}, "which this reader does not know"),
                                ("r", "four", "no number 'r'")]:
        folder = _pf_write(tmp_path / field, config | {field: value}, tensors)
        with pytest.raises(ValueError, match=match):
            ref.import_peft_adapter(tiny_model, folder)


def test_import_refuses_missing_and_malformed_files(tiny_model, tmp_path):
    config, tensors = _pf_exported(tiny_model, tmp_path / "good")
    with pytest.raises(FileNotFoundError, match="no peft adapter folder"):
        ref.import_peft_adapter(tiny_model, tmp_path / "nowhere")
    with pytest.raises(NotADirectoryError, match="pass the folder"):
        ref.import_peft_adapter(tiny_model, tmp_path / "good" / "adapter_config.json")
    with pytest.raises(FileNotFoundError, match="has no adapter_config.json"):
        ref.import_peft_adapter(tiny_model, _pf_write(tmp_path / "no_config", None, tensors))
    bad_json = _pf_write(tmp_path / "bad_json", None, tensors)
    (bad_json / "adapter_config.json").write_text("{'r': 4")
    with pytest.raises(ValueError, match="not valid JSON"):
        ref.import_peft_adapter(tiny_model, bad_json)
    (_pf_write(tmp_path / "list", None, tensors) / "adapter_config.json").write_text("[]")
    with pytest.raises(ValueError, match="not a JSON object"):
        ref.import_peft_adapter(tiny_model, tmp_path / "list")
    with pytest.raises(FileNotFoundError, match="no adapter_model.safetensors: write"):
        ref.import_peft_adapter(tiny_model, _pf_write(tmp_path / "no_tensors", config))
    pickled = _pf_write(tmp_path / "pickled", config)
    torch.save(tensors, pickled / "adapter_model.bin")
    with pytest.raises(FileNotFoundError, match="adapter_model.bin, a pickle"):
        ref.import_peft_adapter(tiny_model, pickled)
    cut = _pf_write(tmp_path / "cut", config)
    whole = (tmp_path / "good" / "adapter_model.safetensors").read_bytes()
    (cut / "adapter_model.safetensors").write_bytes(whole[:len(whole) // 2])
    with pytest.raises(ValueError, match="cannot be read: it is truncated"):
        ref.import_peft_adapter(tiny_model, cut)


def test_import_refuses_tensors_that_do_not_match_the_config_or_the_model(tiny_model, tmp_path):
    config, tensors = _pf_exported(tiny_model, tmp_path / "good")
    key = "base_model.model.transformer.h.2.attn.c_attn.lora_B.weight"
    cases = [
        ("missing module", config, {k: t for k, t in tensors.items() if ".h.2." not in k},
         "targeted but without tensors \\['transformer.h.2.attn.c_attn'\\]"),
        ("untargeted module", config | {"target_modules": ["transformer.h.0.attn.c_attn"]}, tensors,
         "tensors but not targeted"),
        ("rank", config | {"r": 4, "lora_alpha": 4}, tensors, "with rank 4 this model needs"),
        ("missing B", config, {k: t for k, t in tensors.items() if k != key}, "its factors of transformer.h.2"),
        ("another model's block", config | {"target_modules": ["c_attn"]},
         tensors | {k.replace(".h.2.", ".h.7."): t.clone() for k, t in tensors.items() if ".h.2." in k},
         "this model has 4 blocks"),
        ("not a LoRA factor", config, tensors | {"base_model.model.transformer.h.0.attn.c_attn.weight":
                                                 torch.zeros(3)}, "is not a LoRA factor"),
        ("a module with no hook", config, tensors | {"base_model.model.transformer.ln_f.lora_A.weight":
                                                     torch.zeros(3)}, "'transformer.ln_f', which the course has no"),
    ]
    for name, bad_config, bad_tensors, match in cases:
        folder = _pf_write(tmp_path / name.replace(" ", "_").replace("'", ""), bad_config, bad_tensors)
        with pytest.raises(ValueError, match=match):
            ref.import_peft_adapter(tiny_model, folder)


@pytest.mark.slow
def test_script_exports_an_adapter_and_peft_agrees(tiny_model, tmp_path):
    """The script on a file written by Part 2's save_adapter with the main job's settings, B random (a 3-step
    smoke run would barely move B, and show nothing)."""
    from solutions.part2_lora import save_adapter

    _pf_peft()
    save_adapter(_pf_random_adapters(tiny_model, ("q", "v"), rank=4, alpha=8.0), tmp_path / "main.safetensors")
    _, figures = run_script("solutions.part7_production", "--json", "--adapter", str(tmp_path / "main.safetensors"),
                            "--out", str(tmp_path / "adapter"))
    expect(figures["max_logit_change_from_the_adapter"] > 0.1, "the script's adapter", "it barely changes the logits")
    expect(figures["max_logit_difference_peft_vs_hooks"] < 1e-4, "the script's peft-vs-hooks difference",
           f"got {figures['max_logit_difference_peft_vs_hooks']}")
    expect(figures["max_logit_difference_read_back_vs_peft"] < 1e-4, "the script's read-back difference",
           f"got {figures['max_logit_difference_read_back_vs_peft']}")
    assert_equal(figures["accuracy_peft"], figures["accuracy_hooks"], "held-out accuracy, peft against hooks")
    assert_equal(figures["files"], ["adapter_config.json", "adapter_model.safetensors"], "the folder's files")
    assert_equal(figures["steps"], 0, "the steps trained when an adapter file is given")


def test_export_refuses_an_empty_adapter_set(tiny_model, tmp_path):
    """No adapter at all is a mistake (a wrong target list, a filter that dropped everything), not an empty folder."""
    with pytest.raises(ValueError, match="export_peft_adapter: adapters must be non-empty"):
        ref.export_peft_adapter(tiny_model, torch.nn.ModuleDict(), tmp_path / "adapter")
    assert not (tmp_path / "adapter").exists(), "nothing is written before the refusal"


# === end: peft =====================================================================================================


# === section: trl ==================================================================================================
# The knob table (solutions/production/knobs.py), to_trl_config, the TRL run (solutions/production/trl_grpo.py) and
# the accelerate configs. What needs trl, peft or accelerate is skipped, with the reason, without them.

import dataclasses  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402, F811
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from solutions.part3_grpo import GRPOConfig  # noqa: E402
from solutions.production import knobs  # noqa: E402

EXTRAS = "pip install -r requirements-bench.txt (trl, peft, accelerate)"
ACCELERATE_CONFIGS = Path(__file__).resolve().parent.parent / "solutions" / "production" / "accelerate_configs"


def needs(module: str):
    return pytest.mark.skipif(importlib.util.find_spec(module) is None, reason=f"{module} is not installed: {EXTRAS}")


def test_knob_table_has_a_row_for_every_field_of_our_config():
    ours = [f.name for f in dataclasses.fields(GRPOConfig)]
    assert_equal(sorted(knobs.GRPO_TO_TRL), sorted(ours), "the fields of GRPOConfig in knobs.GRPO_TO_TRL",
                 hint="a new GRPOConfig field needs its row: its trl.GRPOConfig name, or None and why")
    for name, knob in knobs.GRPO_TO_TRL.items():
        expect(bool(knob.how.strip()), f"GRPO_TO_TRL[{name!r}].how", "says nothing")
        expect(knob.trl is not None or knob.how, f"GRPO_TO_TRL[{name!r}]", "has neither a TRL name nor a reason")


@needs("trl")
def test_knob_table_names_are_fields_of_the_installed_trl():
    import trl

    theirs = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    named = {k.trl for k in knobs.GRPO_TO_TRL.values() if k.trl} | set(knobs.TRL_SETTINGS)
    assert_equal(sorted(named - theirs), [], f"names in knobs.py that trl {trl.__version__}'s GRPOConfig lacks")


@needs("peft")
def test_knob_table_names_are_fields_of_the_installed_peft():
    import peft

    theirs = {f.name for f in dataclasses.fields(peft.LoraConfig)}
    named = {k.peft for k in knobs.GRPO_TO_TRL.values() if k.peft} | set(knobs.PEFT_SETTINGS)
    assert_equal(sorted(named - theirs), [], f"names in knobs.py that peft {peft.__version__}'s LoraConfig lacks")


@needs("trl")
def test_trl_accepts_the_translated_config(tmp_path):
    """trl.GRPOConfig takes to_trl_config's arguments as they are, and derives the same step: one batch of
    n_prompts × group_size completions per optimizer step, num_iterations optimizer steps per batch."""
    import trl

    for cfg in (GRPOConfig(), GRPOConfig(num_iterations=2, epsilon_high=0.28, beta=0.04, device="cpu")):
        args = trl.GRPOConfig(**ref.to_trl_config(cfg, str(tmp_path)))
        assert_equal(args.generation_batch_size, cfg.n_prompts * cfg.group_size, "TRL's generation_batch_size")
        assert_equal((args.max_steps, args.num_generations, args.steps_per_generation, args.bf16),
                     (cfg.steps * cfg.num_iterations, cfg.group_size, 1, False),
                     "TRL's (max_steps, num_generations, steps_per_generation, bf16)")
        assert_equal(str(args.lr_scheduler_type).rsplit(".", 1)[-1].lower(), "constant", "TRL's learning rate schedule")


@needs("trl")
def test_trl_computes_our_trainers_loss_with_the_translated_config(tmp_path):
    """With beta > 0, TRL's own _compute_loss, set up by to_trl_config, gives the loss and the gradient that our
    trainer's call of grpo_loss gives, off-policy included: the KL term is the same (TRL's default would multiply k3
    by the ratio, use_bias_correction_kl, which our trainer does not)."""
    import trl

    from solutions.part3_grpo import grpo_loss
    from tests.test_part3_grpo import loss_and_grad, loss_inputs, trl_loss

    logprobs, old, ref_lp, advantages, mask = loss_inputs(seed=5)
    for cfg in (GRPOConfig(beta=0.04), GRPOConfig(beta=0.5, epsilon_high=0.28, loss_type="dr_grpo", max_new_tokens=5)):
        args = trl.GRPOConfig(**ref.to_trl_config(cfg, str(tmp_path)))
        ours = loss_and_grad(grpo_loss, logprobs, old, ref_lp, advantages, mask, epsilon=cfg.epsilon,
                             epsilon_high=cfg.epsilon_high, beta=cfg.beta, loss_type=cfg.loss_type,
                             max_completion_length=cfg.max_new_tokens)  # as GRPOTrainer's step calls it
        theirs = loss_and_grad(trl_loss, logprobs, old, ref_lp, advantages, mask, epsilon=args.epsilon,
                               epsilon_high=args.epsilon_high, beta=args.beta, loss_type=args.loss_type,
                               max_completion_length=args.max_completion_length,
                               use_bias_correction_kl=args.use_bias_correction_kl)
        what = f"TRL's loss with to_trl_config(beta={cfg.beta}, loss_type={cfg.loss_type!r}) against our trainer's"
        hint = "TRL_SETTINGS must set use_bias_correction_kl=False: our trainer adds beta × k3 alone"
        assert_close(theirs[0], ours[0], what, atol=1e-5, hint=hint)
        assert_close(theirs[1], ours[1], f"{what}: gradient", atol=1e-5, hint=hint)


@needs("peft")
def test_lora_config_matches_ours_in_parameter_count():
    """peft's LoRA on c_attn (q and v asked for) trains as many parameters as ours on q and v: 8,192."""
    import copy

    from peft import LoraConfig, get_peft_model

    from solutions.part2_lora import make_adapters
    from utils.models import count_parameters, load_model, load_tiny_hf

    cfg = GRPOConfig()
    assert_equal(ref.to_lora_config(cfg)["target_modules"], ["attn.c_attn"], "peft's modules for q and v")
    hf_model, _ = load_tiny_hf()
    peft_model = get_peft_model(copy.deepcopy(hf_model), LoraConfig(**ref.to_lora_config(cfg)))
    ours = make_adapters(load_model("tiny", "cpu"), cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets)
    assert_equal(count_parameters(peft_model, trainable_only=True), sum(p.numel() for p in ours.parameters()),
                 "peft's trainable parameters against ours")
    adapted = sorted({n.rsplit(".lora_", 1)[0] for n, _ in peft_model.named_parameters() if ".lora_" in n})
    assert_equal(len(adapted), 4, "peft's adapted modules (one c_attn per block)")
    targets = ("o", "mlp_in", "mlp_out")
    assert_equal(ref.to_lora_config(GRPOConfig(lora_targets=targets))["target_modules"],
                 ["attn.c_proj", "mlp.c_fc", "mlp.c_proj"], f"peft's modules for {targets}")
    with pytest.raises(ValueError, match="lora_targets"):
        ref.to_lora_config(GRPOConfig(lora_targets=("q", "embed")))


def test_training_prompts_are_the_prompts_our_trainer_draws():
    from solutions.part3_grpo import GRPOTrainer
    from solutions.production.trl_grpo import training_prompts

    cfg = GRPOConfig(steps=3, seed=5)
    trainer = GRPOTrainer(cfg)
    assert_equal(training_prompts(cfg), [p for _ in range(cfg.steps) for p in trainer.next_prompts()],
                 "training_prompts(cfg) against GRPOTrainer.next_prompts, step after step")


@needs("peft")
def test_held_out_accuracy_of_a_fresh_peft_model_is_the_base_models():
    """B = 0: the merged copy is the base model, whose held-out accuracy is 346 / 810."""
    from peft import LoraConfig, get_peft_model

    from solutions.production.trl_grpo import held_out_accuracy
    from utils.models import load_tiny_hf

    hf_model, tokenizer = load_tiny_hf()
    peft_model = get_peft_model(hf_model, LoraConfig(**ref.to_lora_config(GRPOConfig())))
    assert_close(torch.tensor(held_out_accuracy(peft_model, tokenizer)), torch.tensor(346 / 810),
                 "held-out accuracy of the embedded model through peft's merge")
    expect(any(".lora_" in n for n, _ in peft_model.named_parameters()), "the peft model after held_out_accuracy",
           "lost its LoRA: the accuracy must be measured on a merged copy, not by merging the model in training")


@needs("accelerate")
@pytest.mark.parametrize("name, kind, processes", [("cpu_1proc", "NO", 1), ("multi_gpu_ddp", "MULTI_GPU", 8),
                                                   ("deepspeed_zero3", "DEEPSPEED", 8), ("fsdp", "FSDP", 8)])
def test_accelerate_configs_are_read_by_accelerate(name, kind, processes):
    """Each config file loads with accelerate's own reader, and every key of its deepspeed_config / fsdp_config is an
    option of the installed `accelerate launch` (which is where they end up)."""
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import launch_command_parser

    config = load_config_from_file(str(ACCELERATE_CONFIGS / f"{name}.yaml"))
    assert_equal((config.distributed_type.value, config.num_processes, config.mixed_precision),
                 (kind, processes, "no"), f"{name}.yaml: (distributed_type, num_processes, mixed_precision)")
    options = vars(launch_command_parser().parse_args(["script.py"]))
    keys = list(config.deepspeed_config) + list(config.fsdp_config)
    assert_equal([k for k in keys if k not in options], [], f"{name}.yaml: keys that `accelerate launch` lacks")
    if kind == "DEEPSPEED":
        assert_equal(config.deepspeed_config["zero_stage"], 3, "deepspeed_zero3.yaml's ZeRO stage")


@pytest.mark.parametrize("flag, value", [("--steps", "0"), ("--steps", "ten"), ("--vllm", "offline")])
def test_the_trl_script_refuses_a_meaningless_flag_in_one_line(flag, value, capsys):
    from solutions.production import trl_grpo

    with pytest.raises(SystemExit) as exit_:
        trl_grpo.main([flag, value])
    assert_equal(exit_.value.code, 2, f"the exit status of `trl_grpo {flag} {value}`")
    assert_equal(len(capsys.readouterr().err.strip().splitlines()), 1, "the lines of its error message")


@needs("trl")
def test_the_chapter_names_only_real_trl_settings_and_launch_flags():
    """Section 4 names TRL's vLLM and ZeRO-3 settings and `accelerate launch` / `trl vllm-serve` flags in prose: each
    must exist in the installed versions."""
    import re

    import trl
    from accelerate.commands.launch import launch_command_parser
    from trl.scripts.vllm_serve import make_parser

    text = (Path(__file__).resolve().parent.parent / "chapters" / "source" / "part7_production.py").read_text()
    settings = set(re.findall(r"`((?:use_)?vllm\w*|ds3_\w+)(?:=[^`]*)?`", text))
    expect(len(settings) >= 8, "TRL settings named in the chapter", f"found only {sorted(settings)}", len(settings))
    theirs = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    assert_equal(sorted(settings - theirs), [], f"settings the chapter names that trl {trl.__version__} lacks")
    launch = {o for a in launch_command_parser()._actions for o in a.option_strings}
    serve = {o for a in make_parser()._actions for o in a.option_strings}
    for tool, flags in (("accelerate launch", launch), ("trl vllm-serve", serve)):
        lines = [line for line in text.splitlines() if tool in line or (line.startswith("#     ") and "--" in line)]
        named = {f for line in lines for f in re.findall(r"(--[a-z_-]+)", line) if tool == "accelerate launch"
                 or "vllm-serve" in line}
        named -= {"--trl-only", "--vllm", "--steps", "--plot", "--seed", "--json"}  # our script's own flags
        assert_equal(sorted(named - flags), [], f"flags the chapter gives `{tool}` that it lacks")


@needs("trl")
@pytest.mark.slow
def test_script_trains_both_and_prints_json_figures(tmp_path):
    """Smoke setting: two steps of TRL's GRPOTrainer, two of ours, the same held-out accuracy at the start."""
    _, figures = run_script("solutions.production.trl_grpo", "--json", "--plot", str(tmp_path / "c.png"))
    assert_equal(figures["trl_accuracy_start"], figures["ours_accuracy_start"], "both runs' starting accuracy")
    assert_equal(figures["trl_trainable_params"], figures["ours_trainable_params"], "both runs' LoRA sizes")
    expect((tmp_path / "c.png").exists(), "the curves", "were not saved to --plot's path")


@needs("trl")
@pytest.mark.slow
def test_script_runs_under_accelerate_launch_on_one_cpu_process(tmp_path):
    """`accelerate launch --config_file cpu_1proc.yaml -m solutions.production.trl_grpo` (smoke setting: 2 steps),
    and the adapter it saves is a peft adapter folder."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RLHF_SMOKE": "1"}
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ACCELERATE_CONFIGS / "cpu_1proc.yaml"), "-m", "solutions.production.trl_grpo", "--trl-only",
               "--json", "--plot", "", "--save", str(tmp_path / "adapter")]
    result = subprocess.run(command, cwd=ACCELERATE_CONFIGS.parents[2], capture_output=True, text=True, env=env,
                            timeout=900)
    expect(result.returncode == 0, "accelerate launch", f"failed:\n{result.stderr[-3000:]}")
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert_equal((figures["processes"], figures["steps"], "ours_accuracy_end" in figures), (1, 2, False),
                 "the launched run's (processes, steps, ran ours too)")
    assert_equal(sorted(p.name for p in (tmp_path / "adapter").iterdir()),
                 ["README.md", "adapter_config.json", "adapter_model.safetensors"], "the saved adapter folder")


# --- the exercise: to_trl_config --------------------------------------------------------------------------------

TRL_CONFIGS = {  # what each config shows: the defaults, then the knobs whose translation is not a copy
    "the defaults": (GRPOConfig(), 1),
    "4 processes": (GRPOConfig(), 4),
    "num_iterations=2, epsilon_high, beta, on cpu": (GRPOConfig(num_iterations=2, epsilon_high=0.28, beta=0.04,
                                                                device="cpu"), 1),
    "the periods task, wandb, on cuda, 2 processes": (GRPOConfig(task="periods", wandb=True, device="cuda",
                                                                 n_prompts=8, lr=3e-4), 2),
    "other numbers everywhere": (GRPOConfig(steps=7, n_prompts=6, group_size=4, max_new_tokens=9, temperature=0.7,
                                            lr=1e-4, epsilon=0.1, loss_type="grpo", scale_rewards="batch",
                                            mask_truncated_completions=True, format_weight=0.3, max_grad_norm=0.5,
                                            seed=3), 3),
}

TRL_CONFIG_HINT = ("see the table knobs.GRPO_TO_TRL: TRL counts optimizer steps (steps × num_iterations) and "
                   "completions per process (n_prompts × group_size / world_size)")


@exercise("to_trl_config")
def test_to_trl_config_matches_reference(impl, tmp_path):
    for label, (cfg, world_size) in TRL_CONFIGS.items():
        what = f"to_trl_config({label}, world_size={world_size})"
        out = impl.to_trl_config(dataclasses.replace(cfg), str(tmp_path), world_size)
        expected = ref.to_trl_config(cfg, str(tmp_path), world_size)
        expect(isinstance(out, dict), what, f"should return a dict of trl.GRPOConfig's arguments, got {type(out)}")
        assert_equal(sorted(set(expected) - set(out)), [], f"{what}: the keys missing",
                     hint="every translated knob, every setting of TRL_SETTINGS and output_dir")
        assert_equal(sorted(set(out) - set(expected)), [], f"{what}: keys the reference does not set")
        for key, value in expected.items():
            assert_equal(out[key], value, f"{what}[{key!r}]", hint=TRL_CONFIG_HINT)


@exercise("to_trl_config")
def test_to_trl_config_refuses_an_uneven_split(impl, tmp_path):
    for world_size in (3, 5):
        assert_raises(ValueError, impl.to_trl_config, GRPOConfig(), str(tmp_path), world_size,
                      what=f"to_trl_config(the defaults, world_size={world_size})",
                      why=f"128 completions a step cannot be shared equally by {world_size} processes")


@exercise("to_trl_config")
def test_to_trl_config_leaves_the_config_alone(impl, tmp_path):
    cfg = GRPOConfig(num_iterations=3, n_prompts=8)
    assert_inputs_unchanged(impl.to_trl_config, cfg, str(tmp_path), 2, what="to_trl_config(num_iterations=3)")


def test_to_trl_config_contract_refuses_no_process(tmp_path):
    for world_size in (0, -2):
        with pytest.raises(ValueError, match=r"^to_trl_config: world_size"):
            ref.to_trl_config(GRPOConfig(), str(tmp_path), world_size)


def _trl_reference_with(name: str, **changes):
    """A wrong version: the reference, with each key of `changes` computed by changes[key](cfg, world_size)."""
    def wrong(cfg, output_dir, world_size=1):
        out = ref.to_trl_config(cfg, output_dir, world_size)
        return {**out, **{key: value(cfg, world_size) for key, value in changes.items()}}
    wrong.__name__ = wrong.__qualname__ = name
    return wrong


_trl_steps_not_scaled = _trl_reference_with("_trl_steps_not_scaled", max_steps=lambda cfg, w: cfg.steps)
_trl_steps_not_scaled.__doc__ = """max_steps = steps: TRL counts optimizer steps, and with num_iterations μ > 1 each
batch of rollouts serves μ of them, so the run would end after steps / μ batches. Use steps × num_iterations."""

_trl_batch_in_prompts = _trl_reference_with("_trl_batch_in_prompts",
                                            per_device_train_batch_size=lambda cfg, w: cfg.n_prompts // w)
_trl_batch_in_prompts.__doc__ = """per_device_train_batch_size counted prompts: TRL's batch counts completions
(each prompt appears group_size times in it). Use n_prompts × group_size / world_size."""

_trl_ignores_world_size = mistake("argument")(
    _trl_reference_with("_trl_ignores_world_size",
                        per_device_train_batch_size=lambda cfg, w: cfg.n_prompts * cfg.group_size))
_trl_ignores_world_size.__doc__ = """world_size was ignored: per_device_train_batch_size is per process, so on
several processes each step would sample world_size times as many completions. Divide by world_size."""

_trl_weights_on_every_task = _trl_reference_with("_trl_weights_on_every_task",
                                                 reward_weights=lambda cfg, w: [1.0, cfg.format_weight])
_trl_weights_on_every_task.__doc__ = """reward_weights was [1.0, format_weight] on every task: the "periods" task
has one reward function (the '.' count), and TRL wants one weight per reward function: [1.0] there."""

_trl_cpu_unless_cuda = _trl_reference_with("_trl_cpu_unless_cuda", use_cpu=lambda cfg, w: cfg.device != "cuda")
_trl_cpu_unless_cuda.__doc__ = """use_cpu was True unless cfg.device is "cuda": device None means "the default
device" (a GPU when there is one); only "cpu" forces the CPU."""


def _trl_without_settings(cfg, output_dir, world_size=1):
    """TRL_SETTINGS were left out: TRL's own defaults then differ from our trainer (a learning rate decayed to 0,
    bfloat16, activation checkpointing, shuffled prompts, ...). Add every setting of TRL_SETTINGS."""
    out = ref.to_trl_config(cfg, output_dir, world_size)
    return {k: v for k, v in out.items() if k not in knobs.TRL_SETTINGS}


@mistake("error")
def _trl_no_split_check(cfg, output_dir, world_size=1):
    """An uneven split was not refused: with 128 completions and 3 processes, floor division gives 42 each, 126 a
    step, and TRL's own check then fails far from the cause. Raise a ValueError when world_size does not divide
    n_prompts × group_size."""
    out = ref.to_trl_config(cfg, output_dir, 1)
    return {**out, "per_device_train_batch_size": cfg.n_prompts * cfg.group_size // world_size}


@mistake("inputs")
def _trl_scales_cfg_in_place(cfg, output_dir, world_size=1):
    """Changed the caller's config (cfg.steps *= cfg.num_iterations) to compute max_steps: the caller's own run
    would then be num_iterations times longer. Compute the product in a new variable."""
    cfg.steps *= cfg.num_iterations
    out = ref.to_trl_config(dataclasses.replace(cfg, num_iterations=1), output_dir, world_size)
    return {**out, "num_iterations": cfg.num_iterations}


MUTANTS["to_trl_config"] = [_trl_steps_not_scaled, _trl_batch_in_prompts, _trl_ignores_world_size,
                            _trl_weights_on_every_task, _trl_cpu_unless_cuda, _trl_without_settings,
                            _trl_no_split_check, _trl_scales_cfg_in_place]
NOT_APPLICABLE[("to_trl_config", "gradient")] = "it returns settings: no tensor, nothing to differentiate"
NOT_APPLICABLE[("to_trl_config", "hooks")] = "it touches no model"
NOT_APPLICABLE[("to_trl_config", "lora")] = "it takes a config, not a model"
NOT_APPLICABLE[("to_trl_config", "seed")] = "it draws no random numbers (cfg.seed is copied, checked as a value)"
# === end: trl ======================================================================================================
