"""Schedule generators: GPipe, 1F1B, interleaved 1F1B and zero-bubble ZB-H1, as pure data.

Each generator decides only the ORDER of compute actions on every rank;
:func:`with_communication` then adds the sends and receives by one rule (the batch between
two compute actions carries the previous action's output and the next action's input), which
is Megatron's ``send_forward_recv_backward`` pattern. Interleaved 1F1B's steady state runs a
forward and a backward back to back and then ONE batch for both (Megatron's
``send_forward_backward_recv_forward_backward``): with a batch after every action, a send
between chunks waits on a rank that is itself waiting, and the validator reports the
deadlock. It proves each generated schedule deadlock-free; the tests run a grid of (p, m, v).

Bubbles with a forward cost F and a backward cost B (+ W when split), no transfer latency:

* GPipe (Huang et al. 2019): all m forwards, then all m backwards. Every rank idles
  (p - 1)(F + B) of a total (m + p - 1)(F + B): bubble fraction (p - 1) / (m + p - 1).
  Stash: all m micro-batches' activations.
* 1F1B / PipeDream-Flush (Narayanan et al. 2021): rank r runs p - r - 1 warm-up forwards,
  then alternates one forward, one backward. Same bubble as GPipe; stash at most p - r <= p.
* Interleaved 1F1B (Narayanan et al. 2021, section 2.2): each rank holds v chunks of L/(pv)
  layers; warm-up shrinks to chunks of 1/v the size, so the bubble is (p - 1)(F + B) / v:
  (p - 1) / (v m) of the ideal time m (F + B). Needs m to be a multiple of p.
* ZB-H1 (Qi et al. 2023): B is split into the input gradient B (on the critical path) and the
  weight gradient W (not: nothing downstream waits on it). W's are delayed to fill the
  cool-down bubble: bubble (p - 1)(F + B - W) instead of 1F1B's (p - 1)(F + B + W), a third of
  it when F = B = W, within 1F1B's peak memory (at most p micro-batches in flight on any
  rank; 1F1B's rank 0 holds p). The saving needs m >= p.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from labkit.pipeline.actions import Action, Schedule

__all__ = [
    "SCHEDULES",
    "check_schedule_args",
    "gpipe",
    "interleaved_1f1b",
    "make_schedule",
    "one_f_one_b",
    "with_communication",
    "zb_h1",
]


def check_schedule_args(name: str, p: int, m: int, v: int = 1) -> None:
    """Raise ``ValueError`` naming the numbers when (p, m, v) does not suit schedule ``name``."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; expected one of {sorted(SCHEDULES)}")
    for key, val in (("p", p), ("m", m), ("v", v)):
        if not isinstance(val, int) or val < 1:
            raise ValueError(f"{name}: {key}={val!r} must be an integer >= 1")
    if name != "interleaved" and v != 1:
        raise ValueError(f"{name} has one stage per rank: v={v} needs the 'interleaved' schedule")
    if name == "interleaved" and m % p != 0:
        raise ValueError(
            f"interleaved 1F1B needs the micro-batches to be a multiple of the pipeline ranks "
            f"(m >= p, m % p == 0): m={m}, p={p}"
        )


def with_communication(
    name: str,
    p: int,
    m: int,
    v: int,
    split: bool,
    orders: Sequence[Sequence[Action | tuple[Action, ...]]],
) -> Schedule:
    """Add sends/receives to per-rank compute orders. An order's element is one compute action
    or a tuple run back to back (Megatron's interleaved steady state pairs a forward with a
    backward). Before each element: ONE batch with the previous element's output sends and
    this element's input receives; after the last, its sends."""
    sched = Schedule(name, p, m, v, split)
    last = p * v - 1

    def inputs(r: int, a: Action) -> list[Action]:
        s = sched.stage(r, a.chunk)
        if a.kind == "F" and s > 0 and sched.place(s - 1)[0] != r:
            return [Action("RECV_F", a.mb, a.chunk, sched.place(s - 1)[0])]
        if a.kind == "B" and s < last and sched.place(s + 1)[0] != r:
            return [Action("RECV_B", a.mb, a.chunk, sched.place(s + 1)[0])]
        return []

    def outputs(r: int, a: Action) -> list[Action]:
        s = sched.stage(r, a.chunk)
        if a.kind == "F" and s < last and sched.place(s + 1)[0] != r:
            return [Action("SEND_F", a.mb, a.chunk, sched.place(s + 1)[0])]
        if a.kind == "B" and s > 0 and sched.place(s - 1)[0] != r:
            return [Action("SEND_B", a.mb, a.chunk, sched.place(s - 1)[0])]
        return []

    for r, order in enumerate(orders):
        steps = [list(x) if isinstance(x, tuple) else [x] for x in order]
        out: list[Action] = []
        for k, step in enumerate(steps):
            batch = [x for a in steps[k - 1] for x in outputs(r, a)] if k else []
            out += batch + [x for a in step for x in inputs(r, a)] + step
        if steps:
            out += [x for a in steps[-1] for x in outputs(r, a)]
        sched.ranks.append(out)
    return sched


def gpipe(p: int, m: int, v: int = 1) -> Schedule:
    """All forwards, then all backwards (in micro-batch order, as torch's ScheduleGPipe)."""
    check_schedule_args("gpipe", p, m, v)
    orders = [
        [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)] for _ in range(p)
    ]
    return with_communication("gpipe", p, m, 1, False, orders)


def _one_f_one_b_order(r: int, p: int, m: int, backward: str = "B") -> list[Action]:
    warmup = min(p - r - 1, m)
    order = [Action("F", i) for i in range(warmup)]
    for i in range(m - warmup):  # steady state: one forward, one backward
        order += [Action("F", warmup + i), Action(backward, i)]
    order += [Action(backward, i) for i in range(m - warmup, m)]  # cool-down
    return order


def one_f_one_b(p: int, m: int, v: int = 1) -> Schedule:
    """PipeDream-Flush: p - r - 1 warm-up forwards on rank r, then one forward, one backward."""
    check_schedule_args("1f1b", p, m, v)
    return with_communication(
        "1f1b", p, m, 1, False, [_one_f_one_b_order(r, p, m) for r in range(p)]
    )


def interleaved_1f1b(p: int, m: int, v: int = 2) -> Schedule:
    """Megatron's interleaved 1F1B. Micro-batches go in groups of p through chunk 0, then the
    same group through chunk 1, ...; virtual micro-batch k is (mb, chunk) with::

        chunk_F(k) = (k mod pv) // p,   chunk_B(k) = v - 1 - chunk_F(k),
        mb(k)      = (k // pv) * p + k mod p

    Rank r warms up with 2 (p - r - 1) + (v - 1) p forwards, then
    alternates, each forward-backward pair followed by one batch (send both, receive both)."""
    check_schedule_args("interleaved", p, m, v)
    if v == 1:  # one chunk per rank: plain 1F1B
        return with_communication(
            "interleaved", p, m, 1, False, [_one_f_one_b_order(r, p, m) for r in range(p)]
        )
    total = m * v

    def unit(kind: str, k: int) -> Action:
        chunk = (k % (p * v)) // p
        return Action(kind, (k // (p * v)) * p + k % p, chunk if kind == "F" else v - 1 - chunk)

    orders = []
    for r in range(p):
        warmup = min(2 * (p - r - 1) + (v - 1) * p, total)
        order: list[Action | tuple[Action, ...]] = [unit("F", k) for k in range(warmup)]
        for k in range(total - warmup):  # steady state: F and B back to back, then one batch
            order.append((unit("F", warmup + k), unit("B", k)))
        order += [unit("B", k) for k in range(total - warmup, total)]
        orders.append(order)
    return with_communication("interleaved", p, m, v, False, orders)


def zb_h1(p: int, m: int, v: int = 1) -> Schedule:
    """ZB-H1: 1F1B's order of F and B (B = input gradient), with each W placed by a unit-cost
    (F = B = W) pass: a rank runs its next F/B as soon as its input has arrived and otherwise
    fills the wait with its oldest pending W. A rank never holds more than p micro-batches
    between F and W (1F1B's peak, on its rank 0), and drains its last W's in the cool-down."""
    check_schedule_args("zb-h1", p, m, v)
    fb = [_one_f_one_b_order(r, p, m) for r in range(p)]
    done: dict[tuple[str, int, int], int] = {}  # (kind, mb, rank) -> finish time
    orders: list[list[Action]] = [[] for _ in range(p)]
    nxt, pending, live = [0] * p, [[] for _ in range(p)], [0] * p  # type: ignore[var-annotated]
    t = 0
    while any(nxt[r] < len(fb[r]) or pending[r] for r in range(p)):
        started: list[tuple[str, int, int]] = []
        for r in range(p):
            a = fb[r][nxt[r]] if nxt[r] < len(fb[r]) else None
            need = None
            if a is not None and a.kind == "F" and r > 0:
                need = ("F", a.mb, r - 1)
            if a is not None and a.kind == "B":
                need = ("B", a.mb, r + 1) if r < p - 1 else ("F", a.mb, r)
            ready = a is not None and (need is None or done.get(need, t + 1) <= t)
            if ready and a is not None and a.kind == "F" and live[r] >= p and pending[r]:
                ready = False  # memory cap: finish a W before taking in another micro-batch
            if ready and a is not None:
                orders[r].append(a)
                nxt[r] += 1
                started.append((a.kind, a.mb, r))
                if a.kind == "F":
                    live[r] += 1
                else:
                    pending[r].append(a.mb)
            elif pending[r]:
                orders[r].append(Action("W", pending[r].pop(0)))
                live[r] -= 1
        for key in started:
            done[key] = t + 1
        t += 1
    return with_communication("zb-h1", p, m, 1, True, orders)


SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved_1f1b,
    "zb-h1": zb_h1,
}


def make_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The schedule ``name`` (``gpipe``, ``1f1b``, ``interleaved``, ``zb-h1``) for (p, m, v)."""
    check_schedule_args(name, p, m, v)
    return SCHEDULES[name](p, m, v)
