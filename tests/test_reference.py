"""The one reference harness: the report names the first difference; the loop accumulates."""

from __future__ import annotations

import torch
from torch import nn

from labkit.reference import (
    AwkwardNet,
    first_difference,
    first_divergence,
    first_mismatch,
    snapshot,
    train_reference,
)


def test_first_difference_names_the_first_element_and_counts():
    want = torch.arange(6.0).reshape(2, 3)
    assert first_difference(want, want.clone(), what="x") is None
    assert first_difference(want, want + 1e-7, what="x") is None  # within atol
    got = want.clone()
    got[1, 0] += 1.0
    got[1, 2] -= 1.0
    assert first_difference(want, got, what="x") == (
        "x: 2 of 6 elements differ; first at index (1, 0): expected 3, got 4"
    )
    assert first_mismatch(want, got) == (3, 2)
    assert "expected shape (2, 3), got (3, 2)" in first_difference(want, got.T, what="x")
    assert "expected dtype torch.float32" in first_difference(want, want.double(), what="x")
    assert "expected a tensor, got list" in first_difference(want, [1], what="x")
    nan = want.clone()
    nan[0, 1] = float("nan")
    assert "first at index (0, 1)" in first_difference(want, nan, what="x")  # NaN never matches
    assert first_difference(want, got, what="x", atol=0, rtol=0) is not None
    assert first_difference(torch.tensor(2.0), torch.tensor(3.0), what="s").endswith(
        "index (): expected 2, got 3"
    )


def test_first_divergence_names_step_parameter_and_element():
    steps = [{"a": torch.zeros(4), "b": torch.ones(2)} for _ in range(3)]
    assert first_divergence(steps, [dict(s) for s in steps]) is None
    moved = [dict(s) for s in steps]
    moved[1] = {"a": torch.tensor([0.0, 0.0, 0.5, 0.0]), "b": torch.ones(2) * 9}
    assert first_divergence(steps, moved, reference="torch") == (
        "after step 2, parameter 'a' diverges first: element 2 is 0.5, torch gives 0"
    )
    assert "parameter 'b' is missing" in first_divergence(steps, [{"a": torch.zeros(4)}] * 3)
    assert "expected 3 steps" in first_divergence(steps, steps[:2])


def test_loop_accumulates_micro_batches_like_one_full_batch():
    # k micro-batches of loss/k give the full batch's mean-loss gradient, hence the same step
    torch.manual_seed(0)
    x, y = torch.randn(12, 8), torch.randint(0, 4, (12,))
    mask = torch.zeros(12, dtype=torch.bool)
    mask[0] = True

    def run(k: int):
        torch.manual_seed(1)
        model = AwkwardNet()
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        micro = list(zip(x.chunk(k), y.chunk(k), mask.chunk(k)))
        loss = lambda m, xb, yb, mb: nn.functional.cross_entropy(m(xb, mb), yb)  # noqa: E731
        return model, train_reference(model, opt, [micro, micro], loss)

    model, whole = run(1)
    _, split = run(3)
    assert first_divergence(whole.params, split.params, atol=1e-6, rtol=1e-5) is None
    assert abs(whole.losses[0] - split.losses[0]) < 1e-6  # the mean loss, however split
    assert whole.first_grads["frozen.weight"] is None  # frozen: no gradient, recorded as None
    assert whole.params[-1].keys() == snapshot(model.named_parameters()).keys()
    # negative control: summing instead of averaging the micro-batches is caught
    torch.manual_seed(1)
    model = AwkwardNet()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    micro = list(zip(x.chunk(3), y.chunk(3), mask.chunk(3)))
    summed = train_reference(
        model, opt, [micro], lambda m, xb, yb, mb: 3 * nn.functional.cross_entropy(m(xb, mb), yb)
    )
    assert first_divergence(whole.params[:1], summed.params) is not None
