"""All-to-all with uneven split sizes, as ONE batch of point-to-point messages.

Every rank ``r`` of a group of ``p`` holds ``input`` cut along dim 0 into ``p`` pieces
(``input_splits[q]`` rows for rank ``q``) and receives into ``output`` cut the same way
(``output_splits[q]`` rows from rank ``q``)::

    output[rows from q on rank r] = input[rows for r on rank q]

It is the transpose of a ``p x p`` matrix of messages, the collective behind expert
parallelism's dispatch and combine (GShard, Lepikhin et al. 2020) and Ulysses' sequence to
head resharding. Cost (alpha-beta, each rank sending ``D`` bytes in all, uniformly): ``p - 1``
messages in flight at once, ``(p-1)/p * D`` bytes leave each rank; on a full-bisection network
``alpha + (p-1)/p * D * beta`` (all links busy at once), on a ring of links it would be ``p/4``
times worse (:func:`labkit.experts.costs.all_to_all_time`).

Why one batch: with NCCL, ungrouped sends and receives between two ranks run in issue order
and two ranks that both receive first wait forever; :func:`labkit.collectives.common.post`
posts every message of the exchange in one ``batch_isend_irecv``, which NCCL matches as a
whole. A peer with zero rows either way is skipped on both ends (both know the sizes), so every
rank takes part even when it sends nothing to some rank. The own piece is a local copy, made
while the messages travel, as a compute step of :func:`labkit.collectives.guard.guarded` (if
it raises, the messages still complete and every rank raises: the group stays usable).

``check=True`` (default) first proves the sizes consistent: every pair exchanges what it will
send and expects, then every rank shares whether it found a mismatch, so a wrong split is the
same ``ValueError`` on every rank, never a hang or a short read. Callers that derived
``output_splits`` from an exchange of the counts (expert parallelism does) pass ``check=False``.
torch's own ``dist.all_to_all_single`` with split sizes is the peer; gloo supports it on CPU
(torch 2.13, zero-row splits and 2-D tensors included: measured in tests/test_experts.py).
"""

from __future__ import annotations

import math

import torch
from torch.distributed import ProcessGroup

from labkit.collectives.common import SUPPORTED_DTYPES, global_rank, group_rank_and_size, post
from labkit.collectives.guard import guarded
from labkit.collectives.profiled import profiled

__all__ = ["all_to_all", "all_to_all_problem"]

# dtypes the check names by index (integers travel too: expert parallelism sends counts)
DTYPE_CODES = (*SUPPORTED_DTYPES, torch.int64, torch.int32)


def all_to_all_problem(
    output: torch.Tensor,
    input: torch.Tensor,
    output_splits: list[int],
    input_splits: list[int],
    p: int,
) -> str | None:
    """What is wrong with this rank's own arguments (or None), checkable without talking."""
    for name, t in (("input", input), ("output", output)):
        if not t.is_contiguous():
            return f"all_to_all: {name} must be contiguous (call .contiguous() first)"
    if input.dtype != output.dtype or input.device != output.device:
        return (
            f"all_to_all: input is {input.dtype} on {input.device}, "
            f"output {output.dtype} on {output.device}"
        )
    if input.dim() == 0 or output.dim() == 0 or input.shape[1:] != output.shape[1:]:
        return (
            f"all_to_all: rows differ or are missing, input {tuple(input.shape)}, "
            f"output {tuple(output.shape)}"
        )
    for name, splits, t in (("input", input_splits, input), ("output", output_splits, output)):
        if len(splits) != p or any(s < 0 for s in splits):
            return f"all_to_all: {name}_splits={list(splits)} must be {p} sizes >= 0"
        if sum(splits) != t.shape[0]:
            return (
                f"all_to_all: {name}_splits={list(splits)} sum to {sum(splits)}, "
                f"but {name} has {t.shape[0]} rows"
            )
    return None


def _pairwise(
    rank: int,
    p: int,
    fields: list[int],
    expect: list[tuple[int, int]],
    group: ProcessGroup | None,
    device: torch.device,
) -> str | None:
    """Send peer q ``fields + [input_splits[q], output_splits[q]]``; compare what q sends.
    The rows live on the collective's device (NCCL sends only GPU tensors)."""
    rows = [fields + [s, o] for s, o in expect]
    mine = torch.tensor(rows, dtype=torch.int64, device=device)  # (p, f + 2)
    theirs = torch.zeros_like(mine)
    theirs[rank] = mine[rank]
    others = [q for q in range(p) if q != rank]
    recv, send = post(
        [(mine[q], global_rank(group, q)) for q in others],
        [(theirs[q], global_rank(group, q)) for q in others],
        group,
    )
    for work in recv + send:
        work.wait()
    nf = len(fields)
    for q in range(p):
        row = theirs[q].tolist()
        if row[0]:
            return f"all_to_all: rank {q} rejected its arguments (see the error on that rank)"
        if row[1:nf] != fields[1:]:
            return (
                f"all_to_all: rank {q} has (row numel, dtype code) {row[1:nf]}, "
                f"rank {rank} has {fields[1:]}"
            )
        if row[nf] != expect[q][1] or row[nf + 1] != expect[q][0]:
            return (
                f"all_to_all: rank {q} sends {row[nf]} rows to rank {rank}, which expects "
                f"{expect[q][1]}; rank {rank} sends {expect[q][0]} rows, rank {q} expects "
                f"{row[nf + 1]}"
            )
    return None


def _agree_ok(
    rank: int, p: int, problem: str | None, group: ProcessGroup | None, device: torch.device
) -> None:
    """Everyone learns whether anyone found a problem; raise the same kind of error on all."""
    flags = torch.zeros(p, dtype=torch.int64, device=device)
    flags[rank] = int(problem is not None)
    others = [q for q in range(p) if q != rank]
    recv, send = post(
        [(flags[rank], global_rank(group, q)) for q in others],
        [(flags[q : q + 1].view(()), global_rank(group, q)) for q in others],
        group,
    )
    for work in recv + send:
        work.wait()
    if problem is not None:
        raise ValueError(problem)
    bad = flags.nonzero().flatten().tolist()
    if bad:
        raise ValueError(
            f"all_to_all: rank {bad[0]} found the split sizes inconsistent (see its error)"
        )


@profiled("all_to_all")
def all_to_all(
    output: torch.Tensor,
    input: torch.Tensor,
    output_splits: list[int],
    input_splits: list[int],
    group: ProcessGroup | None = None,
    *,
    check: bool = True,
) -> torch.Tensor:
    """``output`` <- the rows every rank sends this one (module docstring); returns ``output``.

    Messages: one batch of at most ``2(p-1)`` point-to-point operations (zero-row pieces are
    skipped on both ends). Sizes are rows along dim 0; trailing dims must match on every rank.
    """
    rank, p = group_rank_and_size(group)
    input_splits, output_splits = [int(s) for s in input_splits], [int(s) for s in output_splits]
    problem = all_to_all_problem(output, input, output_splits, input_splits, p)
    if check:  # every rank takes both rounds, whatever it found, so none waits alone
        dtype_code = DTYPE_CODES.index(input.dtype) if input.dtype in DTYPE_CODES else -1
        fields = [int(problem is not None), math.prod(input.shape[1:]), dtype_code]
        pairs = list(zip(input_splits, output_splits)) if problem is None else [(0, 0)] * p
        pair_problem = _pairwise(rank, p, fields, pairs, group, input.device)
        _agree_ok(rank, p, problem or pair_problem, group, input.device)
    elif problem is not None:
        raise ValueError(problem)
    ins = input.split(input_splits)  # p views, rows for each rank
    outs = output.split(output_splits)  # p views: receiving into them fills output
    others = [q for q in range(p) if q != rank]
    with guarded("all_to_all", group, input.device, check) as g:
        recv, send = post(
            [(ins[q], global_rank(group, q)) for q in others],
            [(outs[q], global_rank(group, q)) for q in others],
            group,
        )
        g.run(_own_piece, outs[rank], ins[rank])  # copied while the messages travel
        for work in recv + send:
            work.wait()
    return output


def _own_piece(out: torch.Tensor, inp: torch.Tensor) -> None:
    """The rows this rank sends itself: a local copy (the compute step of an all-to-all)."""
    out.copy_(inp)
