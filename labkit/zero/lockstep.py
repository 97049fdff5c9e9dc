"""ZeRO-3's first-step check: every rank issues the same collectives, for the same modules.

ZeRO-3 (like FSDP) all-gathers a module's parameters from hooks around its forward and
backward, and reduce-scatters them when its backward ends; collectives pair up across ranks
by issue order alone. So every rank must run the same modules in the same order. A module
that one rank runs and another skips pairs one rank's all-gather with another unit's (gloo
aborts the process: "data size doesn't match"; NCCL may hang, or sum two units of one padded
size into each other, silently).

:class:`LockstepCheck` turns that into a clear error. During the first forward and backward,
before each of ZeRO-3's collectives, every rank all-gathers a fixed-size record of what it is
about to do: ``(kind, unit, module, phase)`` (4 int64). The records are compared, and on a
difference every rank raises the same ValueError, naming the module, *before* issuing the
mismatched collective. The check cannot itself mismatch: its records have one size on every
rank, and one precedes every collective, so the k-th record exchange of every rank pairs
with the k-th of every other, up to and including the first difference. The end of the
first backward is a record too, so a rank with collectives left over meets the others' end.

Cost: one all-gather of 32 * world_size bytes per collective of the first forward and
backward (about 3 per unit: gather in forward, gather in backward, reduce-scatter), latency
bound (~0.1-0.5 ms each on gloo); nothing after it. A module skipped only in a later step is
not caught: the check is a first-step guard, not a proof.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from labkit.zero.partition import Unit

__all__ = ["END", "GATHER", "REDUCE", "LockstepCheck"]

GATHER, REDUCE, END = 0, 1, 2
_WHAT = {GATHER: "all-gather for", REDUCE: "reduce-scatter the gradients for"}


class LockstepCheck:
    """Compare, across the ranks of ``group``, each collective of the first forward and
    backward before it is issued; :meth:`before` raises ValueError on every rank at the first
    difference. ``active`` turns False after :meth:`end` (or the error)."""

    def __init__(
        self,
        model: nn.Module,
        units: Sequence[Unit],
        group: ProcessGroup | None,
        device: torch.device,
    ) -> None:
        self.group, self.device = group, device
        self.world_size = dist.get_world_size(group)
        self.unit_index = {u: i for i, u in enumerate(units)}
        self.names = [name or "<the model>" for name, _ in model.named_modules()]
        self.module_index = {id(m): i for i, (_, m) in enumerate(model.named_modules())}
        self.count = 0
        self.active = True

    def before(self, kind: int, unit: Unit, module: nn.Module, backward: bool) -> None:
        """Record and compare: this rank is about to ``kind`` ``unit`` for ``module``."""
        if self.active:
            record = [kind, self.unit_index[unit], self.module_index.get(id(module), -1)]
            self._exchange([*record, int(backward)])

    def end(self) -> None:
        """The first backward is over on this rank: the last record, then no more checks."""
        if self.active:
            self._exchange([END, -1, -1, 1])
            self.active = False

    def _exchange(self, record: list[int]) -> None:
        mine = torch.tensor(record, dtype=torch.int64, device=self.device)  # (4,)
        everyone = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(everyone, mine, group=self.group)
        self.count += 1
        records = [tuple(int(v) for v in r.tolist()) for r in everyone]
        if len(set(records)) > 1:
            self.active = False
            raise ValueError(self._message(records))

    def _describe(self, record: tuple[int, ...]) -> str:
        kind, _, module, backward = record
        if kind == END:
            return "end of the first backward (no collective left)"
        phase = "backward" if backward else "forward"
        return f"{_WHAT[kind]} module {self.names[module]!r} (in {phase})"

    def _message(self, records: list[tuple[int, ...]]) -> str:
        by_record: dict[tuple[int, ...], list[int]] = {}
        for rank, rec in enumerate(records):
            by_record.setdefault(rec, []).append(rank)
        ranks = {rec: ", ".join(map(str, rs)) for rec, rs in by_record.items()}
        what = "; ".join(
            f"rank{'s' if len(rs) > 1 else ''} {ranks[rec]}: {self._describe(rec)}"
            for rec, rs in by_record.items()
        )
        ahead = [rec for rec in by_record if rec[0] == GATHER and not rec[3]]  # still in forward
        behind = [rec for rec in by_record if rec not in ahead]
        if ahead and behind:  # the others' forward is over: they skipped these modules
            skipped = ", ".join(
                f"{self.names[rec[2]]!r} ran on rank(s) {ranks[rec]}" for rec in ahead
            )
            verdict = f"module {skipped} but was skipped on the other ranks"
        else:  # both sides still in forward (or both in backward): one of them was skipped
            modules = " or ".join(
                f"{self.names[rec[2]]!r} (rank(s) {ranks[rec]})" for rec in by_record if rec[2] >= 0
            )
            verdict = f"one rank ran a module another skipped: {modules}"
        return (
            f"ZeRO-3: the ranks did not run the same modules (collective {self.count} of the "
            f"first forward and backward): {what}. So {verdict}. ZeRO-3, like FSDP, gathers a "
            "module's parameters from hooks around its forward and backward, and collectives "
            "pair up by order: every rank must run the same modules in the same order. Fix: "
            "run the module on every rank (where its result is not wanted, call it anyway and "
            "drop its output), or keep its parameters out of the sharded units (wrap=[...] "
            "listing only modules every rank runs: the rest join the model's root unit, "
            "gathered around the whole forward)."
        )
