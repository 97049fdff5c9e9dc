"""What notebook 13's walkthroughs measure: LARS and LAMB against hand-computed steps, the
short convergence check, host-to-device percentiles, and 16-bit gradient underflow."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from labkit.labs.convergence import compare, train_curve
from labkit.measure.h2d import h2d_latency, percentile
from labkit.measure.underflow import gradient_underflow
from labkit.optim import LAMB, LARS, trust_ratio


def _step(opt_cls, w, g, **kw):
    p = torch.nn.Parameter(torch.tensor(w, dtype=torch.float64))
    opt = opt_cls([p], **kw)
    p.grad = torch.tensor(g, dtype=torch.float64)
    opt.step()
    return p.detach().flatten().tolist(), opt, p


def test_lars_matches_a_hand_computed_step_and_sgd_does_not():
    # ||w|| = 5, ||g|| = 1: local lr = eta ||w|| / ||g|| = 0.02 * 5 = 0.1;
    # v = lr * local * g = 0.1 * 0.1 * (0.6, 0.8); w - v = (2.994, 3.992)
    w, g = [[3.0, 4.0]], [[0.6, 0.8]]
    got, opt, p = _step(LARS, w, g, lr=0.1, eta=0.02, momentum=0.9)
    assert got == pytest.approx([2.994, 3.992], abs=1e-12)
    # second step, same gradient: local = 0.02 * ||w1|| / 1; v2 = 0.9 v1 + 0.1 * local * g
    n1 = math.hypot(2.994, 3.992)
    v2 = [0.9 * 0.006 + 0.1 * 0.02 * n1 * 0.6, 0.9 * 0.008 + 0.1 * 0.02 * n1 * 0.8]
    p.grad = torch.tensor(g, dtype=torch.float64)
    opt.step()
    assert p.detach().flatten().tolist() == pytest.approx([2.994 - v2[0], 3.992 - v2[1]], abs=1e-12)
    # weight decay enters the ratio's denominator and the direction: eta||w|| / (||g|| + b||w||)
    got, _, _ = _step(LARS, w, g, lr=0.1, eta=0.02, weight_decay=0.5)
    local = 0.02 * 5 / (1 + 0.5 * 5)
    assert got == pytest.approx([3 - 0.1 * local * 2.1, 4 - 0.1 * local * 2.8], abs=1e-12)
    # a bias (1-D) keeps a ratio of 1: plain momentum SGD
    assert _step(LARS, [1.0], [0.5], lr=0.1)[0] == pytest.approx([0.95])
    # negative control: SGD with the same lr moves the matrix 10x further
    sgd, _, _ = _step(torch.optim.SGD, w, g, lr=0.1, momentum=0.9)
    assert sgd == pytest.approx([2.94, 3.92]) and sgd != pytest.approx(got)


def test_lamb_matches_a_hand_computed_step_and_adam_does_not():
    # step 1: m_hat = g, v_hat = g^2, r = g / (|g| + eps); ratio = ||w|| / ||r||; w - lr ratio r
    w, g, lr, eps = [[3.0, 4.0]], [[0.6, 0.8]], 0.1, 1e-6
    r = [0.6 / (0.6 + eps), 0.8 / (0.8 + eps)]
    ratio = 5 / math.hypot(*r)
    got, _, _ = _step(LAMB, w, g, lr=lr, eps=eps)
    assert got == pytest.approx([3 - lr * ratio * r[0], 4 - lr * ratio * r[1]], abs=1e-12)
    adam, _, _ = _step(torch.optim.Adam, w, g, lr=lr, eps=eps)  # negative control: no ratio
    assert adam == pytest.approx([2.9, 3.9], abs=1e-6) and adam != pytest.approx(got)


def test_trust_ratio_edges_and_bad_input():
    assert trust_ratio(torch.tensor(0.0), torch.tensor(2.0)) == 1
    assert trust_ratio(torch.tensor(3.0), torch.tensor(0.0)) == 1
    assert trust_ratio(torch.tensor(3.0), torch.tensor(2.0)) == 1.5
    with pytest.raises(ValueError, match="lr"):
        LARS([torch.nn.Parameter(torch.ones(2))], lr=0)
    with pytest.raises(ValueError, match="betas"):
        LAMB([torch.nn.Parameter(torch.ones(2))], lr=0.1, betas=(0.9, 1.0))


def test_convergence_runs_are_reproducible_and_a_huge_lr_is_flagged():
    kw = dict(samples=256, evals=2, val_size=100)
    a = train_curve(32, 0.02, **kw)
    b = train_curve(32, 0.02, **kw)
    assert a.val_loss == b.val_loss and a.samples == [128, 256]  # same seed, same curve
    assert not a.diverged and a.final < a.train_loss[0]
    bad = train_curve(64, 50.0, **kw)  # negative control: it blows up
    assert bad.diverged and bad.spike > 1
    check = compare(32, 0.02, 2, small=a, **kw)
    assert check["small"] is a and check["big"].batch == 64 and check["big"].lr == 0.04
    assert check["passed"] == (check["gap"] <= 0.1)
    with pytest.raises(ValueError, match="small is a run of B=32"):
        compare(64, 0.02, 2, samples=256, small=a)
    with pytest.raises(ValueError, match="optimizer"):
        train_curve(64, 0.1, optimizer="adamw")


def test_percentiles_match_numpy_and_h2d_says_what_it_timed():
    xs = [3.0, 1.0, 4.0, 1.5, 9.0, 2.6, 5.0]
    for q in (0, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(np.percentile(xs, q))
    with pytest.raises(ValueError, match="q=101"):
        percentile(xs, 101)
    lat = h2d_latency((4, 3, 8, 8), repeats=3, warmup=0)
    assert set(lat) == {"pageable", "pinned"}
    for r in lat.values():
        assert r.n == 3 and r.nbytes == 4 * 3 * 8 * 8 and 0 < r.p50 <= r.p99 <= r.max
        if not torch.cuda.is_available():
            assert "CPU only" in r.kind


def test_fp16_gradients_underflow_and_the_scaler_or_bf16_keep_them():
    got = gradient_underflow(n=4096, d=16, residual=1e-4)  # dL/dy about 1.5e-9 < 2^-25
    assert got["fp32"] == {"zero": 0.0, "error": 0.0}
    assert got["fp16"]["zero"] == 1.0  # every gradient element flushed to 0
    assert got["fp16 + scaler"]["zero"] == 0.0 and got["fp16 + scaler"]["error"] < 1e-2
    assert got["bf16"]["zero"] == 0.0 and got["bf16"]["error"] < 2e-2
    # negative control: large enough gradients survive fp16 without a scaler
    assert gradient_underflow(n=64, d=16, residual=1.0)["fp16"]["zero"] == 0.0


def test_k8_takes_enough_copies_for_a_p99_that_is_not_the_max():
    import re
    from pathlib import Path

    import nbformat

    walk = Path(__file__).resolve().parent.parent / "notebooks" / "13_interview_walkthroughs.ipynb"
    k8 = next(c.source for c in nbformat.read(walk, as_version=4).cells
              if c.cell_type == "code" and "h2d_latency((" in c.source)  # fmt: skip
    n = int(re.search(r"repeats=(\d+)", k8).group(1))  # type: ignore[union-attr]
    one_outlier = [1.0] * (n - 1) + [100.0]  # one stall in n copies
    assert percentile(one_outlier, 99) < 10  # the p99 does not report the lone stall
    # negative control: at 20 copies the "p99" is most of the way to the max
    assert percentile([1.0] * 19 + [100.0], 99) > 80
