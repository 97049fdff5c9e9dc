"""The whole-run budget (labkit.planner.budget): 6ND by hand, Chinchilla's tokens, days,
GPU-hours and cost, and Young/Daly's checkpoint interval. Pure arithmetic."""

from __future__ import annotations

import math

import pytest

from labkit.planner.budget import (
    Failures,
    chinchilla_tokens,
    failure_overhead,
    run_budget,
    training_flops,
    young_daly_interval,
)


def test_six_n_d_and_recompute_by_hand() -> None:
    # 1B parameters, 20B tokens: 6 x 1e9 x 2e10 = 1.2e20 FLOPs
    assert training_flops(1e9, 2e10) == {"model": 1.2e20, "recompute": 0.0, "total": 1.2e20}
    # full recompute: one more forward, 2ND (8ND in all, Narayanan et al.'s 96/72 without the
    # attention term); with the shape, the scores' 4 s h L per token come on top
    assert training_flops(1e9, 2e10, "full")["total"] == 1.6e20
    shaped = training_flops(1e9, 2e10, "full", layers=24, hidden=2048, seq=2048)
    assert shaped["recompute"] == 2e9 * 2e10 + 4 * 2048 * 2048 * 24 * 2e10
    sel = training_flops(1e9, 2e10, "selective", layers=24, hidden=2048, seq=2048)
    assert sel["recompute"] == 4 * 2048 * 2048 * 24 * 2e10
    with pytest.raises(ValueError, match="selective recompute reruns the attention scores"):
        training_flops(1e9, 2e10, "selective")
    with pytest.raises(ValueError, match="recompute='some'"):
        training_flops(1e9, 2e10, "some")


def test_chinchilla_tokens_and_the_budget_by_hand() -> None:
    assert chinchilla_tokens(100e9) == 2e12  # 20 tokens per parameter
    # 86,400 steps of 1M tokens at 10 s a step: 10 days; 64 GPUs: 15,360 GPU-hours; $2/hour
    b = run_budget(params=4.32e9, gpus=64, step_seconds=10.0, tokens_per_step=1e6,
                   price_per_gpu_hour=2.0)  # fmt: skip
    assert b.tokens == 20 * 4.32e9 == 8.64e10 and b.steps == 86_400
    assert b.days == pytest.approx(10.0) and b.gpu_hours == pytest.approx(15_360)
    assert b.cost == pytest.approx(30_720)
    assert b.failure_overhead == 0 and b.system_mtbf == math.inf
    # the achieved model FLOP/s per GPU the budget implies: 6ND over the run and GPUs
    assert b.achieved_flops_per_gpu == pytest.approx(6 * 4.32e9 * 8.64e10 / (864_000 * 64))
    given = run_budget(params=4.32e9, gpus=64, step_seconds=10.0, tokens_per_step=1e6,
                       price_per_gpu_hour=2.0, tokens=4.32e10)  # fmt: skip
    assert given.days == pytest.approx(5.0)
    with pytest.raises(ValueError, match="gpus >= 1.*got 0"):
        run_budget(params=1e9, gpus=0, step_seconds=1, tokens_per_step=1, price_per_gpu_hour=1)


def test_young_daly_interval_minimises_the_failure_overhead() -> None:
    save, mtbf, restart = 60.0, 3600.0 * 5, 300.0
    tau = young_daly_interval(save, mtbf)
    assert tau == pytest.approx(math.sqrt(2 * 60 * 18_000))  # 1,470 s
    best = failure_overhead(tau, save, mtbf, restart)
    assert best == pytest.approx(math.sqrt(2 * save / mtbf) + restart / mtbf)  # by hand
    # negative control: checkpointing 4x more or less often costs more
    for other in (tau / 4, tau * 4):
        assert failure_overhead(other, save, mtbf, restart) > best * 1.2
    # no save cost: checkpoint as often as you like, only the restart is lost
    assert failure_overhead(1.0, 0.0, mtbf) == pytest.approx(0.5 / mtbf)
    with pytest.raises(ValueError, match="not below the MTBF"):
        failure_overhead(mtbf, save, mtbf)


def test_failures_scale_with_the_part_count_and_lengthen_the_run() -> None:
    # a GPU fails every 50,000 h: 1,024 GPUs fail every 48.8 h; per node of 8, 8x less often
    gpu = Failures(mtbf_hours=50_000, per="gpu", save_seconds=60, restart_seconds=600)
    node = Failures(mtbf_hours=50_000, per="node", gpus_per_node=8)
    assert gpu.system_mtbf(1024) == pytest.approx(50_000 * 3600 / 1024)
    assert node.system_mtbf(1024) == pytest.approx(8 * gpu.system_mtbf(1024))
    kw = dict(params=100e9, gpus=1024, step_seconds=20.0, tokens_per_step=4e6,
              price_per_gpu_hour=2.0)  # fmt: skip
    clean = run_budget(**kw)  # type: ignore[arg-type]
    hit = run_budget(**kw, failures=gpu)  # type: ignore[arg-type]
    m = gpu.system_mtbf(1024)
    assert hit.checkpoint_interval == pytest.approx(math.sqrt(2 * 60 * m))
    want = 60 / hit.checkpoint_interval + (hit.checkpoint_interval / 2 + 600) / m
    assert hit.failure_overhead == pytest.approx(want)
    assert hit.days == pytest.approx(clean.days * (1 + want)) and hit.cost > clean.cost
    fixed = run_budget(**kw, failures=Failures(50_000, interval_seconds=600.0))  # type: ignore[arg-type]
    assert fixed.checkpoint_interval == 600 and fixed.failure_overhead > hit.failure_overhead
    with pytest.raises(ValueError, match="per='rack'"):
        Failures(1.0, per="rack").system_mtbf(8)
