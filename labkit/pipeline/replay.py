"""The timed replay under the pipeline simulator and the validator: a schedule's rules in time.

The replay follows the executor's rules exactly, so the same loop also finds deadlocks:

* a rank runs its actions in order; a compute action takes its cost;
* a batch of sends/receives is posted when the rank reaches it and completes when its ops have
  met their partners (k-th send from a to b <-> k-th receive on b from a);
* for the validator (``rendezvous=True``), EVERY op waits for its partner, at ``max(post time
  of both sides)``: NCCL's worst case, where a send waits for its receive. A schedule that
  finishes this way is safe on NCCL and on gloo (which is laxer);
* for timing (the default), sends are eager and only receives wait: what gloo does, and NCCL
  when a message fits its buffers. Both: a batch that can never complete is a deadlock.

Costs: by default F, B and W are per micro-batch for a rank's WHOLE share of the model, and
with v chunks per rank each chunk's action costs 1/v of it (an even cut). For an uneven cut,
``Costs.stages`` gives each virtual stage's work (``labkit.pipeline.cut.stage_work``: its
blocks, plus the embedding's and the head's share), and an action of stage s costs
``F * stages[s]`` (B, W alike): F, B and W are then the costs of ONE unit of work (one block).
A full backward (schedules without W) costs B + W.

This module sits below both ``validator`` (which replays at unit cost to find deadlocks) and
``simulator`` (validate, then replay): the imports run one way, simulator -> validator ->
replay.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from labkit.pipeline.actions import Action, Schedule

__all__ = [
    "Costs",
    "DeadlockError",
    "SimResult",
    "TimedAction",
    "pair_ops",
    "peak_stash",
    "replay",
]


class DeadlockError(RuntimeError):
    """No rank can make progress; ``rank``/``position``/``action`` name the first stuck one."""

    def __init__(self, message: str, rank: int, position: int, action: Action):
        super().__init__(message)
        self.rank, self.position, self.action = rank, position, action


@dataclass(frozen=True)
class Costs:
    """Seconds (or units) per micro-batch: for one rank's whole share of the model, or, when
    ``stages`` is given, for one unit of a stage's work (module docstring)."""

    F: float = 1.0
    B: float = 1.0  # input gradient (the whole backward is B + W when it is not split)
    W: float = 1.0  # weight gradient
    latency: float = 0.0  # one point-to-point transfer
    stages: tuple[float, ...] | None = None  # each virtual stage's work; None: v equal chunks

    def of(self, action: Action, sched: Schedule, rank: int = 0) -> float:
        """The cost of ``action`` on pipeline rank ``rank`` (its chunk's stage's work)."""
        if action.kind == "F":
            c = self.F
        elif action.kind == "W":
            c = self.W
        else:
            c = self.B if sched.split_backward else self.B + self.W
        if self.stages is None:
            return c / sched.v
        return c * self.stages[sched.stage(rank, action.chunk)]

    def check(self, sched: Schedule) -> None:
        """Raise ``ValueError`` naming both counts unless ``stages`` fits the schedule."""
        if self.stages is not None and len(self.stages) != sched.num_stages:
            raise ValueError(
                f"Costs.stages has {len(self.stages)} entries, but the schedule has "
                f"{sched.num_stages} virtual stages (p={sched.p} x v={sched.v})"
            )
        if self.stages is not None and any(w < 0 for w in self.stages):
            raise ValueError(f"Costs.stages {self.stages} must all be >= 0")


@dataclass(frozen=True)
class TimedAction:
    rank: int
    action: Action
    start: float
    end: float


@dataclass
class SimResult:
    schedule: Schedule
    timeline: list[TimedAction]
    makespan: float
    busy: list[float]
    peak_stash: list[int] = field(default_factory=list)

    @property
    def bubble(self) -> list[float]:
        return [1 - b / self.makespan for b in self.busy]

    @property
    def bubble_fraction(self) -> float:
        """Idle share of total time, averaged over ranks."""
        return sum(self.bubble) / len(self.bubble)

    @property
    def bubble_over_ideal(self) -> float:
        """Idle time over compute time, averaged over ranks: (p-1)/(v m) for interleaved."""
        return sum((self.makespan - b) / b for b in self.busy) / len(self.busy)


def pair_ops(sched: Schedule) -> dict[tuple[int, int], tuple[int, int]]:
    """(rank, position) of each send/receive -> (rank, position) of its partner: the k-th
    send from a to b pairs with the k-th receive on b from a. Unpaired ops are left out."""
    sends: dict[tuple[int, int], list[int]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[int]] = defaultdict(list)
    for r, actions in enumerate(sched.ranks):
        for i, a in enumerate(actions):
            if a.kind.startswith("SEND"):
                sends[(r, a.peer)].append(i)  # type: ignore[index]
            elif a.kind.startswith("RECV"):
                recvs[(a.peer, r)].append(i)  # type: ignore[index]
    partner: dict[tuple[int, int], tuple[int, int]] = {}
    for (src, dst), positions in sends.items():
        for s, q in zip(positions, recvs.get((src, dst), [])):
            partner[(src, s)], partner[(dst, q)] = (dst, q), (src, s)
    return partner


def _steps(actions: list[Action]) -> list[list[int]]:
    """Positions grouped into steps: a compute action alone, or one batch of communication."""
    steps: list[list[int]] = []
    for i, a in enumerate(actions):
        if not a.is_compute and steps and not actions[steps[-1][-1]].is_compute:
            steps[-1].append(i)
        else:
            steps.append([i])
    return steps


def replay(sched: Schedule, costs: Costs, rendezvous: bool = False) -> SimResult:
    """Run the schedule's rules in time; raise :class:`DeadlockError` when it cannot finish.

    ``rendezvous``: a send also waits for its receive (NCCL's worst case; the validator uses
    it). Otherwise sends are eager (done when posted: gloo, and NCCL when the message fits its
    buffers), and a receive completes at ``max(its post, the send's post) + latency``."""
    costs.check(sched)
    p = sched.p
    partner = pair_ops(sched)
    steps = [_steps(actions) for actions in sched.ranks]
    nxt, clock = [0] * p, [0.0] * p
    posted: dict[tuple[int, int], float] = {}
    timeline: list[TimedAction] = []
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while nxt[r] < len(steps[r]):
                step = steps[r][nxt[r]]
                first = sched.ranks[r][step[0]]
                if first.is_compute:
                    end = clock[r] + costs.of(first, sched, r)
                    timeline.append(TimedAction(r, first, clock[r], end))
                    clock[r], nxt[r], progress = end, nxt[r] + 1, True
                    continue
                for i in step:
                    posted.setdefault((r, i), clock[r])
                waits = [i for i in step if rendezvous or sched.ranks[r][i].kind.startswith("RECV")]
                if not all(partner.get((r, i)) in posted for i in waits):
                    break
                done = max(
                    [clock[r]]
                    + [max(posted[(r, i)], posted[partner[(r, i)]]) + costs.latency for i in waits]
                )
                for i in step:
                    timeline.append(TimedAction(r, sched.ranks[r][i], clock[r], done))
                clock[r], nxt[r], progress = max(clock[r], done), nxt[r] + 1, True
    stuck = [r for r in range(p) if nxt[r] < len(steps[r])]
    if stuck:
        r = stuck[0]
        step = steps[r][nxt[r]]
        i = next(
            i
            for i in step
            if (rendezvous or sched.ranks[r][i].kind.startswith("RECV"))
            and partner.get((r, i)) not in posted
        )
        a = sched.ranks[r][i]
        if (r, i) not in partner:
            other = "receive" if a.kind.startswith("SEND") else "send"
            why = f"rank {a.peer} has no matching {other}"
        else:
            q, j = partner[(r, i)]
            k = nxt[q]
            at = sched.ranks[q][steps[q][k][0]] if k < len(steps[q]) else None
            why = (
                f"its partner on rank {q} (position {j}) is never posted: rank {q} is stuck at {at}"
            )
        raise DeadlockError(
            f"deadlock: rank {r} blocks at position {i} on {a} (micro-batch {a.mb}): {why}", r, i, a
        )
    busy = [0.0] * p
    for t in timeline:
        if t.action.is_compute:
            busy[t.rank] += t.end - t.start
    return SimResult(sched, timeline, max(clock), busy, peak_stash(sched))


def peak_stash(sched: Schedule) -> list[int]:
    """Most (micro-batch, chunk) activations alive at once on each rank (order alone decides)."""
    release = "W" if sched.split_backward else "B"
    peaks = []
    for actions in sched.ranks:
        live = peak = 0
        for a in actions:
            if a.kind == "F":
                live += 1
                peak = max(peak, live)
            elif a.kind == release:
                live -= 1
        peaks.append(peak)
    return peaks
