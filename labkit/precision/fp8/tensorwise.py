"""Tensorwise dynamic scaling: one scale per tensor, from the tensor's own amax, every call.

``scale = amax(t) / fmt_max``: the largest magnitude lands on 448 (e4m3) or 57,344 (e5m2).
No state and no overflow by construction; the price is one extra pass over the tensor (the
amax) before the cast, and one outlier sets the scale for every element: a value 2^k below
the amax keeps k fewer powers of two above the underflow (e4m3 spans about 2^17.8 from its
max down to its smallest subnormal). torchao's ``Float8LinearConfig`` "tensorwise" recipe
(used by torchtitan) is this one.
"""

from __future__ import annotations

from labkit.precision.fp8.recipe import Recipe

__all__ = ["Tensorwise"]


class Tensorwise(Recipe):
    """Dynamic, per tensor: the base recipe's blocks and scale, named."""

    name = "tensorwise"
