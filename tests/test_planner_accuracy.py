"""The planner at the configurations really measured (issue 37): Table 1 at each run's own
settings, Korthikanti's Table 5 at Table 3's, Figures 12-16 in the measured order, ZeRO-3 /
FSDP at scale. Pure arithmetic, no processes. Bars not met are strict xfails naming why."""

from __future__ import annotations

import pytest

from labkit.hardware import value
from labkit.memory.model import MIXED_ADAM
from labkit.planner.accuracy import (
    korthikanti_at_settings,
    revealed_budget,
    sensitivity,
    stack_gap,
    table1_rows,
    table1_summary,
)
from labkit.planner.cluster import CLUSTERS
from labkit.planner.figures import FIGURES, _holds, figure_orders
from labkit.planner.flops import MEGATRON_TABLE1
from labkit.planner.memory import MEGATRON_MIXED
from labkit.planner.plan import Candidate, predict
from labkit.planner.published import KORTHIKANTI_MICRO_BATCH
from labkit.planner.roofline import chip_for, stream_time
from labkit.planner.sc21 import (
    GRAD_ACCUM_STREAMS,
    MEGATRON_2021_PRECISION,
    TABLE1_SETTINGS,
    sc21_model,
    table1_prediction,
    tflops,
)
from labkit.planner.zero3 import BF16_FSDP, zero3_schedule
from labkit.planner.zero3_runs import ZERO3_RUNS, zero3_rows, zero3_scaling, zero3_step


@pytest.fixture(scope="module")
def rows() -> list[dict[str, object]]:
    return table1_rows()


def test_table1_settings_are_the_reproduction_scripts() -> None:
    # run_table_1.sh: --num-layers-per-virtual-pipeline-stage 5, 5, 3, 1 at 76B, 145B, 310B,
    # 530B; MBS 16 16 16 8 4 2 2 1 1 1; DDP torch in the four smallest rows
    per_virtual = {5: 5, 6: 5, 7: 3, 8: 1}
    assert [s.micro_batch for s in TABLE1_SETTINGS] == [16, 16, 16, 8, 4, 2, 2, 1, 1, 1]
    assert [s.ddp for s in TABLE1_SETTINGS] == ["torch"] * 4 + ["local"] * 6
    for i, (row, st) in enumerate(zip(MEGATRON_TABLE1, TABLE1_SETTINGS, strict=True)):
        v = row.layers // (row.pp * per_virtual[i]) if i in per_virtual else 1
        assert st.virtual == v, row.params_billion
        m = row.batch // (row.gpus // (row.tp * row.pp) * st.micro_batch)
        assert m * (row.gpus // (row.tp * row.pp)) * st.micro_batch == row.batch
        assert st.virtual == 1 or m % row.pp == 0  # interleaving needs m divisible by p
    assert MEGATRON_2021_PRECISION.wire_bytes == 2  # --fp16, no fp32 accumulate/all-reduce


def test_every_table1_row_within_ten_percent_and_mean_absolute_within_five(rows) -> None:
    s = table1_summary(rows)
    assert s["within 10%"] == 10, rows
    assert s["mean abs"] <= 0.05, s
    assert table1_summary() == pytest.approx(s, abs=1e-4)  # the rows' rounding only


@pytest.mark.xfail(strict=True, reason="the rows stay optimistic, +4.9% on average: the same "
                   "constants price Korthikanti's 2022 runs of the same models and layouts 4-8% "
                   "slow (stack_gap); see docs/planner.md")  # fmt: skip
def test_table1_mean_signed_error_within_three_percent(rows) -> None:
    assert abs(table1_summary(rows)["mean signed"]) <= 0.03


def test_without_what_the_2021_code_did_the_rows_miss() -> None:
    # negative control: the same settings priced with fp32 gradients on the wire, NVLink at
    # the data sheet and no accumulation hook miss the bars the modelled run meets
    errs = []
    for i, (row, st) in enumerate(zip(MEGATRON_TABLE1, TABLE1_SETTINGS, strict=True)):
        cfg = sc21_model(row.layers, row.hidden, row.heads)
        cand = Candidate(row.gpus // (row.tp * row.pp), row.tp, row.pp, st.micro_batch,
                         virtual=st.virtual)  # fmt: skip
        pred = predict(cfg, CLUSTERS["dgx-a100-80gb"].with_nodes(row.gpus // 8), row.batch,
                       cand, precision=MEGATRON_MIXED, dp_overlap=st.ddp == "torch")  # fmt: skip
        errs.append(tflops(i, pred) / row.tflops_per_gpu - 1)
    assert max(errs) > 0.10 and sum(errs) / len(errs) > 0.08, errs


def test_the_2021_terms_by_hand() -> None:
    i = 9  # 1T: t=8 p=64, 512 micro-batches of 1
    row, pred = MEGATRON_TABLE1[i], table1_prediction(i)
    cluster = CLUSTERS["dgx-a100-80gb"]
    chip = chip_for(cluster.name, cluster.peak_flops, cluster.mem_bandwidth)
    h = row.hidden
    params = (row.layers // row.pp * (12 * h * h + 13 * h) + 51200 * h) / row.tp
    assert pred.time["grad_accum"] == pytest.approx(
        512 * stream_time(chip, GRAD_ACCUM_STREAMS * 2 * params)
    )
    act = 2 * 2048 * h  # one 16-bit message, re-gathered over t=8 on NVLink (busbw)
    one = 7 * 5e-6 + 7 / 8 * act / value("a100.nccl_allreduce_busbw")
    assert pred.time["pp_gather"] == pytest.approx(2 * 512 * one, rel=0.01)
    small = table1_prediction(0)  # t = p = 1: nothing to re-gather
    assert "pp_gather" not in small.time and small.time["grad_accum"] > 0


def test_ranks_and_the_revealed_budget(rows) -> None:
    firsts = [r for r in rows if r["rank"] == 1]
    assert all(r["gap"] == 0 for r in firsts) and all(float(str(r["gap"])) >= 0 for r in rows)
    b = revealed_budget()
    fullest = max(table1_prediction(i).memory_total for i in range(10))
    assert b["budget GB"] == round(fullest / 1e9, 1)
    assert b["whole configuration first"] <= b["(t, p) first"] <= 10
    assert b["(t, p) first"] >= sum(r["rank"] == 1 for r in rows)


def test_sensitivity_to_the_unmeasured_constants() -> None:
    sens = sensitivity()
    assert all(float(str(r["a100 gemm_max -10%"])) < -0.05 for r in sens)  # slower GEMMs
    assert all(float(str(r["a100 mem_eff -10%"])) < 0 for r in sens)
    assert sens[0]["NVLink busbw -10%"] == 0  # 1.7B: t = 1, no NVLink traffic
    assert all(float(str(r["NVLink busbw -10%"])) < 0 for r in sens[1:])


def test_the_same_runs_on_the_2022_stack_ran_faster_than_the_planner() -> None:
    gap = stack_gap()
    assert {g["model"] for g in gap} == {"530B", "1T"}
    for g in gap:
        assert float(str(g["2022 measured/predicted"])) > 1.03  # 2022: faster than predicted
        assert float(str(g["2021 over 2022"])) < 0.97


def test_korthikanti_rows_within_ten_percent_at_table3_settings() -> None:
    assert KORTHIKANTI_MICRO_BATCH["22B"] == 4
    got = korthikanti_at_settings()
    assert len(got) == 8 and all(abs(float(str(r["error"]))) <= 0.10 for r in got), got


def test_figures_12_to_15_in_the_measured_order() -> None:
    orders = {str(f["figure"])[:9]: f["agrees"] for f in figure_orders()}
    assert orders == {"Figure 12": True, "Figure 13": True, "Figure 14": True,
                      "Figure 15": True, "Figure 16": orders["Figure 16"]}  # fmt: skip


@pytest.mark.xfail(strict=True, reason="batch 512: b=4 priced 0.2% above the measured best b=2 "
                   "(a near tie the roofline cannot resolve); batch 128 agrees")  # fmt: skip
def test_figure16_in_the_measured_order() -> None:
    assert figure_orders()[-1]["agrees"]


def test_a_figure_check_rejects_the_wrong_order() -> None:
    fig = FIGURES[3]  # descending in t
    good = {32: {f"t={t}": 100.0 / t for t in (2, 4, 8, 16, 32)}}
    bad = {32: {f"t={t}": 100.0 * t for t in (2, 4, 8, 16, 32)}}
    assert _holds(fig, good) and not _holds(fig, bad)


def test_zero3_ring_by_hand_and_the_fall_at_fixed_batch() -> None:
    cfg = sc21_model(40, 5120, 40)
    cluster = CLUSTERS["dgx-a100-80gb"].with_nodes(128)  # 1024 GPUs
    terms = zero3_step(cfg, cluster, 4096, 1)
    n, h = 1024, 5120
    alpha = cluster.inter_latency
    assert terms["latency"] == pytest.approx(4 * (3 * 40 + 3) * (n - 1) * alpha)
    scale = zero3_scaling()
    ours = [float(str(r["this model"])) for r in scale]
    old = [float(str(r["bucket overlap"])) for r in scale]
    assert ours == sorted(ours, reverse=True) and ours[-1] < 0.3 * ours[0]
    # negative control: the bucket overlap steptime charged before stays flat
    assert max(old) / min(old) < 1.02
    assert 12 * h * h * 2 / (n - 1) < 1e6  # a ring step's chunk: latency-bound at this scale


def test_zero3_published_runs() -> None:
    got = {r["run"]: r for r in zero3_rows()}
    assert len(got) == len(ZERO3_RUNS)
    for run in ZERO3_RUNS:
        r = got[run.name]
        if run.bound == "at least":  # the paper reports "more than": never predict below it
            assert float(str(r["error"])) >= 0, r
        assert float(str(r["prefetch gain"])) > 0
    assert MIXED_ADAM.wire_bytes == 2


def test_predict_charges_the_block_schedule_for_zero3_with_overlap() -> None:
    cfg = sc21_model(40, 5120, 40)
    cluster = CLUSTERS["dgx-a100-80gb"].with_nodes(256)  # 2048 GPUs, 2 micro-batches each
    cand = Candidate(2048, 1, 1, 1, zero=3)
    pred = predict(cfg, cluster, 4096, cand, precision=BF16_FSDP, dp_overlap=True)
    sched = zero3_schedule(cfg, cluster, cand, 2, BF16_FSDP)
    assert pred.time["dp_comm"] == pytest.approx(sched["gather"] + sched["reduce_scatter"])
    assert pred.time["dp_comm"] > 0.5 * pred.time["compute"]  # latency-bound rings
    # without overlap, and for ZeRO-1, the listed collectives are charged as before
    plain = predict(cfg, cluster, 4096, cand, precision=BF16_FSDP)
    assert plain.time["dp_comm"] != pytest.approx(pred.time["dp_comm"])
    with pytest.raises(ValueError, match="zero=3"):
        zero3_schedule(cfg, cluster, Candidate(2048, 1, 1, 1, zero=1), 2)
