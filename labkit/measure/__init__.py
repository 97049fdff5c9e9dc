"""Measurement has one home: timing harnesses, measured records, fits.

Techniques do not time themselves.

* ``timing.py``  interleaved step timing with warm-up, medians and spread (min / median / max).

Add one module per kind of measurement; import from the submodule (``labkit.measure.timing``).
"""
