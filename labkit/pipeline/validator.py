"""Is a schedule runnable? The first violation, by rank, position, action and micro-batch.

Checks, in this order (the first failure is raised as :class:`ScheduleError`):

1. Local order on each rank (rank 0 first, positions in order): every action names a real
   micro-batch and chunk; F(mb) before B(mb) before W(mb) on each stage, each exactly once;
   a stage receives its input before using it and sends its output after producing it, to the
   rank that holds the neighbouring stage; W only when the backward is split.
2. Matching: the k-th send from rank a to rank b pairs with the k-th receive on b from a; the
   pair must carry the same kind of tensor for the same micro-batch between neighbouring
   stages (a mismatch would silently feed the wrong activation, or hang on a size mismatch).
3. Deadlock freedom: a unit-cost replay under NCCL's semantics (``replay.replay``) ends.
"""

from __future__ import annotations

from labkit.pipeline.actions import Action, Schedule
from labkit.pipeline.replay import Costs, DeadlockError, pair_ops, replay

__all__ = ["ScheduleError", "validate"]


class ScheduleError(ValueError):
    """The first violation; ``rank``, ``position`` and ``action`` say where."""

    def __init__(self, message: str, rank: int, position: int | None, action: Action | None):
        super().__init__(message)
        self.rank, self.position, self.action = rank, position, action


def _fail(r: int, i: int | None, a: Action | None, why: str) -> ScheduleError:
    where = (
        f"rank {r}"
        if i is None
        else f"rank {r}, position {i}, {a} (micro-batch {a.mb if a else '?'})"
    )
    return ScheduleError(f"{where}: {why}", r, i, a)


def _check_rank(sched: Schedule, r: int) -> None:
    last = sched.num_stages - 1
    seen: set[tuple[str, int, int]] = set()
    for i, a in enumerate(sched.ranks[r]):
        if not (0 <= a.mb < sched.m and 0 <= a.chunk < sched.v):
            raise _fail(
                r, i, a, f"micro-batch must be in [0, {sched.m}) and chunk in [0, {sched.v})"
            )
        s = sched.stage(r, a.chunk)
        key = (a.kind, a.mb, a.chunk)
        prev_rank = sched.place(s - 1)[0] if s > 0 else None
        next_rank = sched.place(s + 1)[0] if s < last else None
        if a.is_compute and key in seen:
            raise _fail(r, i, a, f"{a.kind} of this micro-batch runs twice on stage {s}")
        if a.kind == "F" and prev_rank is not None:
            needs = ("RECV_F", a.mb, a.chunk) if prev_rank != r else ("F", a.mb, a.chunk - 1)
            if needs not in seen:
                raise _fail(r, i, a, f"forward before its input arrived from stage {s - 1}")
        if a.kind == "B":
            if ("F", a.mb, a.chunk) not in seen:
                raise _fail(r, i, a, "backward before its forward")
            if next_rank is not None:
                needs = ("RECV_B", a.mb, a.chunk) if next_rank != r else ("B", a.mb, a.chunk + 1)
                if needs not in seen:
                    raise _fail(r, i, a, f"backward before its gradient arrived from stage {s + 1}")
        if a.kind == "W":
            if not sched.split_backward:
                raise _fail(r, i, a, "W in a schedule whose backward is not split")
            if ("B", a.mb, a.chunk) not in seen:
                raise _fail(r, i, a, "weight gradient before its input gradient B")
        if a.kind in ("SEND_F", "SEND_B"):
            src = "F" if a.kind == "SEND_F" else "B"
            to = next_rank if src == "F" else prev_rank
            if (src, a.mb, a.chunk) not in seen:
                raise _fail(r, i, a, f"sends the output of {src} before computing it")
            if to is None or a.peer != to or to == r:
                raise _fail(r, i, a, f"stage {s} sends its {src} output to rank {to}, not {a.peer}")
        if a.kind in ("RECV_F", "RECV_B"):
            frm = prev_rank if a.kind == "RECV_F" else next_rank
            if frm is None or a.peer != frm or frm == r:
                raise _fail(r, i, a, f"stage {s} receives this from rank {frm}, not {a.peer}")
        if not a.is_compute and key in seen:
            raise _fail(r, i, a, "this transfer appears twice")
        seen.add(key)
    kinds = ("F", "B", "W") if sched.split_backward else ("F", "B")
    for c in range(sched.v):
        for mb in range(sched.m):
            for kind in kinds:
                if (kind, mb, c) not in seen:
                    raise _fail(r, None, None, f"never runs {kind} of micro-batch {mb} (chunk {c})")


def _check_pairs(sched: Schedule) -> None:
    partner = pair_ops(sched)
    for r, actions in enumerate(sched.ranks):
        for i, a in enumerate(actions):
            if a.is_compute:
                continue
            if (r, i) not in partner:
                other = "receive" if a.kind.startswith("SEND") else "send"
                raise _fail(r, i, a, f"rank {a.peer} posts no matching {other}")
            q, j = partner[(r, i)]
            b = sched.ranks[q][j]
            (snd, s_snd), (rcv, s_rcv) = sorted(
                [(a, sched.stage(r, a.chunk)), (b, sched.stage(q, b.chunk))],
                key=lambda x: not x[0].kind.startswith("SEND"),
            )
            step = 1 if snd.kind == "SEND_F" else -1
            if rcv.kind != "RECV" + snd.kind[4:] or snd.mb != rcv.mb or s_rcv - s_snd != step:
                raise _fail(
                    r,
                    i,
                    a,
                    f"is matched in issue order with rank {q}'s position {j}, {b}: "
                    "a different tensor (the k-th send to a rank meets its k-th receive)",
                )


def validate(sched: Schedule) -> Schedule:
    """Return ``sched`` if it is runnable; else raise :class:`ScheduleError` (first violation)."""
    if len(sched.ranks) != sched.p:
        raise ScheduleError(
            f"schedule has {len(sched.ranks)} rank lists for p={sched.p}", 0, None, None
        )
    for r in range(sched.p):
        _check_rank(sched, r)
    _check_pairs(sched)
    try:
        replay(sched, Costs(), rendezvous=True)
    except DeadlockError as exc:
        raise ScheduleError(str(exc), exc.rank, exc.position, exc.action) from None
    return sched
