"""The planner's tp term under overlapped SP (``labkit.planner.tp_overlap``): pure arithmetic.

Per collective of C seconds decomposed into t - 1 ring steps, each under a 1/t chunk of its
GEMM of g seconds, the exposed time is ``(t - 1) max(0, C/(t - 1) - g/t)``: one chunk of GEMM
never hides anything. Checked on hand-made numbers, then on whole predictions: the decomposed
term lies between no overlap and the older bound (everything hidden up to all the GEMMs), and
the bound is the negative control: where it hides everything, the decomposition cannot.
"""

from __future__ import annotations

import pytest

from labkit.interview.scenarios import GPT_100B_3D
from labkit.models.gpt import preset
from labkit.planner import CLUSTERS, Candidate, predict
from labkit.planner.tp_overlap import decomposed_exposed, decomposed_tp_comm


def test_each_step_hides_under_one_chunk_and_one_chunk_hides_nothing() -> None:
    assert decomposed_exposed(3.0, 2.0, 4) == pytest.approx(3 * (1.0 - 0.5))  # slow link
    assert decomposed_exposed(0.5, 2.0, 4) == 0.0  # fast link: every step under its chunk
    assert decomposed_exposed(3.0, 2.0, 1) == 0.0  # no tp, nothing to hide
    # equal comm and GEMM: the whole-GEMM bound hides all of it, the decomposition cannot
    bound = max(0.0, 1.0 - 1.0)
    assert bound == 0.0 and decomposed_exposed(1.0, 1.0, 4) == pytest.approx(0.25)
    for t in (2, 4, 8):
        for comm, gemm in ((1.0, 3.0), (2.0, 1.0), (5.0, 5.0)):
            assert decomposed_exposed(comm, gemm, t) == pytest.approx(
                max(0.0, comm - (t - 1) / t * gemm)
            )
    with pytest.raises(ValueError, match="comm=-1"):
        decomposed_exposed(-1.0, 1.0, 2)


def test_overlapped_tp_needs_sequence_parallelism() -> None:
    cand = Candidate(dp=1, tp=8, pp=1, micro_batch=4, zero=1, recompute="selective", sp=False)
    cl = CLUSTERS["dgx-a100-80gb"].with_nodes(1)
    with pytest.raises(ValueError, match="tp=8 needs sp=True"):
        decomposed_tp_comm(1.0, 24, 2048, 2048, cl, cand, 4)
    with pytest.raises(ValueError, match="tp_overlap='yes'"):
        predict(preset("gpt2-1.3b"), cl, 512, cand, tp_overlap="yes")


@pytest.mark.parametrize("model", ["1.3b", "100b"])
def test_decomposed_lies_between_no_overlap_and_the_bound(model: str) -> None:
    if model == "1.3b":
        cfg, batch, cl = preset("gpt2-1.3b"), 512, CLUSTERS["dgx-h100-80gb"].with_nodes(1)
        cand = Candidate(dp=1, tp=8, pp=1, micro_batch=4, zero=1, recompute="selective", sp=True)
    else:
        cfg, batch = GPT_100B_3D.cfg, GPT_100B_3D.global_batch
        cl = CLUSTERS["dgx-a100-80gb"].with_nodes(8)
        cand = Candidate(dp=2, tp=8, pp=4, micro_batch=1, zero=1, recompute="full", sp=True)
    none, dec, bound = (
        predict(cfg, cl, batch, cand, tp_overlap=o) for o in (False, "decomposed", True)
    )
    assert none.time["tp_comm"] > dec.time["tp_comm"] >= bound.time["tp_comm"]
    others = {k: v for k, v in none.time.items() if k != "tp_comm"}
    assert {k: v for k, v in dec.time.items() if k != "tp_comm"} == others  # only tp changes


def test_plan_decomposes_only_where_sequence_parallelism_is_on() -> None:
    from labkit.planner import plan

    cfg, cl = preset("gpt2-1.3b"), CLUSTERS["dgx-h100-80gb"].with_nodes(1)
    plain = {p.candidate: p for p in plan(cfg, cl, 64, sp=(False, True))}
    assert any(c.sp and c.tp > 1 for c in plain) and any(not c.sp and c.tp > 1 for c in plain)
    for p in plan(cfg, cl, 64, sp=(False, True), tp_overlap="decomposed"):
        base = plain[p.candidate].time["tp_comm"]
        if p.candidate.sp and p.candidate.tp > 1:
            assert p.time["tp_comm"] < base
        else:
            assert p.time["tp_comm"] == base
