"""FP8 from scratch: formats from their bits, the four recipes, the FP8 linear, its kernels.

The formats' limits are derived from exponent/mantissa bits and must equal torch.finfo; the
scaled GEMM through ``torch._scaled_mm`` (tensorwise, rowwise, and DeepSeek-V3's tiles as
per-128-slice rowwise GEMMs accumulated in fp32) must equal the emulated reference; each
recipe's blocks are what its paper says; the delayed recipe's scale comes from the history
(a tensor that jumps saturates; the tensorwise recipe, negative control, does not); the
FP8 linear's three GEMMs are close to fp32, and the unscaled control is not.
"""

from __future__ import annotations

import pytest
import torch

from labkit.precision.fp8 import (
    E4M3,
    E5M2,
    FORMATS,
    RECIPES,
    Delayed,
    Fp8Config,
    Fp8Linear,
    Rowwise,
    Tensorwise,
    Tiles,
    delayed_scaling_step,
    format_table,
    fp8_linears,
    make_recipe,
    matmul,
)
from labkit.precision.fp8.formats import bits_of, cast_counts, overflow_behaviour, representable
from labkit.precision.fp8.linear import fp8_linear


def test_formats_from_their_bits_match_torch() -> None:
    rows = {r["format"]: r for r in format_table()}  # raises if a derived limit != finfo
    assert rows["e4m3"]["max"] == 448 and rows["e5m2"]["max"] == 57344
    assert rows["fp16"]["max"] == 65504
    assert FORMATS["e4m3"].min_subnormal == 2.0**-9 and FORMATS["e5m2"].min_subnormal == 2.0**-16
    # the non-negative finite values: e4m3 codes 0x00..0x7e (0x7f is NaN): 127;
    # e5m2 codes 0x00..0x7b (0x7c is inf, above it NaN): 124
    assert len(representable("e4m3")) == 127 and representable("e4m3").max() == 448
    assert len(representable("e5m2")) == 124
    assert bits_of(448, "e4m3") == "0 1111 110" and bits_of(57344, "e5m2") == "0 11110 11"
    assert bits_of(2.0**-9, "e4m3") == "0 0000 001"  # the smallest subnormal


def test_rounding_subnormals_and_overflow_as_measured() -> None:
    tiny = FORMATS["e4m3"].min_subnormal
    x = torch.tensor([tiny / 2, tiny * 0.51, 1.0625, 1.1875])
    # half the smallest subnormal ties to even (0); 1.0625 ties to 1.0, 1.1875 to 1.25
    assert (x.to(E4M3).float() == torch.tensor([0.0, tiny, 1.0, 1.25])).all()
    behaviour = overflow_behaviour()
    assert behaviour["e4m3"][-1] == 448  # torch's CPU cast saturates e4m3fn, even +inf
    assert behaviour["e5m2"][2] == float("inf")  # 1.1 x max rounds past the top
    counts = cast_counts(torch.full((100,), 1e-6), "e5m2")  # below 2^-16 / 2: flushed
    assert counts["underflow"] == 1.0
    assert cast_counts(torch.full((10,), 1e-6), "bf16")["underflow"] == 0.0


def _pair(m: int = 48, k: int = 320, n: int = 80) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=g)
    a[3] *= 1e4  # one loud row: a per-tensor scale pushes the others toward the subnormals
    return a, torch.randn(n, k, generator=g) * 0.05


@pytest.mark.parametrize("recipe", [Tensorwise(), Rowwise(), Tiles(128), Tiles(64)])
def test_scaled_mm_equals_the_emulated_gemm(recipe: object) -> None:
    a, w = _pair()  # K = 320: tiles of 128 leave a partial last slice
    qa = recipe.quantize(a, E4M3, 1, "activation")  # type: ignore[attr-defined]
    qw = recipe.quantize(w, E4M3, 1, "weight")  # type: ignore[attr-defined]
    ref = matmul(qa, qw.t(), "emulated")
    got = matmul(qa, qw.t(), "scaled_mm")
    # the same products of the same FP8 values; only fp32 summation order differs
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-4 * ref.abs().max().item())


def test_each_recipe_blocks_as_its_paper_says() -> None:
    shape = torch.Size((256, 512))
    assert Tensorwise().block(shape, 1, "activation") == (256, 512)
    assert Rowwise().block(shape, 1, "activation") == (1, 512)  # one scale per row, along K
    assert Rowwise().block(shape, 0, "grad") == (256, 1)
    assert Tiles().block(shape, 1, "activation") == (1, 128)  # DeepSeek-V3: 1x128 tiles
    assert Tiles().block(shape, 0, "activation") == (128, 1)  # wgrad's contraction: 128x1
    assert Tiles().block(shape, 1, "weight") == (128, 128)
    q = Tiles().quantize(torch.randn(256, 512), E4M3, 1, "activation")
    assert q.scale.shape == (256, 4)  # 512 / 128 tiles per row


def test_finer_blocks_err_less_on_a_loud_row() -> None:
    a, w = _pair()
    ref = a @ w.t()
    err = {}
    for recipe in (Tensorwise(), Rowwise(), Tiles()):
        y = matmul(recipe.quantize(a, E4M3, 1, "activation"),
                   recipe.quantize(w, E4M3, 1, "weight").t())  # fmt: skip
        quiet = torch.ones(a.shape[0], dtype=torch.bool)
        quiet[3] = False  # the error of the ordinary rows, which the loud one starves
        err[recipe.name] = ((y - ref)[quiet].norm() / ref[quiet].norm()).item()
    assert err["rowwise"] < err["tensorwise"] and err["tiles"] < err["tensorwise"]


def test_delayed_scale_comes_from_the_history_not_the_tensor() -> None:
    hist = torch.tensor([2.0, 8.0, 1.0])  # newest first
    scale, new = delayed_scaling_step(torch.tensor(100.0), hist, E4M3, margin=1)
    assert scale.item() == pytest.approx(8.0 / 448 * 2)  # max of the past, with the margin
    assert new.tolist() == [100.0, 2.0, 8.0]  # the oldest dropped, the newest first
    assert delayed_scaling_step(torch.tensor(3.0), torch.zeros(4), E4M3)[0].item() == 1.0
    # a tensor that jumps 16x past its history saturates under delayed scaling...
    d, t = Delayed(history_len=4), Tensorwise()
    for _ in range(3):
        d.quantize(torch.ones(8, 8), E4M3, 1, "activation", "input")
    jump = torch.ones(8, 8) * 16 * 448
    q = d.quantize(jump, E4M3, 1, "activation", "input")
    assert d.saturated["input"] == 1  # clipped at the history's amax (1.0):
    assert q.dequantize().max().item() == pytest.approx(1.0)
    # ...and not under the tensorwise recipe (negative control: the current amax)
    assert t.quantize(jump, E4M3, 1, "activation").dequantize().max().item() == jump.max()


def test_config_and_inputs_are_refused_clearly() -> None:
    with pytest.raises(ValueError, match="recipe='nope'"):
        Fp8Config(recipe="nope")
    with pytest.raises(ValueError, match="grad_format"):
        Fp8Config(grad_format="e3m4")
    with pytest.raises(ValueError, match=r"inner dimensions differ: a is \(2, 3\)"):
        q = Tensorwise().quantize(torch.ones(2, 3), E4M3, 1, "activation")
        matmul(q, q)
    with pytest.raises(ValueError, match="history_len=0"):
        Delayed(history_len=0)


@pytest.mark.parametrize("kernel", ["emulated", "scaled_mm"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_linear_three_gemms_against_fp32(recipe: str, kernel: str) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 256, generator=g).requires_grad_()
    w = (torch.randn(192, 256, generator=g) * 0.05).requires_grad_()
    b = torch.randn(192, generator=g).requires_grad_()
    dy = torch.randn(64, 192, generator=g) * 1e-6  # a mean loss over ~1e5 tokens: tiny
    ref = torch.nn.functional.linear(x, w, b)
    ref_grads = torch.autograd.grad(ref, (x, w, b), dy)
    cfg = Fp8Config(recipe=recipe, kernel=kernel)
    rec = make_recipe(cfg)
    if recipe == "delayed":  # its first step has an empty history (scale 1, as TE): warm it
        torch.autograd.grad(fp8_linear(x, w, b, rec, cfg), (x, w, b), dy)
    out = fp8_linear(x, w, b, rec, cfg)
    grads = torch.autograd.grad(out, (x, w, b), dy)
    errs = [((o - r).norm() / r.norm()).item() for o, r in zip((out, *grads), (ref, *ref_grads))]
    if recipe == "unscaled":  # the control: the gradients underflow e5m2 (2^-16)
        assert errs[1] > 0.2 and errs[2] > 0.2, errs
    else:  # e4m3 forward, e5m2 gradients: a few percent; the bias stays exact
        assert errs[0] < 0.05 and errs[1] < 0.1 and errs[2] < 0.1, errs
    assert errs[3] < 1e-6


def test_fp8_linears_swaps_modules_keeping_the_parameters() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    params = list(model.parameters())
    names = fp8_linears(model, Fp8Config(recipe="delayed"), where=lambda n: n == "0")
    assert names == ["0"] and isinstance(model[0], Fp8Linear)
    assert type(model[2]) is torch.nn.Linear and list(model.parameters()) == params
    model(torch.randn(4, 8)).sum().backward()
    assert model[0].recipe.history["input"][0] > 0  # type: ignore[union-attr,index]
    assert all(p.grad is not None for p in params)


def _e4m3_gemm_bound(x: torch.Tensor, w: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Elementwise bound on |fp8(x) fp8(w)^T - x w^T| for tensorwise e4m3: each operand is off
    by at most half an ulp, 2^-4 of itself (3 mantissa bits), or half the subnormal step
    (2^-10 of the scaled amax / 448) near zero; the bf16 output adds 2^-8 of itself."""

    def err(t: torch.Tensor) -> torch.Tensor:
        return torch.maximum(t.abs() * 2**-4, t.abs().amax() * 2**-10 / 448)

    ax, aw = x.abs(), w.abs()
    return (ax + err(x)) @ (aw + err(w)).t() - ax @ aw.t() + ref.abs() * 2**-8 + 1e-6


def test_autocast_leaves_the_fp8_gemm_alone() -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(32, 16)
    fp8 = Fp8Linear(lin, Fp8Config())
    x = torch.randn(4, 32).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fp8(x)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, fp8(x))  # autocast changes nothing in the FP8 GEMM
    ref = lin(x.float())
    assert ((y.float() - ref).abs() <= _e4m3_gemm_bound(x.float(), lin.weight, ref)).all()
    assert E5M2 == FORMATS["e5m2"].dtype


def test_tensorwise_equals_torchaos_float8_linear_bit_for_bit() -> None:
    """The peer: torchao's "tensorwise" recipe (torchtitan's) is the same algorithm, so its
    output and both gradients equal ours exactly (run where torchao is importable)."""
    ao = pytest.importorskip("torchao.float8")
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 128, bias=False)
    peer = torch.nn.Sequential(torch.nn.Linear(256, 128, bias=False))
    peer[0].load_state_dict(lin.state_dict())
    ao.convert_to_float8_training(peer, config=ao.Float8LinearConfig.from_recipe_name("tensorwise"))
    ours = Fp8Linear(lin, Fp8Config("tensorwise", "scaled_mm"))
    x, dy = torch.randn(64, 256), torch.randn(64, 128) * 1e-3
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    peer(xa).backward(dy)
    y = ours(xb)
    y.backward(dy)
    assert torch.equal(y, peer(x.clone()))
    assert torch.equal(xb.grad, xa.grad) and torch.equal(lin.weight.grad, peer[0].weight.grad)
