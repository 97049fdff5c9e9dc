"""Gradient compression measured on the MNIST lab: accuracy, loss and bytes per step.

:func:`compare` trains :mod:`labkit.labs.mnist` once per compression setting, all in ONE
launch, with labkit's :class:`~labkit.ddp.OverlappedDDP` (``sync="labkit"``), the same seed,
data order and steps for every setting, so the only difference is how gradients travel.
Bytes per step are what this rank handed to its ``Comm`` (``comm.sent``: a ring all-reduce
of ``B`` bytes sends ``2 (W - 1) / W * B``), gradients and used flags included.

    python -m labkit.measure.compression            # prints the table (2 ranks, 100 steps)
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from dataclasses import dataclass
from typing import Any

from labkit.labs.mnist import MnistConfig, run_many

__all__ = ["DEFAULT_SETTINGS", "CompressionResult", "compare", "format_table"]

DEFAULT_SETTINGS = ("none", "fp16", "bf16", "powersgd1", "powersgd2", "powersgd2-noef")


@dataclass(frozen=True)
class CompressionResult:
    """One setting's run: validation accuracy, training loss at the end, bytes sent per step
    and the median step time (on one machine compression costs compute and saves little
    time; across slow links it is the bytes that count)."""

    setting: str
    accuracy: float
    final_loss: float  # mean loss of the last ``tail`` steps (one step's loss is noisy)
    bytes_per_step: float
    step_seconds: float
    losses: tuple[float, ...]


def compare(
    settings: tuple[str, ...] = DEFAULT_SETTINGS,
    *,
    max_steps: int = 100,
    world_size: int = 2,
    tail: int = 20,
    cfg: MnistConfig | None = None,
    **launch_options: Any,
) -> list[CompressionResult]:
    """Train the MNIST lab with each compression ``setting`` (see
    :func:`labkit.ddp.compression.make_compression`); one launch for all of them.

    ``cfg`` is the base configuration (``sync``, ``compression``, ``max_steps`` and
    ``progress`` are set here). Bad settings are refused before the launch.
    """
    base = cfg or MnistConfig(epochs=10.0)
    cfgs = [
        dataclasses.replace(base, sync="labkit", compression=s, max_steps=max_steps, progress=False)
        for s in settings  # each replace() validates its setting here, before any launch
    ]
    launch_options.setdefault("quiet", True)
    runs = run_many(cfgs, world_size=world_size, **launch_options)
    out = []
    for setting, per_rank in zip(settings, runs):
        r0 = per_rank[0]
        last = r0["losses"][-tail:]
        out.append(
            CompressionResult(
                setting=setting,
                accuracy=r0["accuracy"],
                final_loss=sum(last) / len(last),
                bytes_per_step=r0["bytes_per_step"],
                step_seconds=statistics.median(r0["step_times"]),
                losses=tuple(r0["losses"]),
            )
        )
    return out


def format_table(results: list[CompressionResult]) -> str:
    """A text table: setting, accuracy, final loss, bytes per step and the reduction
    against the uncompressed run (when it is among ``results``)."""
    ref = next((r.bytes_per_step for r in results if r.setting == "none"), None)
    lines = [
        f"{'setting':<16}{'accuracy':>10}{'final loss':>12}{'bytes/step':>13}{'less':>8}"
        f"{'step ms':>9}"
    ]
    for r in results:
        less = f"{ref / r.bytes_per_step:.1f}x" if ref else "-"
        lines.append(
            f"{r.setting:<16}{r.accuracy:>10.4f}{r.final_loss:>12.4f}"
            f"{r.bytes_per_step:>13,.0f}{less:>8}{r.step_seconds * 1e3:>9.1f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", nargs="+", default=list(DEFAULT_SETTINGS))
    parser.add_argument("--max-steps", type=int, default=100)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args(argv)
    results = compare(
        tuple(args.settings), max_steps=args.max_steps, world_size=args.world_size, timeout=600
    )
    print(f"MNIST lab, {args.world_size} ranks, {args.max_steps} steps, OverlappedDDP (gloo):")
    print(format_table(results))


if __name__ == "__main__":
    main()
