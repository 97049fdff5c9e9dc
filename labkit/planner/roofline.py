"""A GEMM's time from its shape, on a roofline of the card (pure arithmetic).

A ``(m, n, k)`` matmul does ``F = 2 m n k`` FLOPs and moves at least
``D = e (m k + k n + m n)`` bytes (read both operands, write the output; ``e`` bytes an
element). The planner charges::

    t = F / (peak x gemm_max x align) + D / (HBM x mem_eff) + launch_s

* ``gemm_max``: the best fraction of the data-sheet peak a large, aligned GEMM reaches (a
  measured sweep, or published "maximum achievable matmul FLOPS");
* the second term is the memory side of the roofline, *added* rather than overlapped: a GEMM
  whose k is small spends a real share of its time streaming its output tile. This is what
  makes the efficiency a curve over sizes: ``F / t`` rises with the matrices, and a shard
  ``h / t`` wide (tensor parallelism) falls on its low side;
* ``align``: ``misaligned`` when a dimension is not a multiple of 8 elements (16 bytes): the
  tensor-core fast path needs aligned rows (H100: 0.18, measured);
* ``launch_s``: a fixed cost a kernel (the sweep's timing includes it).

Fitted on the H100's 313 aligned measured shapes (``docs/gemm_grid_h100.json`` and
``gemm_sweep_h100.json``, at least 60 us each): mean error +0.4%, sd 7.2%, worst 22%.
Each card's numbers and their sources: ``data/chips.json``; ``docs/planner.md``.

Memory-bound work (LayerNorm, dropout, softmax, the optimizer) is :func:`stream_time`: bytes
over ``HBM x mem_eff``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from labkit.hardware import value

__all__ = ["CHIPS", "Chip", "chip_for", "gemm_efficiency", "gemm_time", "stream_time"]

ALIGN = 8  # elements: 16 bytes of a 16-bit dtype


@dataclass(frozen=True)
class Chip:
    """One card as the roofline sees it (see ``data/chips.json`` for every source)."""

    name: str
    peak_flops: float  # dense 16-bit FLOP/s
    mem_bandwidth: float  # bytes/s, data sheet
    gemm_max: float  # best large aligned GEMM / peak
    mem_eff: float  # achievable / data-sheet HBM bandwidth
    launch_s: float  # a kernel's fixed cost
    misaligned: float  # compute-rate factor when a dimension is not a multiple of 8
    flash_fwd: float  # flash attention forward FLOP/s / peak
    flash_bwd: float  # flash attention backward FLOP/s / peak

    def __post_init__(self) -> None:
        fracs = {k: getattr(self, k) for k in ("gemm_max", "mem_eff", "misaligned",
                                                "flash_fwd", "flash_bwd")}  # fmt: skip
        bad = {k: v for k, v in fracs.items() if not 0 < v <= 1}
        if bad or not (self.peak_flops > 0 and self.mem_bandwidth > 0 and self.launch_s >= 0):
            raise ValueError(f"chip {self.name!r}: fractions must be in (0, 1], got {bad}; "
                             f"peak {self.peak_flops}, HBM {self.mem_bandwidth}, "
                             f"launch {self.launch_s}")  # fmt: skip

    def with_peak(self, peak_flops: float, mem_bandwidth: float) -> Chip:
        from dataclasses import replace

        return replace(self, peak_flops=peak_flops, mem_bandwidth=mem_bandwidth)


def _load() -> dict[str, Chip]:
    """chips.json's fitted fractions; a field given as a string names a hardware-catalog
    entry (the data-sheet peak and HBM bandwidth live there, with their sources)."""
    raw = json.loads((Path(__file__).parent / "data" / "chips.json").read_text())["chips"]
    keys = Chip.__dataclass_fields__.keys() - {"name"}

    def num(x: float | str) -> float:
        return value(x) if isinstance(x, str) else float(x)

    return {k: Chip(name=v["card"], **{f: num(v[f]) for f in keys}) for k, v in raw.items()}


CHIPS: dict[str, Chip] = _load()


def chip_for(name: str, peak_flops: float, mem_bandwidth: float) -> Chip:
    """The chip whose key ("h200", "h100", "a100") the cluster's ``name`` mentions, at the
    cluster's own peak and bandwidth; a card it does not name gets A100's fractions."""
    low = name.lower()
    key = next((k for k in ("h200", "h100", "a100") if k in low), "a100")
    return CHIPS[key].with_peak(peak_flops, mem_bandwidth)


def _check(*dims: float) -> None:
    if min(dims) < 0:
        raise ValueError(f"GEMM dimensions must be >= 0, got {dims}")


@lru_cache(maxsize=65536)
def gemm_time(chip: Chip, m: float, n: float, k: float, batch: float = 1.0,
              elem_bytes: int = 2) -> float:  # fmt: skip
    """Seconds of ``batch`` independent ``(m, k) @ (k, n)`` matmuls in one kernel (module
    docstring). Zero-sized work costs nothing."""
    _check(m, n, k, batch)
    if min(m, n, k, batch) == 0:
        return 0.0
    flops = 2 * m * n * k * batch
    moved = elem_bytes * (m * k + k * n + m * n) * batch
    aligned = all(float(x).is_integer() and int(x) % ALIGN == 0 for x in (m, n, k))
    rate = chip.peak_flops * chip.gemm_max * (1.0 if aligned else chip.misaligned)
    return flops / rate + moved / (chip.mem_bandwidth * chip.mem_eff) + chip.launch_s


def gemm_efficiency(chip: Chip, m: float, n: float, k: float) -> float:
    """Achieved FLOP/s over peak of one ``(m, n, k)`` GEMM: the curve over sizes."""
    return 2 * m * n * k / gemm_time(chip, m, n, k) / chip.peak_flops


def stream_time(chip: Chip, nbytes: float) -> float:
    """Seconds to stream ``nbytes`` through HBM (memory-bound elementwise work)."""
    if nbytes < 0:
        raise ValueError(f"bytes must be >= 0, got {nbytes}")
    return nbytes / (chip.mem_bandwidth * chip.mem_eff)
