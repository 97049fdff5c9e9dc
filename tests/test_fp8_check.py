"""Exercise 18's check: it accepts Transformer Engine's delayed-scaling update and rejects
the wrong ones, naming the usual mistake (a scale from this step's amax: the tensorwise
recipe, the negative control), a history kept oldest-first, and a margin ignored."""

from __future__ import annotations

import pytest
import torch

from labkit.checks.core import CheckFailed
from labkit.checks.fp8 import check_delayed_scaling, scale_trace
from labkit.precision.fp8.delayed import delayed_scaling_step
from labkit.precision.fp8.scaled import E4M3


def right(amax, history, fmt_max, margin):  # type: ignore[no-untyped-def]
    past = history.max()
    scale = past * 2.0**margin / fmt_max if past > 0 else torch.tensor(1.0)
    return scale, torch.cat([amax.reshape(1), history[:-1]])


def test_the_check_accepts_the_rule_and_the_library_agrees(capsys) -> None:
    check_delayed_scaling(right)
    assert "PASSED" in capsys.readouterr().out
    check_delayed_scaling(lambda a, h, f, m: delayed_scaling_step(a, h, E4M3, m))
    # the rule saturates after a spike: a tensor outgrew its history
    assert sum(a > s for a, s in scale_trace(right)) >= 2


def from_current_amax(amax, history, fmt_max, margin):  # type: ignore[no-untyped-def]
    scale = amax * 2.0**margin / fmt_max if amax > 0 else torch.tensor(1.0)
    return scale, torch.cat([amax.reshape(1), history[:-1]])


def history_after_push(amax, history, fmt_max, margin):  # type: ignore[no-untyped-def]
    new = torch.cat([amax.reshape(1), history[:-1]])  # the max then includes this step
    past = new.max()
    return (past * 2.0**margin / fmt_max if past > 0 else torch.tensor(1.0)), new


def oldest_first(amax, history, fmt_max, margin):  # type: ignore[no-untyped-def]
    scale, new = right(amax, history, fmt_max, margin)
    return scale, torch.cat([history[1:], amax.reshape(1)])


def no_margin(amax, history, fmt_max, margin):  # type: ignore[no-untyped-def]
    return right(amax, history, fmt_max, 0)


@pytest.mark.parametrize(
    ("wrong", "message"),
    [
        (from_current_amax, "comes from this step's amax. That is tensorwise dynamic scaling"),
        (history_after_push, "comes from this step's amax"),
        (oldest_first, "newest first"),
        (no_margin, r"margin=1, step \d+: .* max\(history\) \* 2\^margin"),
    ],
)
def test_the_check_rejects_wrong_rules(wrong, message) -> None:
    with pytest.raises(CheckFailed, match=message):
        check_delayed_scaling(wrong)


def test_a_wrong_return_shape_is_named() -> None:
    with pytest.raises(CheckFailed, match=r"must return \(scale, new_history\)"):
        check_delayed_scaling(lambda a, h, f, m: 1.0)
