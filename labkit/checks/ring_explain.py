"""Explaining a wrong ring (exercise 02), for ``checks/collectives.py``, which runs it.

Split from the check so that each reads as one job: that module runs the learner's ring and
records its messages; this one turns what came back into a sentence.

Labelled data: rank r's value at flat index i is ``16 * i + 2**r`` (float32, exact for the
sizes used). Every partial sum then spells out where it came from: ``value % 16`` is the
bitmask of the ranks it contains, and ``value // 16 / popcount`` the index it was taken from.
So the check can say "rank 1's chunk 1 lacks rank 0's data" or "holds index 5 (chunk 2)
where index 3 belongs", and show, step by step, which chunk a rank sent, with whose data, next
to what the ring sends at that step: at reduce-scatter step s rank r sends the partial of
chunk ``r-s-1`` holding ranks ``r, r-1, ..., r-s``; at all-gather step s, chunk ``r-s``.
"""

from __future__ import annotations

from typing import Any

import torch

from labkit.checks.core import compare
from labkit.collectives.common import chunk_offsets, chunk_sizes

__all__ = ["explain_labelled", "labels", "message_problem"]


def labels(n: int, rank: int) -> torch.Tensor:
    return 16 * torch.arange(n, dtype=torch.float32) + 2**rank


def _who(value: float, p: int) -> str:
    """Read a labelled value: which ranks' data, from which flat index."""
    if value != value:  # NaN: nothing was ever written there
        return "nothing (the slot was never written)"
    v = int(value)
    mask = v % 16
    ranks = [r for r in range(p) if mask >> r & 1]
    index = v // 16 / max(1, len(ranks))
    if index != int(index):
        return (
            f"data of ranks {ranks}, but not all from the same index (they average {index:.2f}): "
            "chunks got mixed"
        )
    return f"data of ranks {ranks} from index {int(index)}"


def _chunk_of(i: int, n: int, p: int) -> int:
    off = chunk_offsets(n, p)
    return max(c for c in range(p) if off[c] <= i)


def _steps(phase: str, rank: int, sends: list[tuple[int, torch.Tensor]], n: int, p: int) -> str:
    """Each message ``rank`` sent, decoded, next to what the ring sends at that step."""
    off = chunk_offsets(n, p)
    lines = []
    for step, (dst, data) in enumerate(sends):
        if phase == "reduce-scatter":  # the partial of chunk r-s-1, grown by one rank per step
            want_c, want_ranks = (
                (rank - step - 1) % p,
                sorted((rank - k) % p for k in range(step + 1)),
            )
        else:  # all-gather forwards finished chunks
            want_c, want_ranks = (rank - step) % p, [(rank - step) % p]
        got = _who(float(data[0]), p) if data.numel() else "an empty tensor"
        first = off[want_c]
        want_first = sum(16 * first + 2**r for r in want_ranks) if off[want_c + 1] > first else None
        differs = (float(data[0]) if data.numel() else None) != want_first
        lines.append(
            f"    {phase} step {step}: rank {rank} sent to rank {dst}: {got}; the ring sends "
            f"chunk {want_c} "
            f"(index {first}..) holding data of ranks {want_ranks}"
            + ("   <-- differs" if differs else "")
        )
    if len(sends) != p - 1:
        lines.append(
            f"    rank {rank} sent {len(sends)} messages; a ring sends world_size - 1 = {p - 1} "
            "per phase"
        )
    return "\n".join(lines)


def explain_labelled(results: list[dict[str, Any]], p: int) -> str | None:
    for i in range(len(results[0]["labelled"])):
        for rank, res in enumerate(results):
            n, shard, sends, _, _ = res["labelled"][i]
            lo, hi = chunk_offsets(n, p)[rank : rank + 2]
            expected = torch.stack([labels(n, r) for r in range(p)]).sum(0)[lo:hi]
            problem = compare(
                expected,
                shard,
                what=f"reduce_scatter, {n} elements, rank {rank}'s shard (chunk {rank})",
            )
            if problem:
                detail = ""
                if shard.shape == expected.shape:
                    j = int(((shard - expected).abs() > 0).logical_or(shard.isnan()).nonzero()[0])
                    detail = (
                        f"\n  Element {j} of the shard is index {lo + j} of chunk {rank}: it "
                        "should hold the data of "
                        f"ranks {list(range(p))} from index {lo + j}; it holds "
                        f"{_who(float(shard[j]), p)}."
                    )
                steps = _steps("reduce-scatter", rank, sends, n, p)
                return f"{problem}.{detail}\n  Messages rank {rank} sent (labels decoded):\n{steps}"
        for rank, res in enumerate(results):
            n, _, _, full, _ = res["labelled"][i]
            expected = torch.cat(
                [
                    labels(n, r)[chunk_offsets(n, p)[r] : chunk_offsets(n, p)[r + 1]]
                    for r in range(p)
                ]
            )
            problem = compare(
                expected, full, what=f"all_gather, {n} elements, rank {rank}'s output"
            )
            if problem:
                detail = ""
                if full.shape == expected.shape:
                    j = int(((full - expected).abs() > 0).logical_or(full.isnan()).nonzero()[0])
                    c = _chunk_of(j, n, p)
                    detail = (
                        f"\n  Index {j} lies in chunk {c}, which rank {c} owns; it holds "
                        f"{_who(float(full[j]), p)}, not rank {c}'s data from index {j}."
                    )
                _, _, _, _, ag_sends = results[(rank - 1) % p]["labelled"][i]
                left = (rank - 1) % p
                steps = _steps("all-gather", left, ag_sends, n, p)
                who = f"Messages rank {left} (its left neighbour) sent"
                return f"{problem}.{detail}\n  {who}:\n{steps}"
    return None


def message_problem(results: list[dict[str, Any]], p: int) -> str | None:
    """Exactly p - 1 messages per phase per rank, none longer than a chunk (non-empty chunks)."""
    for i, (n, *_) in enumerate(results[0]["labelled"]):
        if min(chunk_sizes(n, p)) == 0:
            continue  # empty chunks: a ring may skip sending them
        longest = max(chunk_sizes(n, p))
        for rank, res in enumerate(results):
            _, _, rs_sends, _, ag_sends = res["labelled"][i]
            for phase, sends in (("reduce-scatter", rs_sends), ("all-gather", ag_sends)):
                sizes = [data.numel() for _, data in sends]
                if not sizes:  # calls imported before the check started are not seen: no verdict
                    continue
                if len(sizes) != p - 1 or max(sizes) > longest:
                    return (
                        f"{phase} of {n} elements on {p} ranks: rank {rank} sent {len(sizes)} "
                        f"messages of {sizes} elements; a ring sends world_size - 1 = {p - 1} "
                        f"messages per phase, each one chunk ({chunk_sizes(n, p)} elements). "
                        "The sum is right, but this is not a ring: every rank sending whole "
                        "tensors moves p/2 times more bytes"
                    )
    return None
