"""The planner on screen: its ranked table as text, and a widget that re-plans as you change
the cluster (nodes, GPUs per node, memory, link bandwidths) and the model size.

The widget only calls :func:`labkit.planner.plan`; every number it shows is the planner's.
Pure helpers a test checks: :func:`why_nothing_fits` (an empty result explained) and
:func:`why_slower` (what a runner-up loses to the choice, term by term).
"""

from __future__ import annotations

import functools
from dataclasses import replace

from labkit.models.gpt import GPTConfig
from labkit.planner import CLUSTERS, Cluster, Prediction, plan
from labkit.viz.table import Column, format_table

__all__ = [
    *("COLUMNS_DEFINED", "FULL_SEARCH", "MODEL_SHAPES", "PlannerWidget", "format_plan"),
    *("gpt_of_size", "no_layout_reason", "plan_3d", "plan_full", "why_nothing_fits"),
    "why_slower",
]

# GPT shapes by size (billions of parameters): (layers, hidden, heads); Megatron's Table 1
# shapes, and a 100B one (80 layers of 10,240: 12 l h^2 = 100.7B)
MODEL_SHAPES: dict[int, tuple[int, int, int]] = {
    8: (36, 4096, 32),
    18: (40, 6144, 48),
    39: (48, 8192, 64),
    76: (60, 10240, 80),
    100: (80, 10240, 80),
    146: (80, 12288, 96),
}
# what a learner chooses by hand (exercise 08): degrees, micro-batch, ZeRO 0-3, recompute, v
SEARCH = dict(
    micro_batches=(1, 2, 4), zero_stages=(0, 1, 2, 3), recompute=("none", "selective", "full"),
    virtual=(1, 2),
)
# and the rest of the space: sequence parallelism beside tp, HSDP (ZeRO inside a node)
FULL_SEARCH = dict(SEARCH, sp=(False, True), shard_groups=("dp", "node"))
COLUMNS_DEFINED = (
    "GB/GPU: predicted peak bytes per GPU of the charged pipeline rank (labkit.memory.per_gpu,"
    " the model labkit.memory.estimate uses; 1 GB allowance included); states: parameters,"
    " gradients and optimizer state; acts: activations. fits: GB/GPU <= the card; risky (!):"
    " fits by less than 5%, x: does not fit, *: the choice (the fastest safe fit). step s: the"
    " planner's predicted iteration (labkit.planner.plan.predict: compute by the card's"
    " roofline, its efficiency curve and every source in docs/planner.md; bubble;"
    " exposed communication); comm: tp + pp + dp communication. MFU: model"
    " FLOPs (Megatron's count without recompute) / (step x GPUs x peak FLOP/s); HFU: the FLOPs"
    " the hardware runs, recompute included, over the same."
)


def gpt_of_size(billions: int, vocab: int = 51_200, seq: int = 2_048) -> GPTConfig:
    """The GPT of ``MODEL_SHAPES[billions]`` with Megatron's vocabulary and sequence."""
    if billions not in MODEL_SHAPES:
        raise ValueError(f"no GPT shape for {billions}B; choose one of {sorted(MODEL_SHAPES)}")
    layers, hidden, heads = MODEL_SHAPES[billions]
    return GPTConfig(vocab_size=vocab, block_size=seq, n_layer=layers, n_head=heads, n_embd=hidden)


@functools.lru_cache(maxsize=32)
def _planned(cfg: GPTConfig, cluster: Cluster, global_batch: int, full: bool) -> tuple:
    search = FULL_SEARCH if full else SEARCH
    return tuple(plan(cfg, cluster, global_batch, **search))  # type: ignore[arg-type]


def plan_3d(cfg: GPTConfig, cluster: Cluster, global_batch: int) -> list[Prediction]:
    """The planner over what a learner picks: dp, tp, pp, micro-batch, ZeRO 0-3, recompute
    none/selective/full, 1 or 2 virtual stages; safe fits first (``plan``'s order).
    Cached (pure arithmetic on frozen inputs): a widget returning to a setting is free."""
    return list(_planned(cfg, cluster, global_batch, False))


def plan_full(cfg: GPTConfig, cluster: Cluster, global_batch: int) -> list[Prediction]:
    """:func:`plan_3d`'s space plus sequence parallelism and HSDP."""
    return list(_planned(cfg, cluster, global_batch, True))


def _comm(r: Prediction) -> float:
    return sum(v for k, v in r.time.items() if k.endswith("_comm"))


def _states(r: Prediction) -> float:
    return r.memory["parameters"] + r.memory["gradients"] + r.memory["optimizer"]


def format_plan(preds: list[Prediction], top: int = 8, memory_gb: float | None = None) -> str:
    """The best ``top`` rows (:mod:`labkit.viz.table`): layout, memory per GPU (states,
    activations), step time (bubble, communication), MFU; marks: * the choice, ! risky,
    x does not fit. Below: how many fit, and why none does when none does."""
    cols = [
        Column(""), Column("dp"), Column("tp"), Column("pp"), Column("mb"), Column("ZeRO"),
        Column("recompute"), Column("v"), Column("sp"),
        Column("GB/GPU", fmt=".1f", scale=1e-9), Column("states", "GB", ".1f", 1e-9),
        Column("acts", "GB", ".1f", 1e-9), Column("step", "s", ".2f"),
        Column("bubble", "s", ".2f"), Column("comm", "s", ".2f"), Column("MFU", fmt=".2f"),
        Column("HFU", fmt=".2f"),
    ]  # fmt: skip
    rows = []
    for i, r in enumerate(preds[:top]):
        c = r.candidate
        mark = "x" if not r.fits else ("*" if i == 0 and not r.risky else ("!" if r.risky else ""))
        zero = f"{c.zero}" + ("h" if c.shard_group == "node" else "") + (
            "o" if c.offload != "none" else "")  # fmt: skip
        rows.append([mark, c.dp, c.tp, c.pp, c.micro_batch, zero, c.recompute, c.virtual,
                     "y" if c.sp else "", r.memory_total, _states(r), r.memory["activations"],
                     r.step_seconds, r.time.get("bubble", 0.0), _comm(r), r.mfu,
                     r.hfu])  # fmt: skip
    lines = [format_table(cols, rows)] if rows else []
    fits = sum(r.fits for r in preds)
    cap = f" of {memory_gb:.0f} GB" if memory_gb else ""
    lines.append(
        f"{fits} of {len(preds)} layouts fit{cap}; * choice, ! risky (< 5% free), "
        "x does not fit; ZeRO 1h-3h: HSDP (that stage inside a node), o: CPU offload"
    )
    if preds and not fits:
        lines.append(why_nothing_fits(preds, memory_gb * 1e9 if memory_gb else None))
    return "\n".join(lines)


def why_nothing_fits(preds: list[Prediction], capacity: float | None = None) -> str:
    """Why no candidate fits, from the smallest one's parts ("" when some candidate fits):
    what it needs against the card, its model states alone (at its dp and ZeRO stage) and
    its activations, and what would help that the search did not already try."""
    if not preds or any(r.fits for r in preds):
        return ""
    cap = capacity or preds[0].capacity
    r = min(preds, key=lambda p: p.memory_total)
    c, states = r.candidate, _states(r)
    zeros = {p.candidate.zero for p in preds}
    tries = []
    if states > cap:
        tries += [] if 3 in zeros else ["ZeRO-3 (shards parameters and gradients too)"]
        tries += ["more tp x pp", "more GPUs"]
    else:
        rcs = {p.candidate.recompute for p in preds}
        tries += [] if "full" in rcs else ["full recompute"]
        tries += ["sequence parallelism", "a smaller micro-batch", "more GPUs"]
    shard = " (HSDP)" if c.shard_group == "node" else ""
    return (
        f"none fits: the smallest layout needs {r.memory_total / 1e9:.1f} GB of "
        f"{cap / 1e9:.0f} (dp={c.dp} tp={c.tp} pp={c.pp} micro-batch {c.micro_batch}, "
        f"ZeRO-{c.zero}{shard}, {c.recompute} recompute): model states alone "
        f"{states / 1e9:.1f} GB at dp={c.dp} with ZeRO-{c.zero}, activations "
        f"{r.memory['activations'] / 1e9:.1f} GB, workspace {r.memory['workspace'] / 1e9:.1f}"
        " GB; try " + ", ".join(tries)
    )


def why_slower(pred: Prediction, best: Prediction) -> str:
    """What ``pred`` loses to ``best``: does not fit / risky, or the time terms it pays more
    for (largest first), from the two predictions."""
    if not pred.fits:
        return f"does not fit ({pred.memory_total / 1e9:.1f} GB of {pred.capacity / 1e9:.0f})"
    diff = {k: pred.time.get(k, 0.0) - best.time.get(k, 0.0) for k in pred.time}
    worse = sorted((d, k) for k, d in diff.items() if d > 0.005 * best.step_seconds)[::-1]
    text = ", ".join(f"{k} +{d:.2f} s" for d, k in worse[:2]) or "a near-tie"
    return text + (f"; risky ({pred.memory_total / 1e9:.1f} GB)" if pred.risky else "")


def no_layout_reason(cfg: GPTConfig, cluster: Cluster, global_batch: int) -> str:
    """Why the planner has no candidate at all: which split of the GPUs fails which rule.

    A layout needs dp x tp x pp = GPUs, tp dividing the heads and the hidden size, pp
    dividing the layers, and dp (times a micro-batch of at least 1) dividing the global
    batch (:func:`labkit.planner.plan.enumerate_candidates`). Names the values that remain
    at each rule, so "0 of 0 layouts" always comes with its reason."""
    n = cluster.world_size
    divisors = [k for k in range(1, n + 1) if n % k == 0]
    tps = [t for t in divisors if cfg.n_head % t == 0 and cfg.n_embd % t == 0]
    pps = [p for p in divisors if p <= cfg.n_layer and cfg.n_layer % p == 0]
    dps = sorted({n // (t * p) for t in tps for p in pps if n % (t * p) == 0})
    return (
        f"no layout splits {n} GPUs ({cluster.nodes} nodes x {cluster.gpus_per_node}) evenly: "
        f"tp must divide the {cfg.n_head} heads and hidden {cfg.n_embd} (tp in {tps}), pp "
        f"the {cfg.n_layer} layers (pp in {pps}), so dp = {n} / (tp pp) is one of {dps}, "
        f"and none of those divides the global batch of {global_batch} sequences. "
        "Choose a GPU count whose factors the model and batch share (e.g. a power of 2)."
    )


class PlannerWidget:
    """Sliders for the cluster and the model; the table below re-plans on every change."""

    def __init__(self, billions: int = 100, cluster: str = "dgx-a100-80gb", nodes: int = 8,
                 global_batch: int = 512) -> None:  # fmt: skip
        import ipywidgets as w

        base = CLUSTERS[cluster]
        self.base, self.global_batch = base, global_batch
        self.size = w.Dropdown(options=sorted(MODEL_SHAPES), value=billions, description="model B")
        self.nodes = w.IntSlider(value=nodes, min=1, max=32, description="nodes")
        self.gpus = w.Dropdown(
            options=[2, 4, 8, 16], value=base.gpus_per_node, description="GPUs/node"
        )
        self.memory = w.IntSlider(value=int(base.memory_bytes / 1e9), min=16, max=192, step=8,
                                  description="GB/GPU")  # fmt: skip
        self.intra = w.IntSlider(value=int(base.intra_bandwidth / 1e9), min=25, max=900, step=25,
                                 description="intra GB/s")  # fmt: skip
        self.inter = w.IntSlider(value=int(base.inter_bandwidth / 1e9), min=5, max=100, step=5,
                                 description="inter GB/s")  # fmt: skip
        self.table = w.HTML()
        controls = [self.size, self.nodes, self.gpus, self.memory, self.intra, self.inter]
        for c in controls:
            c.observe(lambda _: self.update(), names="value")
        self.box = w.VBox([w.HBox(controls[:3]), w.HBox(controls[3:]), self.table])
        self.update()

    def cluster(self) -> Cluster:
        return replace(
            self.base, nodes=self.nodes.value, gpus_per_node=self.gpus.value,
            memory_bytes=self.memory.value * 1e9, intra_bandwidth=self.intra.value * 1e9,
            inter_bandwidth=self.inter.value * 1e9,
        )  # fmt: skip

    def update(self) -> list[Prediction]:
        import html

        cluster = self.cluster()
        try:
            cfg = gpt_of_size(self.size.value)
            self.preds = plan_3d(cfg, cluster, self.global_batch)
            text = format_plan(self.preds, memory_gb=cluster.memory_bytes / 1e9)
            if not self.preds:
                text = no_layout_reason(cfg, cluster, self.global_batch)
        except ValueError as e:  # e.g. a world size no layout divides
            self.preds, text = [], f"no plan: {e}"
        # pre-wrap: a long reason wraps at the widget's edge instead of running off it
        self.table.value = f'<pre style="white-space:pre-wrap">{html.escape(text)}</pre>'
        return self.preds

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.box)
