"""A pipeline schedule as data: an :class:`Action` record and a :class:`Schedule`, the per-rank
lists of actions that every generator returns, the validator checks, the simulator times and
the executor runs.

Vocabulary (Narayanan et al. 2021; Qi et al. 2023):

* ``p`` pipeline ranks, ``m`` micro-batches, ``v`` virtual stages (model chunks) per rank.
  Rank ``r``'s chunk ``c`` is virtual stage ``s = c * p + r`` (Megatron's interleaving), so
  stage ``s`` feeds stage ``s + 1`` on rank ``(r + 1) % p``; with ``v = 1``, stage = rank.
* compute: ``F`` forward, ``B`` backward (with ``split_backward``, the input-gradient half
  only), ``W`` the weight-gradient half (zero-bubble schedules).
* communication: ``SEND_F``/``RECV_F`` carry an activation to the next stage,
  ``SEND_B``/``RECV_B`` its gradient back. ``chunk`` is always *this* rank's chunk (the one
  that produced a sent tensor, or will consume a received one); ``peer`` is a pipeline rank.

The communication rule (NCCL-safe): the run of communication actions between two compute
actions is ONE batch, issued with ``dist.batch_isend_irecv`` and waited on as a whole. Send
and receive between the same two ranks are matched in issue order (k-th send to k-th recv).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["COMM", "COMPUTE", "Action", "Schedule"]

COMPUTE = ("F", "B", "W")
COMM = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")


@dataclass(frozen=True)
class Action:
    """One step of one rank: ``kind`` on micro-batch ``mb`` of local ``chunk`` (to ``peer``)."""

    kind: str
    mb: int
    chunk: int = 0
    peer: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in COMPUTE + COMM:
            raise ValueError(f"unknown action kind {self.kind!r}; expected one of {COMPUTE + COMM}")
        if (self.kind in COMM) != (self.peer is not None):
            raise ValueError(
                f"{self.kind}: communication actions need a peer, compute actions none"
            )

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE

    def label(self, v: int = 1) -> str:
        """Short text: ``F3``, ``B3``, ``W3``; chunk suffix ``F3.1`` when v > 1; ``sF3>1``."""
        chunk = f".{self.chunk}" if v > 1 else ""
        if self.is_compute:
            return f"{self.kind}{self.mb}{chunk}"
        arrow = ">" if self.kind.startswith("SEND") else "<"
        return f"{self.kind[0].lower()}{self.kind[-1]}{self.mb}{chunk}{arrow}{self.peer}"

    def __str__(self) -> str:
        return self.label(v=2)


@dataclass
class Schedule:
    """Per-rank action lists. ``ranks[r]`` is what pipeline rank ``r`` does, in order."""

    name: str
    p: int
    m: int
    v: int = 1
    split_backward: bool = False
    ranks: list[list[Action]] = field(default_factory=list)

    def stage(self, rank: int, chunk: int) -> int:
        """Virtual stage of ``rank``'s ``chunk``: ``chunk * p + rank``."""
        return chunk * self.p + rank

    def place(self, stage: int) -> tuple[int, int]:
        """(rank, chunk) holding virtual ``stage``."""
        return stage % self.p, stage // self.p

    @property
    def num_stages(self) -> int:
        return self.p * self.v

    def compute(self, rank: int) -> list[Action]:
        return [a for a in self.ranks[rank] if a.is_compute]

    def table(self, comm: bool = False) -> str:
        """One row per rank; columns are that rank's actions in order (compute only, unless
        ``comm``: then a batch of sends/receives prints as ``[sF0>1 rB0<1]``)."""
        rows = []
        for r, actions in enumerate(self.ranks):
            cells: list[str] = []
            batch: list[str] = []
            for a in actions:
                if a.is_compute:
                    if batch:
                        cells.append("[" + " ".join(batch) + "]")
                        batch = []
                    cells.append(a.label(self.v))
                elif comm:
                    batch.append(a.label(self.v))
            if batch:
                cells.append("[" + " ".join(batch) + "]")
            rows.append(
                f"rank {r} | " + " ".join(c if comm else c.ljust(5) for c in cells).rstrip()
            )
        head = f"{self.name}: p={self.p} m={self.m} v={self.v}"
        if self.split_backward:
            head += " (B = input gradient, W = weight gradient)"
        return "\n".join([head, *rows])

    def __str__(self) -> str:
        return self.table()
