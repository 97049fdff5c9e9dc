"""How accurate the planner is at the configurations really measured (pure arithmetic).

* Table 1 of Narayanan et al. 2021 at each run's own settings (:mod:`labkit.planner.sc21`):
  predicted against published TFLOP/s per GPU, the error, the paper's layout's rank among the
  planner's candidates and its gap to the first choice; how often the first choice is the
  paper's under the memory budget the paper's own runs reveal; the mean absolute and signed
  error; each row's sensitivity to the constants no measurement here gives.
* Korthikanti et al. 2022's Table 5 at Table 3's settings (``published.KORTHIKANTI_MICRO_BATCH``).
* The same model and layout measured twice, in 2021 (Table 1) and 2022 (Korthikanti's full
  recompute): :func:`stack_gap`, the evidence for where the Table 1 rows stay optimistic.
* Figures 12-16 (:mod:`labkit.planner.figures`) and ZeRO-3 / FSDP
  (:mod:`labkit.planner.zero3_runs`).

``python -m labkit.planner`` prints all of it (:func:`main`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

from labkit.planner import roofline
from labkit.planner.flops import MEGATRON_TABLE1, megatron_flops_per_iteration
from labkit.planner.published import (
    KORTHIKANTI_MICRO_BATCH,
    KORTHIKANTI_TABLE5,
    korthikanti_rows,
)
from labkit.planner.sc21 import (
    TABLE1_SETTINGS,
    sc21_cluster,
    table1_prediction,
    table1_ranked,
    tflops,
)

__all__ = ["UNMEASURED", "korthikanti_at_settings", "main",
           "revealed_budget", "sensitivity", "stack_gap", "table1_errors", "table1_rows",
           "table1_summary"]  # fmt: skip

# The constants the A100 rows need that no measurement here gives, and where each comes from
UNMEASURED = {
    "a100 gemm_max": "published MAMF (CUDA 12.1, 2023) x the H100 fit's ratio to its MAMF; "
                     "Table 1 ran cuBLAS of the 20.12 container (CUDA 11.1)",
    "a100 mem_eff": "the H100 fit's 0.9, taken for the A100",
    "NVLink busbw": "a100.nccl_allreduce_busbw: nccl-tests on 8 A100s with NCCL 2.18 (2023), "
                    "not the 2021 NCCL",
}  # fmt: skip


def table1_rows() -> list[dict[str, object]]:
    """Per Table 1 row: the run's settings, published and predicted TFLOP/s per GPU, the error,
    and where the paper's exact configuration (t, p, micro-batch, v) ranks among the planner's
    candidates, with its step against the first choice's."""
    out = []
    for i, row in enumerate(MEGATRON_TABLE1):
        st, pred = TABLE1_SETTINGS[i], table1_prediction(i)
        ranked = table1_ranked(i)
        keys = [(r.candidate.tp, r.candidate.pp, r.candidate.micro_batch, r.candidate.virtual)
                for r in ranked]  # fmt: skip
        at = keys.index((row.tp, row.pp, st.micro_batch, st.virtual))
        got = tflops(i, pred)
        out.append({
            "params (B)": row.params_billion, "(t, p, b, v)": keys[at], "DDP": st.ddp,
            "published": row.tflops_per_gpu, "predicted": round(got, 1),
            "error": round(got / row.tflops_per_gpu - 1, 4), "rank": at + 1,
            "first choice": keys[0],
            "gap": round(ranked[at].step_seconds / ranked[0].step_seconds - 1, 3),
        })  # fmt: skip
    return out


def table1_errors() -> list[float]:
    """Each Table 1 row's predicted over published TFLOP/s minus 1, at the run's settings."""
    return [tflops(i, table1_prediction(i)) / row.tflops_per_gpu - 1
            for i, row in enumerate(MEGATRON_TABLE1)]  # fmt: skip


def table1_summary(rows: list[dict[str, object]] | None = None) -> dict[str, float]:
    """Mean absolute, mean signed and worst error over the rows (default: every Table 1 row,
    :func:`table1_errors`), and how many are within 10%."""
    if rows is None:
        rows = [{"error": e} for e in table1_errors()]
    errs = [float(str(r["error"])) for r in rows]
    return {"mean abs": sum(map(abs, errs)) / len(errs), "mean signed": sum(errs) / len(errs),
            "worst": max(errs, key=abs), "within 10%": sum(abs(e) <= 0.10 for e in errs),
            "rows": len(errs)}  # fmt: skip


def revealed_budget() -> dict[str, float]:
    """The paper's runs reveal a memory budget: the most any of its ten configurations needs
    (the planner's memory model). Under it, how often the planner's first choice has the
    paper's (t, p), and the paper's whole configuration."""
    budget = max(table1_prediction(i).memory_total for i in range(len(MEGATRON_TABLE1)))
    same_tp = same_all = 0
    for i, row in enumerate(MEGATRON_TABLE1):
        first = next(r for r in table1_ranked(i) if r.memory_total <= budget).candidate
        st = TABLE1_SETTINGS[i]
        same_tp += (first.tp, first.pp) == (row.tp, row.pp)
        same_all += (first.tp, first.pp, first.micro_batch, first.virtual) == (
            row.tp, row.pp, st.micro_batch, st.virtual)  # fmt: skip
    return {"budget GB": round(budget / 1e9, 1), "(t, p) first": float(same_tp),
            "whole configuration first": float(same_all),
            "rows": float(len(MEGATRON_TABLE1))}  # fmt: skip


@contextmanager
def _a100(**fields: float) -> Iterator[None]:
    """The roofline's A100 with ``fields`` changed, for the duration (a sensitivity probe)."""
    old = roofline.CHIPS["a100"]
    roofline.CHIPS["a100"] = replace(old, **fields)  # type: ignore[arg-type]
    try:
        yield
    finally:
        roofline.CHIPS["a100"] = old


def sensitivity(step: float = 0.1) -> list[dict[str, object]]:
    """Each row's error, and how it moves (percentage points) when each :data:`UNMEASURED`
    constant is ``step`` lower (a lower constant means a slower predicted step)."""
    base = roofline.CHIPS["a100"]
    nv = sc21_cluster(8).intra_bandwidth
    out = []
    for i, row in enumerate(MEGATRON_TABLE1):
        err = tflops(i, table1_prediction(i)) / row.tflops_per_gpu - 1
        moved = {}
        with _a100(gemm_max=base.gemm_max * (1 - step)):
            moved["a100 gemm_max"] = tflops(i, table1_prediction(i))
        with _a100(mem_eff=base.mem_eff * (1 - step)):
            moved["a100 mem_eff"] = tflops(i, table1_prediction(i))
        moved["NVLink busbw"] = tflops(i, table1_prediction(i, nvlink_busbw=nv * (1 - step)))
        entry: dict[str, object] = {"params (B)": row.params_billion, "error": round(err, 4)}
        for k, v in moved.items():
            entry[f"{k} -{step:.0%}"] = round(v / row.tflops_per_gpu - 1 - err, 4)
        out.append(entry)
    return out


def korthikanti_at_settings() -> list[dict[str, object]]:
    """Per model and recipe (:func:`labkit.planner.published.korthikanti_rows`, at Table 3's
    layout and micro-batch :data:`KORTHIKANTI_MICRO_BATCH`): the paper's seconds against the
    planner's, the throughput error and the MFU."""
    return [{"model": r["model"], "b": KORTHIKANTI_MICRO_BATCH[str(r["model"])],
             "recipe": r["recipe"], "paper s": r["paper s"],
             "planner s": round(float(str(r["planner s"])), 2),
             "error": round(float(str(r["paper s"])) / float(str(r["planner s"])) - 1, 4),
             "paper MFU": round(float(str(r["paper MFU"])), 3),
             "planner MFU": round(float(str(r["planner MFU"])), 3)}
            for r in korthikanti_rows()]  # fmt: skip


def stack_gap() -> list[dict[str, object]]:
    """The same model and (t, p) measured in 2021 (Table 1) and in 2022 (Korthikanti's full
    recompute, the same recipe): each one's measured over predicted throughput. The planner
    prices both with the same hardware constants, so the ratio of the two is what the newer
    software stack ran faster than the planner's mechanisms explain."""
    out = []
    for name, i in (("530B", 8), ("1T", 9)):
        row, k = MEGATRON_TABLE1[i], next(r for r in KORTHIKANTI_TABLE5 if r.name == name)
        t1 = row.tflops_per_gpu / tflops(i, table1_prediction(i))
        ours = next(r for r in korthikanti_rows() if (r["model"], r["recipe"]) == (name, "full"))
        t2 = float(str(ours["planner s"])) / k.full_s
        f2 = megatron_flops_per_iteration(k.batch, 2048, k.layers, k.hidden, 51200)
        out.append({"model": name, "(t, p)": (row.tp, row.pp),
                    "2021 TFLOP/s": row.tflops_per_gpu,
                    "2022 TFLOP/s": round(f2 / (k.full_s * k.gpus) / 1e12, 1),
                    "2021 measured/predicted": round(t1, 3),
                    "2022 measured/predicted": round(t2, 3),
                    "2021 over 2022": round(t1 / t2, 3)})  # fmt: skip
    return out


def show(title: str, rows: list[dict[str, object]]) -> None:  # pragma: no cover - printing
    print(f"\n{title}")
    keys = list(rows[0])
    text = [[f"{r[k]:+.1%}" if k == "error" else str(r[k]) for k in keys] for r in rows]
    width = [max(len(k), *(len(t[j]) for t in text)) for j, k in enumerate(keys)]
    print("  ".join(k.rjust(w) for k, w in zip(keys, width)))
    for t in text:
        print("  ".join(x.rjust(w) for x, w in zip(t, width)))


def main() -> None:  # pragma: no cover - a report for people; each piece is tested
    from labkit.planner.figures import figure_orders
    from labkit.planner.zero3_runs import zero3_rows, zero3_scaling

    rows = table1_rows()
    show("Table 1 (Narayanan et al. 2021) at each run's settings (run_table_1.sh): "
         "TFLOP/s per GPU", rows)  # fmt: skip
    s = table1_summary(rows)
    print(
        f"mean absolute error {s['mean abs']:.1%}, mean signed {s['mean signed']:+.1%}, "
        f"worst {s['worst']:+.1%}, {s['within 10%']} of {s['rows']} rows within 10%"
    )
    b = revealed_budget()
    print(
        f"under the paper's revealed budget ({b['budget GB']} GB, its fullest run), the "
        f"planner's first choice has the paper's (t, p) in {b['(t, p) first']:.0f} of "
        f"{b['rows']:.0f} rows, its whole configuration in {b['whole configuration first']:.0f}"
    )
    show("Sensitivity: error, and its move when each unmeasured constant is 10% lower",
         sensitivity())  # fmt: skip
    for k, v in UNMEASURED.items():
        print(f"  {k}: {v}")
    show("One model and layout, two software stacks (2021: Table 1; 2022: Korthikanti full "
         "recompute)", stack_gap())  # fmt: skip
    show("Korthikanti et al. 2022, Table 5 at Table 3's settings", korthikanti_at_settings())
    print("\nFigures 12-16 (Narayanan et al. 2021): the planner's order against the measured")
    for f in figure_orders():
        print(f"  {'agrees ' if f['agrees'] else 'DIFFERS'} {f['figure']}: {f['measured']}")
        for batch, tf in f["TFLOP/s"].items():  # type: ignore[attr-defined]
            print(f"           batch {batch}: {tf}")
    show("ZeRO-3 / FSDP published runs (labkit.planner.zero3_runs), TFLOP/s per GPU", zero3_rows())
    show("ZeRO-3 at a fixed global batch (13B, 4096 sequences): per-layer rings against "
         "the bucket overlap charged before", zero3_scaling())  # fmt: skip
