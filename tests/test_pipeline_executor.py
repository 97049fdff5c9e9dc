"""The pipeline executor on real gloo ranks against single-process gradient accumulation.

One launch per world size (pp = 2 and 4) runs every schedule (GPipe, 1F1B, interleaved with
v = 2, ZB-H1) at m = 4 and 8 for 2 SGD-momentum steps, with tied embeddings (first and last
stage on different ranks: Megatron's embedding group) and a frozen parameter (wpe). Each
rank's losses, first-step gradients and parameters after every step must equal the reference's; the
measured peak stash must equal the simulator's; the measured timeline must hold every compute
action of the rank's list, in order, without overlap. ZB-H1 runs the real B/W split
(``weight_grad.py``). On 4 ranks the same launch also runs two 2-stage pipelines on the
subgroups of a (pp=2, dp=2) layout, the way a 3D composition calls the executor.

Uneven cuts ride the 2-rank launch: 5 blocks on 2 stages (the default spread [3, 2]; the
interleaved default [1, 2, 1, 1] over 4 virtual stages; explicit cuts with an empty first
stage, [0, 5], and an empty last one, [5, 0], under ZB-H1's B/W split) each equal the
reference; the 4-rank launch also trains 3 blocks cut [1, 2] through the 3D composition
(tp=2 x pp=2, ``ThreeDConfig.stage_layers``).
"""

from __future__ import annotations

import pytest
import torch

from labkit.pipeline import make_schedule, simulate
from labkit.pipeline.equivalence import (
    case_for,
    check_cases,
    run_cases,
    spec_case,
    train_pipeline,
    train_reference,
)
from tests.ranks import run_ranks

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)]
# (schedule, m, v, n_layer, blocks per virtual stage or None for the default spread)
UNEVEN = [
    ("1f1b", 4, 1, 5, None),
    ("interleaved", 4, 2, 5, None),
    ("gpipe", 4, 1, 5, (0, 5)),
    ("zb-h1", 4, 1, 5, (5, 0)),
]
THREED_CUT = (1, 2)  # 3 blocks on 2 pipeline stages, through labkit.parallel.threed


def _threed_cfg():  # noqa: ANN202
    from labkit.labs.threed import TINY, LabConfig
    from labkit.parallel import ParallelDegrees
    from labkit.parallel.threed import ThreeDConfig

    three = ThreeDConfig(ParallelDegrees(dp=1, tp=2, pp=2), 2, stage_layers=THREED_CUT)
    return LabConfig(model=TINY.with_(n_layer=sum(THREED_CUT)), threed=three, steps=2)


def _work(cases: list[tuple], p: int) -> tuple[list[dict], dict | None, dict | None]:
    """Every case on the whole world as one pipeline; on 4 ranks, also pp = 2 inside a
    (pp=2, dp=2) layout: two pipelines on subgroups ([0, 2] and [1, 3]), peers and the
    embedding groups mapped to global ranks (how a 3D composition calls the executor)."""
    import torch.distributed as dist

    from labkit.parallel import ParallelDegrees, build_layout, rank_grid
    from labkit.pipeline.executor import embedding_groups

    out = run_cases(cases, p)
    if p != 4:
        return out, None, None
    degrees = ParallelDegrees(dp=2, pp=2)
    layout = build_layout(degrees)
    emb = embedding_groups(rank_grid(degrees)["pp"])
    sub = train_pipeline(make_schedule("1f1b", 2, 4), case_for(2, 4), layout.pp_group, emb=emb)
    sub["pp_rank"] = dist.get_rank(layout.pp_group)
    if emb is not None:
        dist.destroy_process_group(emb)
    from labkit.labs.threed import train

    return out, sub, train(_threed_cfg())


def _compare(p: int, results: list[list[dict]], cases: list[tuple]) -> None:
    refs = {c: train_reference(c) for c in {spec_case(spec, p) for spec in cases}}
    for k, spec in enumerate(cases):
        name, m, v = spec[:3]
        case = spec_case(spec, p)
        what = f"{name} p={p} m={m} v={v} n_layer={case.cfg.n_layer} cut={case.stage_layers}"
        ref = refs[case]
        sched = make_schedule(name, p, m, v)
        sim = simulate(sched)
        last = (p * v - 1) % p
        got_losses = results[last][k]["losses"]
        assert got_losses == pytest.approx(ref["losses"], rel=1e-5, abs=1e-6), what
        seen = set()
        for r in range(p):
            res = results[r][k]
            snapshots = [("grads", res["grads"], ref["grads"])]
            snapshots += [
                (f"params after step {i + 1}", g, w)
                for i, (g, w) in enumerate(zip(res["params"], ref["params"]))
            ]
            for kind, got_named, want_named in snapshots:
                for pname, got in got_named.items():
                    rname = "wte.weight" if pname == "head.weight" else pname  # tied copy
                    want = want_named[rname]
                    if want is None:
                        assert got is None, f"{what}: rank {r} {pname} has a gradient but is frozen"
                        continue
                    torch.testing.assert_close(
                        got, want, atol=2e-6, rtol=1e-4, msg=f"{what}: rank {r} {kind} {pname}"
                    )
                    seen.add(rname)
            assert res["peak_stash"] == sim.peak_stash[r], (
                f"{what}: rank {r} measured vs simulated stash"
            )
            measured = [a for a, _, _ in res["timeline"] if a.is_compute]
            assert measured == sched.compute(r), what
            spans = sorted((s, e) for a, s, e in res["timeline"] if a.is_compute)
            assert all(e0 <= s1 for (_, e0), (s1, _) in zip(spans, spans[1:])), what
        assert seen == set(ref["params"][-1]), f"{what}: parameters nobody holds"


@pytest.mark.parametrize("p", [2, 4])
def test_every_schedule_matches_gradient_accumulation(p):
    cases: list[tuple] = [(name, m, v) for name, v in SCHEDULES for m in (4, 8)]
    if p == 2:
        cases += UNEVEN
    check_cases(cases, p)
    both = run_ranks(_work, cases, p, world_size=p, timeout=240)
    _compare(p, [b[0] for b in both], cases)
    if p == 4:
        _check_threed([b[2] for b in both])
    if p == 4:  # two pipelines of 2 stages on subgroups: each equals the reference
        ref = train_reference(case_for(2, 4))
        for r, (_, sub, _) in enumerate(both):
            if sub["pp_rank"] == 1:
                assert sub["losses"] == pytest.approx(ref["losses"], rel=1e-5), f"rank {r}"
            for name, got in sub["params"][-1].items():
                want = ref["params"][-1]["wte.weight" if name == "head.weight" else name]
                torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-4, msg=f"rank {r} {name}")


def test_bad_input_is_refused_before_any_process_starts():
    with pytest.raises(ValueError, match=r"8 pipeline stages \(p=2 x v=4\) but only n_layer=4"):
        check_cases([("interleaved", 8, 4)], 2)
    with pytest.raises(ValueError, match="m=2, p=4"):
        check_cases([("interleaved", 2, 2)], 4)


def _check_threed(per_rank: list[dict]) -> None:
    """3 blocks cut [1, 2] on tp=2 x pp=2: every full parameter and loss equal one process."""
    from labkit.labs.threed import reference

    cfg = _threed_cfg()
    ref = reference(cfg)
    covered = set()
    for r in per_rank:
        for name, got in r["params"].items():
            want = ref["params"]["wte.weight" if name == "head.weight" else name]
            torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5, msg=f"3D {name}")
            covered.add(name)
        if r["losses"][0] is not None:
            assert r["losses"] == pytest.approx(ref["losses"], abs=2e-5)
    assert covered >= set(ref["params"]), f"3D: stages miss {set(ref['params']) - covered}"


def test_uneven_cut_bad_input_is_refused_before_any_process_starts():
    from labkit.labs.threed import TINY
    from labkit.parallel import ParallelDegrees
    from labkit.parallel.threed import ThreeDConfig, check_threed

    with pytest.raises(ValueError, match=r"layers per stage \[3, 3\] sum to 6, but n_layer=5"):
        check_cases([("1f1b", 4, 1, 5, (3, 3))], 2)
    three = ThreeDConfig(ParallelDegrees(dp=1, tp=2, pp=2), 2, stage_layers=(3, 2))
    with pytest.raises(ValueError, match=r"layers per stage \[3, 2\] sum to 5, but n_layer=4"):
        check_threed(TINY, three, 4)
    check_threed(TINY.with_(n_layer=5), ThreeDConfig(ParallelDegrees(1, 2, 2), 2), 4)  # spread
