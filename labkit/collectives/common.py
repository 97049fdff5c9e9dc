"""What every from-scratch collective shares: its bricks, scratch buffers, and the one check.

Kept apart so that ``naive.py``, ``ring.py`` and ``tree.py`` each read as one algorithm; the
algorithms import from here only, and this module re-exports the pieces kept beside it:
``primitives.py`` (ops, dtypes and ``wire=`` modes, chunking, :func:`post`: one batched
``dist.batch_isend_irecv`` per step, safe under NCCL), ``pool.py`` (:class:`BufferPool`, scratch
tensors allocated once, one set per thread) and ``profiled.py`` (one profiler range
``labkit:<collective>`` per outermost call, so :data:`labkit.profiling.breakdown.COUNTED`
counts labkit's all-reduces once each). Peers: inside a subgroup ``dist.isend``/``irecv``
address the *global* rank, so every algorithm finds its neighbours through :func:`global_rank`.

What lives here is the argument check. :func:`validate` is the one check every collective
calls first (:func:`validate_sharded`, :func:`validate_in_place` and the ring's three
``validate_<collective>`` shape it for one kind of call). Every rank sends a row of integers
(its sizes, op, dtype, and whether its own arguments are valid) to every other rank, so a
mismatch is the same clear ``ValueError`` on every rank, never a hang or a silently wrong sum.
It is paid once per (collective, sizes, op, dtype, group): a combination that passed is
remembered in the pool (``pool.validated``), and later calls with it exchange nothing. The
price of the cache: after a combination passed, a rank that repeats it trusts its peers to
repeat it too (``pool.clear()`` forgets, ``check=False`` never checks).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from labkit.collectives import primitives
from labkit.collectives.pool import DEFAULT_POOL, BufferPool
from labkit.collectives.primitives import CONTROL_TAG as CONTROL_TAG
from labkit.collectives.primitives import SUPPORTED_DTYPES as SUPPORTED_DTYPES
from labkit.collectives.primitives import SUPPORTED_OPS as SUPPORTED_OPS
from labkit.collectives.primitives import WIRES as WIRES
from labkit.collectives.primitives import accum_dtype as accum_dtype
from labkit.collectives.primitives import chunk_offsets as chunk_offsets
from labkit.collectives.primitives import chunk_sizes as chunk_sizes
from labkit.collectives.primitives import combine_ as combine_
from labkit.collectives.primitives import exchange as exchange
from labkit.collectives.primitives import op_name as op_name
from labkit.collectives.primitives import post as post
from labkit.collectives.primitives import wire_dtype as wire_dtype
from labkit.collectives.profiled import PROFILE_PREFIX, profiled
from labkit.parallel.layout import global_rank, group_rank_and_size

__all__ = [  # and every name of primitives.py (re-exported above)
    "BufferPool",
    "DEFAULT_POOL",
    "global_rank",
    "group_rank_and_size",
    "local_problem",
    "op_dtype_fields",
    "PROFILE_PREFIX",
    "profiled",
    "ring_neighbours",
    "validate",
    "validate_all_gather",
    "validate_all_reduce",
    "validate_in_place",
    "validate_reduce_scatter",
    "validate_sharded",
    "wire_fields",
]
__all__ += primitives.__all__


def wire_fields(what: str, wire: str) -> tuple[str | None, dict[str, int]]:
    """``wire`` for :func:`validate`: this rank's problem with it (or None), and the field
    every rank must agree on (a rank sending float32 partials to one expecting 16-bit ones
    would receive garbage or hang)."""
    problem = None if wire in WIRES else f"{what}: wire must be one of {WIRES}, got {wire!r}"
    return problem, {"wire (index in accum, input)": WIRES.index(wire) if not problem else -1}


def ring_neighbours(group: ProcessGroup | None) -> tuple[int, int, int, int]:
    """``(rank, p, right, left)`` on the ring of ``group``: this rank's group rank, the group
    size, and the *global* ranks of ``rank + 1`` and ``rank - 1`` (mod ``p``)."""
    rank, p = group_rank_and_size(group)
    return rank, p, global_rank(group, (rank + 1) % p), global_rank(group, (rank - 1) % p)


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
        primitives.CONTROL_TAG,
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
    args = (what, group, tensors, sizes)
    validate(*args, op=op, problem=problem, check=check, pool=pool, expected_numel=expected)


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


# ---- the ring's three checks (``ring.py`` and ``ring_tuned.py`` share them) ----------------


def validate_reduce_scatter(
    output_shard: torch.Tensor,
    input_full: torch.Tensor,
    op: object,
    group: ProcessGroup | None,
    check: bool,
    wire: str,
    pool: BufferPool = DEFAULT_POOL,
) -> None:
    """The checks of a ring reduce-scatter (:func:`validate_sharded`), ``wire`` included."""
    tensors = {"output_shard": output_shard, "input_full": input_full}
    problem, fields = wire_fields("ring_reduce_scatter", wire)
    args = ("ring_reduce_scatter", group, tensors, "input_full", "output_shard")
    validate_sharded(*args, op=op, problem=problem, check=check, pool=pool, fields=fields)


def validate_all_gather(
    output_full: torch.Tensor,
    input_shard: torch.Tensor,
    group: ProcessGroup | None,
    check: bool,
    pool: BufferPool = DEFAULT_POOL,
) -> None:
    """The checks of a ring all-gather (:func:`validate_sharded`)."""
    tensors = {"output_full": output_full, "input_shard": input_shard}
    validate_sharded(
        "ring_all_gather", group, tensors, "output_full", "input_shard", check=check, pool=pool
    )


def validate_all_reduce(
    tensor: torch.Tensor,
    op: object,
    group: ProcessGroup | None,
    *,
    check: bool = True,
    wire: str = "accum",
    pool: BufferPool = DEFAULT_POOL,
) -> None:
    """The checks of a ring all-reduce (:func:`validate_in_place`), ``wire`` included."""
    problem, fields = wire_fields("ring_all_reduce", wire)
    validate_in_place(
        "ring_all_reduce", group, tensor, op=op, problem=problem, check=check, pool=pool, **fields
    )
