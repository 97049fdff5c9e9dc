"""What every from-scratch collective shares: reduce ops, chunking, peers, scratch buffers, checks.

Why past ~300 lines: this is the toolbox the algorithms share (ops, chunking, peers,
buffers, batched posting, the cached cross-rank check), kept out of them so that each
algorithm reads as one algorithm.

Kept apart so that ``naive.py``, ``ring.py`` and ``tree.py`` each read as one algorithm.

* **Ops.** SUM, AVG, MAX and MIN. AVG is a SUM divided by the group size at the very end,
  in the accumulation dtype, so it costs one rounding like the native AVG.
* **Precision.** float16/bfloat16 are reduced in float32 (:func:`accum_dtype`): partial
  results travel and are added in float32, and the result is rounded to the input dtype once.
  float32/float64 are reduced in their own dtype.
* **Wire.** ``wire="accum"`` (the default, above) or ``wire="input"``: 16-bit partials
  travel in their own dtype, each hop adds in float32 and rounds back (as NCCL does), half
  the bytes of the reduce phase (:func:`wire_dtype`; the bounds are in ``ring_tuned.py``).
* **Chunks.** ``n`` elements over ``p`` ranks split like ``torch.tensor_split``: the first
  ``n % p`` chunks hold one extra element. A chunk may be empty (``n < p``); empty chunks are
  never sent, and both ends of a link know that because every rank agrees on ``n``.
* **Peers.** Inside a subgroup, ``dist.isend``/``irecv`` address the *global* rank, so every
  algorithm computes its neighbours through :func:`global_rank`.
* **Messages.** :func:`post` puts one step's sends and receives in ONE
  ``dist.batch_isend_irecv``, the order that cannot deadlock under NCCL (see its docstring);
  ``tests/test_collectives.py`` records every point-to-point call to prove it.
* **Buffers.** :class:`~labkit.collectives.pool.BufferPool` (in ``pool.py``, re-exported here)
  hands out scratch tensors that are allocated once and grown geometrically, one set per
  thread (the thread rule is in its docstring): every collective is safe on any thread, on
  different groups at once.
* **Groups.** Every message names the collective's group (``post``, and the blocking
  ``send``/``recv`` of ``naive.py`` and ``tree.py``), so two threads on two groups never match
  each other's messages (gloo pairs point-to-point messages per group, by peer and tag).
* **Profiling.** Every public collective is :func:`~labkit.collectives.profiled.profiled`
  (``profiled.py``, re-exported here): under ``torch.profiler`` it is
  one ``record_function`` range ``labkit:<collective>`` (as torch's are ``gloo:all_reduce``),
  for the outermost labkit collective of a thread only, so
  :data:`labkit.profiling.breakdown.COUNTED` counts labkit's all-reduces once each.
* **Validation.** :func:`validate` is the one argument check every collective calls first.
  Every rank sends a row of integers (its sizes, op, dtype, and whether its own arguments are
  valid) to every other rank, so a mismatch is the same clear ``ValueError`` on every rank,
  never a hang or a silently wrong sum. It is paid once per (collective, sizes, op, dtype,
  group): a combination that passed is remembered in the pool (``pool.validated``), and later
  calls with it exchange nothing. The price of the cache: after a combination passed, a rank
  that repeats it trusts its peers to repeat it too (``pool.clear()`` forgets, ``check=False``
  never checks).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from labkit.collectives.pool import DEFAULT_POOL, BufferPool
from labkit.collectives.profiled import PROFILE_PREFIX, profiled
from labkit.parallel.layout import global_rank, group_rank_and_size

__all__ = [
    "SUPPORTED_OPS",
    "SUPPORTED_DTYPES",
    "BufferPool",
    "DEFAULT_POOL",
    "WIRES",
    "accum_dtype",
    "chunk_sizes",
    "chunk_offsets",
    "combine_",
    "exchange",
    "global_rank",
    "group_rank_and_size",
    "local_problem",
    "op_dtype_fields",
    "op_name",
    "post",
    "PROFILE_PREFIX",
    "profiled",
    "validate",
    "validate_in_place",
    "validate_sharded",
    "wire_dtype",
    "wire_fields",
]

SUPPORTED_OPS = (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX, ReduceOp.MIN)
SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def op_name(op: object) -> str:
    """A readable name for a ReduceOp (they print as opaque objects)."""
    for name in ("SUM", "AVG", "MAX", "MIN", "PRODUCT", "BAND", "BOR", "BXOR", "PREMUL_SUM"):
        if op == getattr(ReduceOp, name, None):
            return name
    return repr(op)


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype partial results are added in: float32 for 16-bit floats, else the dtype itself."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


WIRES = ("accum", "input")  # what 16-bit partials travel as: float32, or their own dtype


def wire_dtype(dtype: torch.dtype, wire: str = "accum") -> torch.dtype:
    """The dtype partials travel and are added in: :func:`accum_dtype` for ``wire="accum"``,
    the input dtype itself for ``wire="input"`` (each hop then rounds to it)."""
    if wire not in WIRES:
        raise ValueError(f"wire must be one of {WIRES}, got {wire!r}")
    return accum_dtype(dtype) if wire == "accum" else dtype


def wire_fields(what: str, wire: str) -> tuple[str | None, dict[str, int]]:
    """``wire`` for :func:`validate`: this rank's problem with it (or None), and the field
    every rank must agree on (a rank sending float32 partials to one expecting 16-bit ones
    would receive garbage or hang)."""
    problem = None if wire in WIRES else f"{what}: wire must be one of {WIRES}, got {wire!r}"
    return problem, {"wire (index in accum, input)": WIRES.index(wire) if not problem else -1}


def chunk_sizes(n: int, p: int) -> list[int]:
    """Sizes of the ``p`` chunks of ``n`` elements: the first ``n % p`` get one extra element.

    >>> chunk_sizes(10, 4)
    [3, 3, 2, 2]
    """
    base, extra = divmod(n, p)
    return [base + (1 if c < extra else 0) for c in range(p)]


def chunk_offsets(n: int, p: int) -> list[int]:
    """Start offset of every chunk of :func:`chunk_sizes` (``p + 1`` entries, the last is ``n``)."""
    offsets = [0]
    for size in chunk_sizes(n, p):
        offsets.append(offsets[-1] + size)
    return offsets


def combine_(acc: torch.Tensor, x: torch.Tensor, op: object) -> torch.Tensor:
    """``acc = acc (op) x`` in place; ``x`` may have a lower-precision dtype than ``acc``."""
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        return acc.add_(x)
    if op == ReduceOp.MAX:
        return torch.maximum(acc, x, out=acc)
    if op == ReduceOp.MIN:
        return torch.minimum(acc, x, out=acc)
    raise ValueError(f"unsupported reduce op {op_name(op)}")


class _Joined:
    """One handle for several: NCCL coalesces a batch into a single Work for all its ops."""

    def __init__(self, works: list[dist.Work]) -> None:
        self.works = works

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        return True


def post(
    sends: list[tuple[torch.Tensor, int]],
    recvs: list[tuple[torch.Tensor, int]],
    group: ProcessGroup | None,
) -> tuple[list[Any], list[Any]]:
    """Post one step's sends and receives (``(tensor, global peer)``) as ONE batch.

    Why a batch: NCCL runs ungrouped point-to-point calls between two ranks on one stream in
    issue order, so a rank that posts ``irecv`` then ``isend`` against a peer doing the same
    waits forever (gloo hides it). Inside ``dist.batch_isend_irecv`` the order of sends and
    receives does not matter. Empty tensors are skipped: both ends know the sizes, so both
    skip the same messages. Returns the receive handles and the send handles, in order (with
    NCCL, whose batch yields one handle, every entry waits for the whole batch).
    """
    # receives first: under gloo a send waits for the peer's "receive posted" notice, so
    # announcing ours early lets the peer's data start flowing sooner (NCCL does not care)
    ops = [dist.P2POp(dist.irecv, t, peer, group) for t, peer in recvs if t.numel()]
    ops += [dist.P2POp(dist.isend, t, peer, group) for t, peer in sends if t.numel()]
    works: list[Any] = dist.batch_isend_irecv(ops) if ops else []
    if len(works) != len(ops):
        works = [_Joined(works)] * len(ops)
    handles = iter(works)
    recv_works = [next(handles) if t.numel() else _Joined([]) for t, _ in recvs]
    send_works = [next(handles) if t.numel() else _Joined([]) for t, _ in sends]
    return recv_works, send_works


def exchange(
    send: torch.Tensor, to: int, recv: torch.Tensor, source: int, group: ProcessGroup | None
) -> None:
    """Send ``send`` to global rank ``to`` while receiving ``recv`` from ``source``; wait."""
    recv_works, send_works = post([(send, to)], [(recv, source)], group)
    for work in recv_works + send_works:
        work.wait()


def local_problem(
    what: str,
    tensors: dict[str, torch.Tensor],
    op: object | None = None,
    expected_numel: dict[str, int] | None = None,
) -> str | None:
    """What is wrong with this rank's arguments, checkable without talking to anyone (or None)."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            return f"{what}: {name} must be a torch.Tensor, got {type(t).__name__}"
        if not t.is_contiguous():
            return f"{what}: {name} must be contiguous (call .contiguous() first)"
    dtypes = {t.dtype for t in tensors.values()}
    devices = {t.device for t in tensors.values()}
    for name, t in tensors.items():
        if t.dtype not in SUPPORTED_DTYPES:
            names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
            return f"{what}: {name} has unsupported dtype {t.dtype} (supported: {names})"
    if len(dtypes) > 1 or len(devices) > 1:
        desc = ", ".join(f"{k}: {t.dtype} on {t.device}" for k, t in tensors.items())
        return f"{what}: tensors must share dtype and device, got {desc}"
    if op is not None and op not in SUPPORTED_OPS:
        return f"{what}: unsupported reduce op {op_name(op)} (supported: SUM, AVG, MAX, MIN)"
    for name, numel in (expected_numel or {}).items():
        if tensors[name].numel() != numel:
            got = tensors[name].numel()
            return f"{what}: {name} must have {numel} elements on this rank, got {got}"
    return None


def op_dtype_fields(op: object, dtype: torch.dtype) -> dict[str, int]:
    """The op and dtype as integers for :func:`validate` (-1: unsupported or not applicable)."""
    op_code = SUPPORTED_OPS.index(op) if op in SUPPORTED_OPS else -1  # type: ignore[arg-type]
    dtype_code = SUPPORTED_DTYPES.index(dtype) if dtype in SUPPORTED_DTYPES else -1
    return {
        "reduce op (index in SUM, AVG, MAX, MIN)": op_code,
        "dtype (index in float32, float64, bfloat16, float16)": dtype_code,
    }


def _agree(
    what: str, row: list[int], names: list[str], group: ProcessGroup | None, device: torch.device
) -> None:
    """Every rank sends ``row`` (``[has a problem, *fields]``) to every other rank, in one batch.

    One step of latency for any ``p`` (all messages in flight at once), ``p - 1`` tiny messages
    per rank. Raises the same ValueError on every rank when a row has a problem or a field differs.
    The table lives on the collective's device (NCCL sends only GPU tensors).
    """
    rank, p = group_rank_and_size(group)
    table = torch.zeros(p, len(row), dtype=torch.int64, device=device)  # row r: rank r's
    table[rank] = torch.tensor(row, dtype=torch.int64)
    others = [r for r in range(p) if r != rank]
    mine = table[rank]
    recv_works, send_works = post(
        [(mine, global_rank(group, r)) for r in others],
        [(table[r], global_rank(group, r)) for r in others],
        group,
    )
    for work in recv_works + send_works:
        work.wait()
    rows = table.cpu().tolist()
    failed = [r for r in range(p) if rows[r][0]]
    if failed:
        raise ValueError(
            f"{what}: rank {failed[0]} rejected its arguments (see the error on that rank)"
        )
    for j, name in enumerate(names, start=1):
        values = [row[j] for row in rows]
        if len(set(values)) > 1:
            per_rank = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            raise ValueError(
                f"{what}: ranks disagree on {name} ({per_rank}); every rank of the group "
                "must call the collective with the same arguments"
            )


def validate(
    what: str,
    group: ProcessGroup | None,
    tensors: dict[str, torch.Tensor],
    fields: dict[str, int],
    *,
    op: object | None = None,
    expected_numel: dict[str, int] | None = None,
    problem: str | None = None,
    check: bool = True,
    pool: BufferPool = DEFAULT_POOL,
) -> None:
    """The argument check every collective runs first; raises the same ValueError on every rank.

    ``tensors`` are checked locally (:func:`local_problem`, plus ``problem`` if the caller found
    one); ``fields`` (sizes, root, ...) plus op and dtype must be equal on every rank of
    ``group``. With ``check=True`` the ranks compare, once per combination (see the module
    docstring); with ``check=False`` only this rank's own problem is raised.
    """
    problem = problem or local_problem(what, tensors, op, expected_numel)
    dtype = next(iter(tensors.values())).dtype if problem is None else torch.float32
    fields = {**fields, **op_dtype_fields(op, dtype)}
    if not check:
        if problem is not None:
            raise ValueError(problem)
        return
    if group is None:
        group = dist.group.WORLD
    key = (what, group.group_name, id(group), *fields.values())  # type: ignore[union-attr]
    if problem is None and pool.is_validated(key):
        return
    try:
        row = [int(problem is not None), *fields.values()]
        devices = [t.device for t in tensors.values() if isinstance(t, torch.Tensor)]
        _agree(what, row, list(fields), group, devices[0] if devices else torch.device("cpu"))
    except ValueError:
        if problem is None:
            raise
    if problem is not None:  # this rank's own reason, rather than "rank r rejected"
        raise ValueError(problem)
    pool.mark_validated(key)


def validate_sharded(
    what: str,
    group: ProcessGroup | None,
    tensors: dict[str, torch.Tensor],
    full: str,
    shard: str,
    *,
    op: object | None = None,
    problem: str | None = None,
    check: bool = True,
    pool: BufferPool = DEFAULT_POOL,
    fields: dict[str, int] | None = None,
) -> None:
    """:func:`validate` for a reduce-scatter or an all-gather: ``tensors[shard]`` must hold
    exactly chunk ``rank`` of ``tensors[full]`` (:func:`chunk_sizes`), and every rank must
    agree on the full size (and on ``fields``)."""
    rank, p = group_rank_and_size(group)
    n = tensors[full].numel()
    expected = {shard: chunk_sizes(n, p)[rank]}
    sizes = {f"numel of {full}": n, **(fields or {})}
    validate(
        what,
        group,
        tensors,
        sizes,
        op=op,
        problem=problem,
        check=check,
        pool=pool,
        expected_numel=expected,
    )


def validate_in_place(
    what: str,
    group: ProcessGroup | None,
    tensor: torch.Tensor,
    *,
    op: object | None = None,
    problem: str | None = None,
    check: bool = True,
    pool: BufferPool = DEFAULT_POOL,
    **fields: int,
) -> None:
    """:func:`validate` for a collective on one tensor in place (all-reduce, broadcast): its
    numel, plus ``fields`` (a root, a source), must agree on every rank."""
    sizes = {"numel": tensor.numel(), **fields}
    validate(what, group, {"tensor": tensor}, sizes, op=op, problem=problem, check=check, pool=pool)
