"""Where a model's blocks go: the layer count of each (virtual) pipeline stage. Pure arithmetic.

``S = p * v`` virtual stages hold consecutive blocks: stage ``s`` holds blocks
``[sum(counts[:s]), sum(counts[:s + 1]))``, so every block lands in exactly one stage.

* An explicit cut (``layers_per_stage``, one count per virtual stage) is used as given once
  it checks out: ``S`` integers summing to ``n_layer``; the first and the last stage may hold
  0 blocks (they still run the embedding, or the final LayerNorm and the head: Megatron's
  ``account_for_embedding/loss_in_pipeline_split``), a middle stage at least 1 (with none it
  would only pass its input on, for a transfer's price).
* The default spread, ``q, r = divmod(n_layer, S)``: every stage gets ``q`` blocks, and the
  ``r`` extra blocks go to the MIDDLE stages ``1, 2, ..., r`` first, because the end stages
  carry more than blocks (the first the embedding and the deepest 1F1B stash, the last the
  logits, ``6 b s h V`` FLOPs a micro-batch: several blocks' worth for a large vocabulary).
  Only when ``r = S - 1`` (one more extra than middle stages) does one extra go to an end:
  to stage 0, whose embedding lookup costs no FLOPs, rather than to the head's stage.
  Examples: 5 on 2 -> [3, 2]; 5 on 3 -> [2, 2, 1]; 6 on 4 -> [1, 2, 2, 1]; 10 on 4 ->
  [2, 3, 3, 2]. Divisible counts give the even cut ``[L / S] * S``, as before.

:func:`stage_work` turns a cut into each stage's cost in blocks (plus an allowance for the
embedding and the head), what the pipeline simulator and the planner charge.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["check_cut", "layer_counts", "stage_ranges", "stage_work"]


def check_cut(n_layer: int, num_stages: int, layers_per_stage: Sequence[int]) -> None:
    """Raise ``ValueError`` naming the values unless ``layers_per_stage`` cuts ``n_layer``
    blocks into ``num_stages`` stages (module docstring: only the end stages may be empty)."""
    cut = list(layers_per_stage)
    if any(not isinstance(k, int) or isinstance(k, bool) for k in cut):
        raise ValueError(f"layers per stage {cut!r} must be integers")
    if len(cut) != num_stages:
        raise ValueError(
            f"layers per stage {cut} has {len(cut)} entries for {num_stages} (virtual) pipeline "
            "stages: give one count per stage (p x v when interleaved)"
        )
    if any(k < 0 for k in cut):
        raise ValueError(f"layers per stage {cut}: a stage cannot hold a negative count")
    empty = [s for s in range(1, num_stages - 1) if cut[s] == 0]
    if empty:
        raise ValueError(
            f"layers per stage {cut}: middle stage(s) {empty} hold no block; only the first "
            "and the last stage (embedding, head) may hold 0"
        )
    if sum(cut) != n_layer:
        raise ValueError(f"layers per stage {cut} sum to {sum(cut)}, but n_layer={n_layer}")


def layer_counts(
    n_layer: int, num_stages: int, layers_per_stage: Sequence[int] | None = None
) -> list[int]:
    """Blocks of each virtual stage: ``layers_per_stage`` checked, or the default spread."""
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages={num_stages!r} must be an integer >= 1")
    if layers_per_stage is not None:
        check_cut(n_layer, num_stages, layers_per_stage)
        return list(layers_per_stage)
    if num_stages > n_layer:
        raise ValueError(
            f"{num_stages} pipeline stages but only n_layer={n_layer} layers: every stage needs "
            "at least one layer (an explicit cut may leave the first or last stage empty)"
        )
    q, r = divmod(n_layer, num_stages)
    counts = [q] * num_stages
    middle = list(range(1, num_stages - 1))
    for s in (middle + [0])[:r]:  # r <= S - 1 = len(middle) + 1
        counts[s] += 1
    return counts


def stage_ranges(
    n_layer: int, num_stages: int, layers_per_stage: Sequence[int] | None = None
) -> list[range]:
    """Block indices of each virtual stage: consecutive slices of :func:`layer_counts`."""
    out, start = [], 0
    for k in layer_counts(n_layer, num_stages, layers_per_stage):
        out.append(range(start, start + k))
        start += k
    return out


def stage_work(
    n_layer: int,
    num_stages: int,
    layers_per_stage: Sequence[int] | None = None,
    *,
    embedding: float = 0.0,
    head: float = 0.0,
) -> tuple[float, ...]:
    """Each virtual stage's cost in blocks: its block count, plus ``embedding`` on stage 0
    and ``head`` on the last stage (both in blocks' worth, e.g. the logits' FLOPs over one
    block's). What :class:`labkit.pipeline.simulator.Costs` takes as ``stages``."""
    work = [float(k) for k in layer_counts(n_layer, num_stages, layers_per_stage)]
    work[0] += embedding
    work[-1] += head
    return tuple(work)
