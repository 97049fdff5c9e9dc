"""The two promises of every labkit communication pattern, as a small API a new pattern reuses.

1. **Shapes that differ across ranks raise on every rank**, never a native abort. gloo kills
   a rank (SIGABRT, "Received data size doesn't match") and NCCL hangs when the two ends of a
   message disagree on its size. :func:`same_everywhere` makes every rank send a row of
   integers (each tensor's dims and dtype, plus the pattern's own fields) to every other rank
   first, so a disagreement is the same ``ValueError`` on every rank. It is the cached check of
   :func:`labkit.collectives.common.validate`: a combination that passed is remembered per
   group (``pool.validated``), and repeating it exchanges nothing (the price, as there: after a
   combination passed, a rank that repeats it trusts its peers to repeat it too).
2. **An exception half-way leaves the group usable.** A pattern that posts messages and then
   computes (a ring step, a pipeline stage) must not leave a rank's messages unmatched when
   the compute raises: the peers would wait forever for the rest of the schedule, and the next
   call's messages would meet the old ones (wrong data, or a size mismatch). :func:`guarded`
   runs one call of a pattern so that a failing rank keeps *sending and receiving* every
   remaining message of the schedule, in the same order (NCCL-safe as before), and skips only
   the compute; at the end every rank learns, in one tiny exchange, whether any rank failed:
   the failing rank re-raises its own exception, the others raise :class:`PeerFailed`, and
   every posted message has been matched and waited on. The next call on the group works.

Usage (ring attention, the collectives and the pipeline executor are written this way)::

    same_everywhere("my_pattern", group, {"x": x}, {"steps": steps})   # before any message
    with guarded("my_pattern", group, x.device) as g:
        for step in range(steps):
            recv_w, send_w = post(sends, recvs, group)    # always: the schedule never changes
            if g.ok:                                      # skip compute once this rank failed
                with g.catch():                           # an exception here is recorded
                    y = compute(x)                # or: y = g.run(compute, x, default=y)
            for w in recv_w + send_w:
                w.wait()                                  # always
    # leaving the block: the settle exchange; raises on every rank if any rank failed

Only compute runs inside ``g.catch()``/``g.run``, never a post or a wait. An exception that
escapes the block *after the schedule's last message* (a final copy) is settled the same way;
one that escapes mid-schedule (a communication error) cannot be contained: the group is lost.

Nesting: a ``guarded`` call made by the pattern's own code (the hierarchical all-reduce's
phases, the ring all-reduce's two halves) *joins* the open guard of its thread: one settle for
the outermost call, and an inner failure puts the whole call in send-only mode. A pattern
called from inside ``g.catch()`` (a tensor-parallel all-reduce inside a pipeline stage) is a
call of its own, with its own settle.

Cost on the happy path: one exchange of ``p - 1`` 8-byte messages per outermost call (one
latency, ``alpha``), tagged ``CONTROL_TAG`` like the check's rows, so byte counters
(``labkit.measure.wire_count``) tell them from data. The collectives settle only when called
with ``check=True`` (their default); ``Comm``'s hot paths pass ``check=False``: send-only mode
still keeps every message matched, but the peers of a failing rank complete instead of raising
(``guarded(settle=False)``). The table-driven proof is ``tests/test_pattern_failures.py``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch.distributed import ProcessGroup

from labkit.collectives.common import post, validate
from labkit.collectives.pool import DEFAULT_POOL, BufferPool
from labkit.collectives.primitives import CONTROL_TAG
from labkit.parallel.layout import global_rank, group_rank_and_size

__all__ = ["Guard", "PeerFailed", "guarded", "same_everywhere", "shape_fields", "MAX_DIMS"]

MAX_DIMS = 8  # dims per tensor in the check's row (padded with -1: every row has one length)
DTYPES = (
    torch.float32, torch.float64, torch.bfloat16, torch.float16,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
)  # fmt: skip
_R = TypeVar("_R")
_open = threading.local()  # .guard: the open guard of this thread, outside its compute


class PeerFailed(RuntimeError):
    """Another rank raised half-way through a pattern; this rank finished its messages."""


def shape_fields(tensors: dict[str, torch.Tensor]) -> tuple[str | None, dict[str, int]]:
    """This rank's problem (or None) and the fields every rank must agree on: each tensor's
    dim count, its ``MAX_DIMS`` sizes (-1 past its last dim) and its dtype (index in DTYPES)."""
    fields: dict[str, int] = {}
    problem = None
    for name, t in tensors.items():
        if t.dim() > MAX_DIMS:
            problem = f"{name} has {t.dim()} dims; the shape check handles at most {MAX_DIMS}"
        fields[f"{name}.dim()"] = t.dim()
        for i in range(MAX_DIMS):
            fields[f"{name}.shape[{i}]"] = t.shape[i] if i < t.dim() else -1
        code = DTYPES.index(t.dtype) if t.dtype in DTYPES else -1
        fields[f"{name}.dtype (index in {', '.join(str(d)[6:] for d in DTYPES)})"] = code
    return problem, fields


def same_everywhere(
    what: str,
    group: ProcessGroup | None,
    tensors: dict[str, torch.Tensor],
    fields: dict[str, int] | None = None,
    *,
    problem: str | None = None,
    check: bool = True,
    pool: BufferPool = DEFAULT_POOL,
) -> None:
    """Raise the same ValueError on every rank of ``group`` unless every rank passed tensors
    of the same shapes and dtypes (and equal ``fields``); once per combination (cached).

    ``problem``: this rank's own reason to refuse, found without talking (every rank still
    takes part in the exchange, so none waits alone). Any dtype and layout is accepted (the
    collectives' stricter :func:`~labkit.collectives.common.validate` checks their own).
    """
    shape_problem, agreed = shape_fields(tensors)
    problem = problem or shape_problem
    if problem is not None:
        problem = f"{what}: {problem}" if not problem.startswith(what) else problem
    device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
    probe = {"shape check": torch.empty(0, device=device)}  # validate's dtype/op fields: fixed
    args = (what, group, probe, {**agreed, **(fields or {})})
    validate(*args, problem=problem, check=check, pool=pool)


class Guard:
    """One call of a pattern on one rank: whether its compute failed, and the settle."""

    def __init__(
        self, what: str, group: ProcessGroup | None, device: torch.device, settle: bool = True
    ) -> None:
        self.what, self.group, self.device = what, group, torch.device(device)
        self.error: BaseException | None = None
        self.exchange = settle  # False: raise this rank's own error only (see guarded)

    @property
    def ok(self) -> bool:
        """False once a compute step of this call raised on this rank (send-only mode)."""
        return self.error is None

    @contextlib.contextmanager
    def catch(self) -> Iterator[None]:
        """Run a compute step: an exception (or an interrupt) is recorded, not raised, so the
        caller goes on posting the schedule's messages. Patterns called inside it stand alone."""
        outer = getattr(_open, "guard", None)
        _open.guard = None
        try:
            yield
        except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - raised again at settle
            if self.error is None:
                self.error = exc
        finally:
            _open.guard = outer

    def run(self, fn: Callable[..., _R], *args: Any, default: Any = None) -> _R:
        """``fn(*args)`` as a compute step (:meth:`catch`); ``default`` once this rank failed."""
        if self.ok:
            with self.catch():
                return fn(*args)
        return default  # type: ignore[no-any-return]

    def settle(self) -> None:
        """Every rank tells every other whether it failed (one batch); raise if any did."""
        rank, p = group_rank_and_size(self.group)
        failed = [int(self.error is not None)]
        if p > 1 and self.exchange:
            flags = torch.zeros(p, dtype=torch.int64, device=self.device)
            flags[rank] = failed[0]
            others = [q for q in range(p) if q != rank]
            recv_w, send_w = post(
                [(flags[rank : rank + 1], global_rank(self.group, q)) for q in others],
                [(flags[q : q + 1], global_rank(self.group, q)) for q in others],
                self.group,
                CONTROL_TAG,  # control, not data: byte counters leave it out
            )
            for work in recv_w + send_w:
                work.wait()
            failed = flags.cpu().tolist()
        if self.error is not None:
            raise self.error
        bad = [q for q, f in enumerate(failed) if f]
        if bad:
            raise PeerFailed(
                f"{self.what}: rank {bad[0]} of the group raised half-way (see its error; "
                f"failed: {bad}); this rank completed every message, so the group stays usable"
            )


@contextlib.contextmanager
def guarded(
    what: str, group: ProcessGroup | None, device: torch.device, settle: bool = True
) -> Iterator[Guard]:
    """One call of a pattern (module docstring): yields its :class:`Guard`; on leaving, the
    ranks settle. Joins the thread's open guard when called from a pattern's own code.

    ``settle=False`` (a collective called with ``check=False``, as ``Comm`` does on every hot
    path) keeps send-only mode but skips the exchange: a failing rank raises its exception,
    its peers complete (with what it sent), the group stays usable; one latency saved."""
    outer = getattr(_open, "guard", None)
    if outer is not None:
        yield outer
        return
    guard = Guard(what, group, device, settle)
    _open.guard = guard
    try:
        yield guard
    except (Exception, KeyboardInterrupt) as exc:  # raised after the pattern's last message:
        if guard.error is None:  # the peers are settling, so settle with them, then raise it
            guard.error = exc
    finally:
        _open.guard = None
    guard.settle()
