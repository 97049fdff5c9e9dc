"""Check for exercise 15: the online-softmax merge of two attention blocks.

``merge(out_a, lse_a, out_b, lse_b) -> (out, lse)`` receives only what each block produced,
its output and its log-sum-exp (so gathering the full K/V is not possible: that is the
point). It is checked against torch's ``scaled_dot_product_attention`` on the whole
sequence, in three situations that each reject one wrong approach:

* two halves of the keys: an average or sum of the block outputs without the weights
  ``exp(L_i - L)`` is off;
* three blocks merged in a chain, ``merge(merge(a, b), c)``: a merge that returns the wrong
  log-sum-exp passes two blocks but not three;
* causal blocks entirely in the future merged first (their LSE is -inf on every row): a
  merge that computes ``exp(-inf - -inf)`` returns NaN.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from labkit.checks.core import CheckFailed, passed
from labkit.context_parallel import block_forward

__all__ = ["check_merge"]

Merge = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]
]


def _blocks(q, k, v, cuts, causal):
    """(out, lse) of each key block ``k[cuts[i]:cuts[i+1]]``; causal masks by position."""
    out, n = [], q.shape[-2]
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        mask = None
        if causal:
            mask = torch.arange(n).unsqueeze(1) >= torch.arange(lo, hi).unsqueeze(0)
        out.append(
            block_forward(q, k[..., lo:hi, :], v[..., lo:hi, :], 1 / math.sqrt(q.shape[-1]), mask)
        )
    return out


def check_merge(merge: Merge) -> None:
    """Raise :class:`CheckFailed` naming the situation and the error, else print PASSED."""
    g = torch.Generator().manual_seed(15)
    q, k, v = (torch.randn(2, 3, 8, 4, generator=g) for _ in range(3))
    cases = [
        ("two halves of the keys", [0, 4, 8], False),
        ("three blocks merged in a chain (the returned LSE is used again)", [0, 2, 5, 8], False),
        ("causal blocks wholly in the future first (their LSE is -inf)", [], True),
    ]
    for name, cuts, causal in cases:
        if causal:  # queries 0..3: keys 4..7 (two blocks) all in the future, then keys 0..3
            qq = q[..., :4, :]
            blocks = _blocks(qq, k, v, [4, 6, 8], True) + _blocks(qq, k, v, [0, 4], True)
            want = F.scaled_dot_product_attention(qq, k[..., :4, :], v[..., :4, :], is_causal=True)
        else:
            blocks = _blocks(q, k, v, cuts, False)
            want = F.scaled_dot_product_attention(q, k, v)
        out, lse = blocks[0]
        for o, l_ in blocks[1:]:
            got = merge(out, lse, o, l_)
            if not (isinstance(got, tuple) and len(got) == 2):
                raise CheckFailed(f"merge must return a tuple (out, lse), got {type(got).__name__}")
            out, lse = got
        if not torch.isfinite(out).all():
            raise CheckFailed(
                f"{name}: your merge returned NaN or inf. A block with no visible key has "
                f"lse = -inf; exp(lse_a - lse) is then exp(-inf - -inf) = nan: guard it"
            )
        err = (out - want).abs().max().item()
        if err > 1e-5:
            raise CheckFailed(
                f"{name}: max |your output - full attention| = {err:.3g}. Each block's output "
                f"is normalised by its own softmax sum; weigh it by exp(lse_i - lse), where "
                f"lse = logaddexp(lse_a, lse_b), and return that lse too"
            )
    passed("your merge equals full attention: two blocks, a chain of three, an empty block")
