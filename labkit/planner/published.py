"""Published training runs as data, each with its source beside it, and the planner against them.

Two kinds of record (all on DGX-class A100 80GB nodes, sequence 2048, Megatron's GPT shape):

* :data:`KORTHIKANTI_TABLE5`: Korthikanti et al. 2022, "Reducing Activation Recomputation in
  Large Transformer Models" (arXiv 2205.05198), Table 3 (the four models and their layouts)
  and Table 5 (iteration seconds with full recompute, and with sequence parallelism plus
  selective recompute). MFU and HFU follow from those seconds by the paper's formulas: model
  FLOPs ``72 B s l h^2 (1 + s/6h + V/12lh)`` (``flops.megatron_flops_per_iteration`` without
  recompute); hardware FLOPs add the recomputed work (full: the 96 factor; selective:
  ``72 B s l h^2 (1 + s/3h + V/12lh)``, :func:`selective_hardware_flops`). The selective
  seconds are checked against a second source, the Megatron-LM README's MFU/HFU table
  (:func:`korthikanti_readme_check`).
* :data:`PUBLISHED_RUNS`: other runs with the throughput their authors reported, in the unit
  they reported it: TFLOP/s per GPU by Megatron's 96-factor count, MFU, or tokens/s per GPU.

The engine. The roofline prices Megatron's own code. MT-NLG ran Table 1's 530B row again
(same model, layout t=8 p=35 and DGX A100 cluster; a smaller batch, which the planner prices)
on Megatron-DeepSpeed's pipeline engine at 126 TFLOP/s per GPU, where Megatron measured 163.
That pair of measurements is the one controlled comparison of the two engines, so it fixes
:func:`deepspeed_engine_factor` (measured over predicted for MT-NLG, divided by the same for
Table 1's row). BLOOM, the other Megatron-DeepSpeed run, is held back: it checks the factor.

``python -m labkit.planner.table1`` prints every comparison.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

from labkit.hardware import value
from labkit.models.gpt import GPTConfig
from labkit.planner.cluster import CLUSTERS
from labkit.planner.flops import (
    A100_PEAK,
    MEGATRON_TABLE1,
    TABLE1_VOCAB,
    megatron_flops_per_iteration,
    selective_hardware_flops,
)
from labkit.planner.plan import Candidate, plan, predict
from labkit.planner.sc21 import sc21_cluster
from labkit.planner.space import hardware_flops

__all__ = ["KORTHIKANTI_MICRO_BATCH", "KORTHIKANTI_TABLE5", "MEGATRON_README_UTILIZATION",
           "PUBLISHED_RUNS", "KorthikantiRow", "PublishedRun", "deepspeed_engine_factor",
           "korthikanti_readme_check", "korthikanti_rows", "published_rows"]  # fmt: skip

KORTHIKANTI = "Korthikanti et al. 2022, arXiv 2205.05198, Tables 3 and 5"


class KorthikantiRow(NamedTuple):
    name: str
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    full_s: float  # iteration seconds, full recompute
    selective_s: float  # iteration seconds, sequence parallelism + selective recompute


# vocabulary 51,200, sequence 2,048, micro-batch :data:`KORTHIKANTI_MICRO_BATCH` (Table 3).
# How far these seconds are checked:
# the sequence-parallel + selective column reproduces, through the paper's formulas, every MFU
# and HFU of :data:`MEGATRON_README_UTILIZATION` to 0.2 points
# (``korthikanti_readme_check``); of the full-recompute column only 530B is checked, against the
# abstract's "29% faster" (49.05 / 37.83 = 1.297). The other three full-recompute seconds are
# the paper's Table 5 as transcribed here, not checked against a second source.
KORTHIKANTI_TABLE5: tuple[KorthikantiRow, ...] = (
    KorthikantiRow("22B", 64, 6144, 48, 8, 1, 8, 4, 1.42, 1.10),
    KorthikantiRow("175B", 96, 12288, 96, 8, 8, 64, 64, 18.13, 13.75),
    KorthikantiRow("530B", 128, 20480, 105, 8, 35, 280, 280, 49.05, 37.83),
    KorthikantiRow("1T", 160, 25600, 128, 8, 64, 512, 512, 94.42, 71.49),
)
# Table 3's last column: micro-batch 4 for the 22B model (its global batch of 4 on 8 GPUs at
# dp = 1 is one micro-batch a step), 1 for the three others
KORTHIKANTI_MICRO_BATCH = {"22B": 4, "175B": 1, "530B": 1, "1T": 1}


# The MFU and HFU the Megatron-LM README publishes for the same four models ("measured on
# benchmark runs ... using a data parallel size of one"; github.com/NVIDIA/Megatron-LM,
# README.md, the table under "our paper"), a second source for Table 5's selective column.
MEGATRON_README_UTILIZATION: dict[str, tuple[float, float]] = {
    "22B": (0.415, 0.437), "175B": (0.514, 0.528), "530B": (0.560, 0.570), "1T": (0.563, 0.570),
}  # fmt: skip


def korthikanti_readme_check(hfu: str = "paper") -> list[dict[str, object]]:
    """Per model: MFU and HFU that Table 5's selective seconds give, beside the README's.
    ``hfu="forward-only"`` counts the recomputed attention core's forward alone (the wrong
    count, kept as the negative control)."""
    out = []
    for r in KORTHIKANTI_TABLE5:
        model = megatron_flops_per_iteration(r.batch, 2048, r.layers, r.hidden, 51200,
                                             recompute=False)  # fmt: skip
        hw = (selective_hardware_flops(r.batch, 2048, r.layers, r.hidden, 51200)
              if hfu == "paper" else model + 4 * r.batch * 2048**2 * r.hidden * r.layers)
        peak = r.gpus * A100_PEAK * r.selective_s
        mfu, hfu_readme = MEGATRON_README_UTILIZATION[r.name]
        out.append({"model": r.name, "MFU from seconds": model / peak, "README MFU": mfu,
                    "HFU from seconds": hw / peak, "README HFU": hfu_readme})  # fmt: skip
    return out


class PublishedRun(NamedTuple):
    name: str
    vocab: int
    heads: int
    hidden: int
    layers: int
    gpus: int
    batch: int
    layout: tuple[int, int] | None  # (tp, pp) as run; None: not published
    recipe: dict[str, object]  # the candidate's other fields, and predict's keywords
    reported: float
    unit: str  # "tflops96" (Megatron's count, per GPU), "mfu", "tokens/s/gpu"
    source: str
    # bytes/s per GPU between nodes: a DGX A100's one HDR NIC per GPU (hardware catalog)
    inter_bandwidth: float = value("a100.nic_bandwidth")
    engine: str = "megatron"  # "megatron-deepspeed": DeepSpeed's pipeline engine (module doc)


PUBLISHED_RUNS: tuple[PublishedRun, ...] = (
    PublishedRun(
        "Megatron 530B on 2240 GPUs", 51200, 128, 20480, 105, 2240, 2240, (8, 35),
        {"recompute": "selective", "sp": True}, 0.542, "mfu",
        "Korthikanti et al. 2022, arXiv 2205.05198, abstract: MFU 54.2% with sequence "
        "parallelism and selective recompute on 2240 A100s (42.1% with full recompute); "
        "Table 3's layout t=8, p=35, so dp=8 and 280 sequences per pipeline as in Table 5",
    ),
    PublishedRun(
        "BLOOM-176B", 250880, 112, 14336, 70, 384, 2048, (4, 12),
        {"recompute": "full", "zero": 1, "micro_batch": 2, "uneven": True}, 150.0, "tflops96",
        "Le Scao et al. 2022, arXiv 2211.05100, section 3.4 (384 A100 80GB, tp=4 pp=12 dp=8, "
        "ZeRO-1, micro-batch 2, global batch 2048, about 150 TFLOP/s per GPU counted with "
        "recompute; also the BigScience model card: 'training throughput: about 150 TFLOPs'); "
        "Megatron-DeepSpeed on Jean Zay, whose nodes have 4 x 100 Gb/s Omni-Path links "
        "(6.25 GB/s a GPU); vocabulary 250,680 padded to 250,880",
        6.25e9,
        "megatron-deepspeed",
    ),
    PublishedRun(
        "MT-NLG 530B", 51200, 128, 20480, 105, 2240, 1920, (8, 35),
        {"recompute": "full"}, 126.0, "tflops96",
        "Smith et al. 2022, arXiv 2201.11990, section 3.3 (280 DGX A100, t=8 p=35 dp=8, "
        "global batch 1920: 126 TFLOP/s per GPU); DeepSpeed's pipeline engine",
        engine="megatron-deepspeed",
    ),
    PublishedRun(
        "LLaMA-65B", 32000, 64, 8192, 80, 2048, 2048, None,
        {"recompute": "selective", "sp": True, "attention": "sdpa", "dp_overlap": True,
         "micro_batches": (1, 2, 4)}, 380.0,
        "tokens/s/gpu",
        "Touvron et al. 2023, arXiv 2302.13971, section 2.4: 'around 380 tokens/sec/GPU on "
        "2048 A100 GPU with 80GB' (layout not published; efficient causal attention, "
        "sequence parallelism, selective checkpointing, overlapped all-reduces)",
    ),
)


def _cfg(vocab: int, heads: int, hidden: int, layers: int, attention: str) -> GPTConfig:
    return GPTConfig(vocab_size=vocab, block_size=2048, n_layer=layers, n_head=heads,
                     n_embd=hidden, attention=attention)  # fmt: skip


def korthikanti_rows() -> list[dict[str, object]]:
    """Per model and recipe: the paper's seconds, MFU and HFU, and the planner's, at the
    paper's layout and micro-batch (Megatron 2022's explicit attention, no dp overlap; NVLink
    at the bus bandwidth NCCL reaches, :func:`labkit.planner.sc21.sc21_cluster`)."""
    out = []
    for r in KORTHIKANTI_TABLE5:
        cfg = _cfg(51200, r.heads, r.hidden, r.layers, "explicit")
        cluster = sc21_cluster(r.gpus)
        model = megatron_flops_per_iteration(r.batch, 2048, r.layers, r.hidden, 51200,
                                             recompute=False)  # fmt: skip
        for recipe, paper_s in (("full", r.full_s), ("selective", r.selective_s)):
            hw = hardware_flops(cfg, r.batch, recipe)  # the planner's one count of HFU
            cand = Candidate(dp=r.gpus // (r.tp * r.pp), tp=r.tp, pp=r.pp,
                             micro_batch=KORTHIKANTI_MICRO_BATCH[r.name], recompute=recipe,
                             sp=recipe == "selective")  # fmt: skip
            ours = predict(cfg, cluster, r.batch, cand).step_seconds
            peak = r.gpus * A100_PEAK
            out.append({
                "model": r.name, "recipe": recipe, "paper s": paper_s, "planner s": ours,
                "paper MFU": model / (paper_s * peak), "planner MFU": model / (ours * peak),
                "paper HFU": hw / (paper_s * peak), "planner HFU": hw / (ours * peak),
            })  # fmt: skip
    return out


def _reported(run: PublishedRun, seconds: float, cfg: GPTConfig) -> float:
    """The run's metric from an iteration time, in the unit the run reported."""
    if run.unit == "tokens/s/gpu":
        return run.batch * 2048 / seconds / run.gpus
    recompute = run.unit == "tflops96"
    flops = megatron_flops_per_iteration(run.batch, 2048, run.layers, run.hidden, run.vocab,
                                         recompute=recompute)  # fmt: skip
    per_gpu = flops / seconds / run.gpus
    return per_gpu / 1e12 if recompute else per_gpu / A100_PEAK


def _raw(run: PublishedRun) -> tuple[list[tuple[int, int]], float]:
    """The planner's (t, p) ranking over the run's recipe, and its metric at the published
    layout (or its first choice), priced as Megatron's own engine."""
    kw = dict(run.recipe)
    attention = str(kw.pop("attention", "explicit"))
    cfg = _cfg(run.vocab, run.heads, run.hidden, run.layers, attention)
    cluster = replace(CLUSTERS["dgx-a100-80gb"].with_nodes(run.gpus // 8),
                      inter_bandwidth=run.inter_bandwidth)  # fmt: skip
    micro = kw.pop("micro_batches", (kw.pop("micro_batch", 1),))
    options = {
        "micro_batches": micro, "recompute": (kw.pop("recompute"),),
        "zero_stages": (kw.pop("zero", 0),), "sp": (bool(kw.pop("sp", False)),),
        "uneven": bool(kw.pop("uneven", False)),
    }  # fmt: skip
    preds = [r for r in plan(cfg, cluster, run.batch, **options, **kw) if r.fits]
    ranked = list(dict.fromkeys((r.candidate.tp, r.candidate.pp) for r in preds))
    at = preds[0] if run.layout is None else next(
        r for r in preds if (r.candidate.tp, r.candidate.pp) == run.layout)  # fmt: skip
    return ranked, _reported(run, at.step_seconds, cfg)


_MTNLG = next(r for r in PUBLISHED_RUNS if r.name == "MT-NLG 530B")


def deepspeed_engine_factor(mtnlg_predicted: float | None = None) -> float:
    """Megatron-DeepSpeed's pipeline engine's throughput as a fraction of what the planner
    prices for Megatron's (module docstring): (MT-NLG measured / predicted) over (Table 1's
    530B row measured / predicted at its layout); about 0.79. ``mtnlg_predicted``: the
    planner's MT-NLG metric when the caller has it already."""
    mtnlg = _MTNLG
    if mtnlg_predicted is None:
        mtnlg_predicted = _raw(mtnlg)[1]
    row = next(r for r in MEGATRON_TABLE1 if (r.tp, r.pp) == mtnlg.layout)
    megatron = PublishedRun(
        "Megatron 530B, Table 1", TABLE1_VOCAB, row.heads, row.hidden, row.layers, row.gpus,
        row.batch, (row.tp, row.pp), {"recompute": "full", "micro_batches": (1, 2, 4, 8)},
        row.tflops_per_gpu, "tflops96", "Narayanan et al. 2021, Table 1",
    )  # fmt: skip
    return (mtnlg.reported / mtnlg_predicted) / (megatron.reported / _raw(megatron)[1])


def published_rows(top: int = 3) -> list[dict[str, object]]:
    """Per run: the planner's ranking of (t, p) over its search (the run's recipe), where the
    published layout ranks, and the metric predicted at that layout (or, when no layout was
    published, at the planner's first choice) against the reported one; a Megatron-DeepSpeed
    run's prediction times :func:`deepspeed_engine_factor` ("raw error": without it). MT-NLG
    fixes that factor, so its error is no check; BLOOM's is."""
    out = []
    raws = {run.name: _raw(run) for run in PUBLISHED_RUNS}
    factor = deepspeed_engine_factor(raws[_MTNLG.name][1])
    for run in PUBLISHED_RUNS:
        ranked, raw = raws[run.name]
        engine = factor if run.engine == "megatron-deepspeed" else 1.0
        got = raw * engine
        role = "fixes the engine factor" if run is _MTNLG else "check"
        row: dict[str, object] = {
            "run": run.name, "layout": run.layout, f"planner top {top}": ranked[:top],
            "rank": None if run.layout is None else ranked.index(run.layout) + 1,
            "unit": run.unit, "reported": run.reported, "engine": round(engine, 3),
            "planner": got, "error": got / run.reported - 1,
            "raw error": raw / run.reported - 1, "role": role, "source": run.source,
        }  # fmt: skip
        out.append(row)
    return out
