"""The planner on screen: its ranked table as text, and a widget that re-plans as you change
the cluster (nodes, GPUs per node, memory, link bandwidths) and the model size.

The widget only calls :func:`labkit.planner.plan`; every number it shows is the planner's.
"""

from __future__ import annotations

from dataclasses import replace

from labkit.models.gpt import GPTConfig
from labkit.planner import CLUSTERS, Cluster, Prediction, plan

__all__ = [
    *("MODEL_SHAPES", "PlannerWidget", "format_plan", "gpt_of_size", "no_layout_reason"),
    "plan_3d",
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
SEARCH = dict(
    micro_batches=(1, 2, 4), zero_stages=(0, 1), recompute=("full", "selective"), virtual=(1, 2)
)


def gpt_of_size(billions: int, vocab: int = 51_200, seq: int = 2_048) -> GPTConfig:
    """The GPT of ``MODEL_SHAPES[billions]`` with Megatron's vocabulary and sequence."""
    if billions not in MODEL_SHAPES:
        raise ValueError(f"no GPT shape for {billions}B; choose one of {sorted(MODEL_SHAPES)}")
    layers, hidden, heads = MODEL_SHAPES[billions]
    return GPTConfig(vocab_size=vocab, block_size=seq, n_layer=layers, n_head=heads, n_embd=hidden)


def plan_3d(cfg: GPTConfig, cluster: Cluster, global_batch: int) -> list[Prediction]:
    """The planner over the issue's whole space: dp, tp, pp, micro-batch, ZeRO 0/1, full or
    selective recompute, 1 or 2 virtual stages."""
    return plan(cfg, cluster, global_batch, **SEARCH)  # type: ignore[arg-type]


def format_plan(preds: list[Prediction], top: int = 8, memory_gb: float | None = None) -> str:
    """The best ``top`` rows as a fixed-width table: layout, memory per GPU (each part),
    step time (each part), MFU; the first row marked as the choice."""
    head = (f"{'':2}{'dp':>3}{'tp':>4}{'pp':>4}{'mb':>4}{'zero':>5}{'recomp':>10}{'v':>3}"
            f"{'GB/GPU':>8}{'states':>8}{'acts':>7}{'step s':>8}{'bubble':>8}{'comm':>7}"
            f"{'MFU':>6}")  # fmt: skip
    lines = [head]
    for i, r in enumerate(preds[:top]):
        c, mem, t = r.candidate, r.memory, r.time
        states = mem["parameters"] + mem["gradients"] + mem["optimizer"]
        comm = t["tp_comm"] + t["pp_comm"] + t["dp_comm"]
        mark = "* " if i == 0 and r.fits else ("x " if not r.fits else "  ")
        lines.append(
            f"{mark}{c.dp:>3}{c.tp:>4}{c.pp:>4}{c.micro_batch:>4}{c.zero:>5}{c.recompute:>10}"
            f"{c.virtual:>3}{r.memory_total / 1e9:>8.1f}{states / 1e9:>8.1f}"
            f"{mem['activations'] / 1e9:>7.1f}{r.step_seconds:>8.2f}{t['bubble']:>8.2f}"
            f"{comm:>7.2f}{r.mfu:>6.2f}"
        )
    fits = sum(r.fits for r in preds)
    cap = f" of {memory_gb:.0f} GB" if memory_gb else ""
    lines.append(
        f"{fits} of {len(preds)} layouts fit{cap}; * = the planner's choice, x = does not fit"
    )
    if preds and not fits:
        least = min(r.memory_total for r in preds)
        lines.append(
            f"none fits: the smallest layout needs {least / 1e9:.1f} GB per GPU{cap and ','}"
            f"{cap.replace(' of', '') and ' over the' + cap.replace(' of', '')}"
            "; add GPUs or memory per GPU"
        )
    return "\n".join(lines)


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
