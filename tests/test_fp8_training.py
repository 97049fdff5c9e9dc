"""FP8 in training and per GEMM: the curve against bf16's seed spread, and each recipe's error.

The tolerance is derived in the run: bf16 from three seeds spans some range of final loss;
an FP8 recipe must land within it of bf16 at the same seed, and the negative control (no
scaling, e4m3 gradients) must miss it. Per GEMM: on ordinary activations every scaled
recipe sits at e4m3's rounding while the unscaled control loses the gradients; with outlier
tokens the per-row and per-tile scales beat the per-tensor ones; the delayed recipe
saturates when a tensor outgrows its history, the dynamic ones never do.
"""

from __future__ import annotations

import pytest

from labkit.labs.fp8_training import CONTROL, LESSON, compare_curves, lesson_runs
from labkit.measure.fp8 import capture_gemms, gemm_error_table, range_table
from labkit.precision.fp8 import Fp8Config


def test_fp8_tensorwise_within_bf16_seed_spread_and_the_control_misses() -> None:
    res = compare_curves(LESSON, {"tensorwise": Fp8Config(), "control": CONTROL})
    tol, gaps = res["tolerance"], res["gaps"]
    assert 0 < tol < 0.3, tol  # a real spread, not a degenerate one
    assert abs(gaps["tensorwise"]) <= tol, (gaps, tol)
    assert gaps["control"] > 3 * tol, (gaps, tol)  # clearly worse, not by a hair
    assert res["passes"] == {"tensorwise": True, "control": False}


@pytest.mark.slow
def test_every_recipe_within_bf16_seed_spread() -> None:
    res = compare_curves(LESSON, lesson_runs())
    assert {n for n, ok in res["passes"].items() if ok} == {
        "tensorwise", "delayed", "rowwise", "tiles"}, (res["gaps"], res["tolerance"])  # fmt: skip


def test_compare_curves_refuses_what_cannot_derive_a_tolerance() -> None:
    with pytest.raises(ValueError, match="at least 2 seeds"):
        compare_curves(LESSON, {"control": CONTROL}, seeds=(0,))
    with pytest.raises(ValueError, match="control='control' is not one of"):
        compare_curves(LESSON, {"tensorwise": Fp8Config()})


def test_per_gemm_errors_order_the_recipes() -> None:
    rows = {(r["case"], r["recipe"]): r for r in gemm_error_table(capture_gemms(steps=3))}
    scaled = ("tensorwise", "delayed", "rowwise", "tiles")
    for name in scaled:  # e4m3/e5m2 rounding: a few percent per GEMM
        for gemm in ("fwd", "dgrad", "wgrad"):
            assert rows["gpt", name][gemm] < 0.08, (name, gemm, rows["gpt", name])
        assert rows["gpt", name]["x_over"] == 0.0
    for gemm in ("dgrad", "wgrad"):  # negative control: unscaled gradients underflow
        assert rows["gpt", "unscaled"][gemm] > 2 * max(rows["gpt", n][gemm] for n in scaled)
    # outlier tokens: one scale per tensor starves the ordinary tokens
    for fine in ("rowwise", "tiles"):
        assert rows["outliers", fine]["fwd"] < 0.85 * rows["outliers", "tensorwise"]["fwd"]
        assert rows["outliers", fine]["x_under"] < rows["outliers", "tensorwise"]["x_under"]


def test_where_each_recipe_overflows_or_underflows() -> None:
    rows = {r["recipe"]: r for r in range_table(margin=0)}
    for dynamic in ("tensorwise", "rowwise", "tiles"):  # scale-invariant over the sweep
        assert (rows[dynamic]["low"], rows[dynamic]["high"]) == (-40, 40)
        assert rows[dynamic]["overflows_from"] is None
    # e4m3 unscaled: 448 = 2^8.8 at the top, precision gone a few powers below 1
    assert rows["unscaled"]["overflows_from"] == 8 and rows["unscaled"]["high"] < 8
    assert rows["delayed"]["overflows_from"] == 4 and rows["delayed"]["high"] == 0
    # a margin of 4 buys headroom: the delayed recipe no longer saturates at 2^4
    assert {r["recipe"]: r for r in range_table(margin=4)}["delayed"]["overflows_from"] == 8
