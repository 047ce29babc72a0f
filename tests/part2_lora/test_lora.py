"""The LoRA module: the shapes of A and B, their initialisation, the scale alpha / rank, its forward pass and
its gradients."""

import math

import torch
import torch.nn as nn

from tests.part2_lora.common import attempt
from tests.support import (aside, assert_close, assert_equal, assert_gradients_match, assert_inputs_unchanged, exercise,
                           expect)
from utils.checker.observe import kind  # what a class is, not the name its author gave it


def lora_factors(rank: int, alpha: float) -> dict[str, float]:
    """Factors by which a wrong scale makes LoRA's output differ, named after where they come from."""
    scale = alpha / rank
    return {f"1/scale with scale = alpha / rank = {scale:.4g} (the scale left out)": 1 / scale,
            f"rank = {rank} (scaled by alpha instead of alpha / rank)": float(rank),
            f"(alpha // rank) / (alpha / rank) = {(alpha // rank) / scale:.4g} (integer division alpha // rank)":
                (alpha // rank) / scale,
            f"(rank / alpha) / (alpha / rank) = {1 / scale ** 2:.4g} (the scale upside down: rank / alpha)":
                1 / scale ** 2}


@exercise("LoRA")
def test_lora_shapes_and_parameters(impl):
    lora = attempt("LoRA(64, 96, rank=3, alpha=8.0)", impl.LoRA, 64, 96, rank=3, alpha=8.0)
    expect(isinstance(lora, nn.Module), "LoRA(...) is an nn.Module", "LoRA must subclass nn.Module (its A and B are "
           "then found by .parameters(), state_dict() and an optimiser)", observed=kind(lora))
    A, B = getattr(lora, "A", None), getattr(lora, "B", None)
    expect(isinstance(A, nn.Parameter) and isinstance(B, nn.Parameter), "A and B are nn.Parameters",
           "A and B must both be nn.Parameter (a plain tensor or a buffer is not trained, not saved as a weight, or "
           f"both); got A: {type(A).__name__}, B: {type(B).__name__}", observed=(type(A).__name__, type(B).__name__))
    assert_equal((tuple(A.shape), tuple(B.shape)), ((3, 64), (96, 3)), "the shapes of (A, B) for d_in = 64, "
                 "d_out = 96, rank = 3", hint="A is [rank, d_in] and B is [d_out, rank]: merge_lora, save_adapter "
                 "and load_adapter rely on exactly these shapes")
    assert_close(torch.as_tensor(float(getattr(lora, "scale", float("nan")))), torch.tensor(8.0 / 3),
                 "LoRA(64, 96, rank=3, alpha=8.0).scale", factors=lora_factors(3, 8.0),
                 hint="scale = alpha / rank (a float)")
    default = attempt("LoRA(64, 96)", impl.LoRA, 64, 96)
    assert_equal((tuple(default.A.shape), tuple(default.B.shape)), ((8, 64), (96, 8)),
                 "the shapes of (A, B) of LoRA(64, 96), with the default rank 8")
    assert_close(torch.as_tensor(float(default.scale)), torch.tensor(2.0), "LoRA(64, 96).scale (alpha 16 / rank 8)")


@exercise("LoRA")
def test_lora_initialisation(impl):
    torch.manual_seed(0)
    lora = attempt("LoRA(256, 96, rank=16, alpha=16.0)", impl.LoRA, 256, 96, rank=16, alpha=16.0)
    assert_close(lora.B.detach(), torch.zeros(96, 16), "B at initialisation",
                 hint="B starts at zero, so that the adapted model starts as exactly the base model")
    bound = 1 / math.sqrt(256)  # kaiming_uniform_(a=sqrt(5)) draws from U(-1/sqrt(d_in), 1/sqrt(d_in))
    A = lora.A.detach()
    largest, spread = A.abs().max().item() / bound, A.std().item() / (bound / math.sqrt(3))
    expect(0.9 < largest <= 1 + 1e-6 and 0.9 < spread < 1.1, "A at initialisation",
           f"A should be uniform on ±1/sqrt(d_in) = ±{bound:.4g}, as nn.Linear initialises its weight "
           f"(nn.init.kaiming_uniform_(A, a=math.sqrt(5))); got values up to {largest:.3g}× that bound with a "
           f"standard deviation {spread:.3g}× the uniform one" + (
               ": every value is 0, so B gets no gradient and the adapter can never learn" if largest == 0 else
               f" (a standard deviation of {A.std().item():.3g}, that of a standard normal distribution)"
               + aside("Common cause: A drawn with torch.randn.") if abs(A.std().item() - 1) < 0.1 else ""),
           observed=(round(largest, 2), round(spread, 2)))


@exercise("LoRA")
def test_lora_forward(impl):
    torch.manual_seed(0)
    lora = attempt("LoRA(16, 12, rank=3, alpha=8.0)", impl.LoRA, 16, 12, rank=3, alpha=8.0)
    with torch.no_grad():
        lora.B.normal_()
    for shape in ((2, 5, 16), (7, 16), (2, 3, 5, 16)):
        x = torch.randn(shape)
        with torch.no_grad():
            got = attempt(f"LoRA(x) for x of shape {shape}", lora, x,
                          causes="forward maps [..., d_in] to [..., d_out], whatever the leading dimensions")
            expected = (x @ lora.A.T) @ lora.B.T * (8.0 / 3)
        assert_close(got, expected, f"LoRA(x) for x of shape {shape}", factors=lora_factors(3, 8.0),
                     hint="LoRA(x) = scale · x Aᵀ Bᵀ with scale = alpha / rank")


@exercise("LoRA")
def test_lora_gradients(impl):
    torch.manual_seed(0)
    lora = attempt("LoRA(16, 12, rank=4, alpha=6.0)", impl.LoRA, 16, 12, rank=4, alpha=6.0)
    with torch.no_grad():
        lora.B.normal_()

    def expected(x, /):
        return (x @ lora.A.T) @ lora.B.T * 1.5

    assert_gradients_match(lora, expected, (torch.randn(2, 5, 16),), what="LoRA(x)", modules={"lora": lora})


@exercise("LoRA")
def test_lora_leaves_its_input_alone(impl):
    torch.manual_seed(0)
    lora = attempt("LoRA(16, 12, rank=4, alpha=6.0)", impl.LoRA, 16, 12, rank=4, alpha=6.0)

    def forward(x):
        return lora(x)

    with torch.no_grad():
        attempt("LoRA(x) for x of shape (3, 16)", assert_inputs_unchanged, forward, torch.randn(3, 16),
                what="LoRA(x)")
