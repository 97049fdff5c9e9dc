"""The planner's search space: one candidate layout, its prediction, and their enumeration.

A :class:`Candidate` is every choice a Megatron/DeepSpeed/FSDP run makes:

* ``dp, tp, pp``: the three degrees (Megatron's rank order, tp innermost);
* ``micro_batch``; ``virtual``: interleaved stages per pipeline rank (Narayanan et al. 2021);
  ``stage_layers``: an explicit (uneven) cut, blocks per virtual stage (``stages.py``);
* ``sp``: Megatron sequence parallelism beside tp (Korthikanti et al. 2022);
* ``recompute``: ``"none"``, ``"selective"`` (the attention core) or ``"full"`` (each layer);
* ``zero``: 0 (DDP), 1 (optimizer state sharded), 2 (and gradients), 3 (and parameters: FSDP,
  Rajbhandari et al. 2019); ``shard_group``: over whom ZeRO shards, ``"dp"`` (the whole dp
  group) or ``"node"`` (HSDP, Zhao et al. 2023: shard over the dp ranks inside a node,
  replicate across nodes, so only ``1/k`` of the gradients, reduced over the ``replicate``
  group, crosses the slow link);
* ``offload``: ``"none"``, ``"optimizer"`` (optimizer state in host memory, stepped on the
  CPU) or ``"optimizer+grads"`` (ZeRO-Offload, Ren et al. 2021: the gradients also stream to
  the CPU as backward produces them);
* ``cp``: context parallelism (ring attention: the world is ``dp x tp x pp x cp``, the dense
  gradients averaged over ``dp x cp``); ``ep``: expert parallelism, carved out of the
  ``dp x cp`` ranks (it divides ``dp x cp``; a MoE model only). Validated, and named, by
  :class:`labkit.parallel.layout.ParallelDegrees`. HSDP beside cp or ep is not modelled.

What the time side charges for these choices is in :func:`wire_bytes` (each dp collective's
buffer, group and count per step, in the precision policy's reduce dtype) and
:func:`labkit.planner.offload.offload_traffic` (PCIe bytes and CPU optimizer-step parameters). A
:class:`Prediction` fits when its total is at most the card's memory, and is *risky* when it
fits by less than :data:`RISKY_MARGIN` (5%): allocator fragmentation and library workspaces
vary by more than that.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

from labkit.memory.model import Precision
from labkit.memory.per_gpu import OFFLOAD
from labkit.models.gpt import GPTConfig
from labkit.parallel.layout import ParallelDegrees
from labkit.pipeline.cut import layer_counts
from labkit.planner.cluster import Cluster
from labkit.planner.flops import megatron_flops_per_iteration, selective_hardware_flops

__all__ = [
    "RISKY_MARGIN", "SHARD_GROUPS", "ZERO_STAGES", "Candidate", "Prediction",
    "WIRE_OPS", "ends_cut", "enumerate_candidates", "hardware_flops", "wire_bytes",
]  # fmt: skip

ZERO_STAGES = {0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}
SHARD_GROUPS = ("dp", "node")
RISKY_MARGIN = 0.05  # a fit by less than 5% of the card is marked risky


@dataclass(frozen=True)
class Candidate:
    dp: int
    tp: int
    pp: int
    micro_batch: int
    zero: int = 0
    recompute: str = "full"
    virtual: int = 1
    sp: bool = False
    stage_layers: tuple[int, ...] | None = None  # blocks per virtual stage; None: even/spread
    shard_group: str = "dp"  # "node": HSDP (ZeRO inside a node, replicas across)
    offload: str = "none"  # one of labkit.memory.per_gpu.OFFLOAD
    cp: int = 1  # context parallelism (ring attention)
    ep: int = 1  # expert parallelism, inside dp x cp

    def __post_init__(self) -> None:
        self.degrees  # noqa: B018  (ParallelDegrees validates and names every degree)
        if self.shard_group == "node" and max(self.cp, self.ep) > 1:
            raise ValueError(f"HSDP (shard_group='node') with cp={self.cp}, ep={self.ep} > 1 "
                             "is not modelled")  # fmt: skip
        if self.zero not in ZERO_STAGES:
            raise ValueError(f"zero={self.zero}: expected one of {sorted(ZERO_STAGES)}")
        if self.shard_group not in SHARD_GROUPS:
            raise ValueError(f"shard_group={self.shard_group!r}: expected one of {SHARD_GROUPS}")
        if self.shard_group == "node" and self.zero == 0:
            raise ValueError("shard_group='node' (HSDP) needs a ZeRO stage >= 1, got zero=0")
        if self.offload not in OFFLOAD:
            raise ValueError(f"offload={self.offload!r}: expected one of {OFFLOAD}")

    @property
    def degrees(self) -> ParallelDegrees:
        return ParallelDegrees(dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep)


@dataclass(frozen=True)
class Prediction:
    candidate: Candidate
    memory: dict[str, float]  # bytes per GPU by category
    time: dict[str, float]  # seconds per iteration by part
    micro_batches: int
    fits: bool
    mfu: float
    tokens_per_second: float
    capacity: float = 0.0  # the card's bytes (0: unknown)
    allowance: float = 0.0  # the stated fixed part of "workspace"
    host_bytes: float = 0.0  # what CPU offload keeps in host memory, per GPU
    hfu: float = float("nan")  # hardware FLOPs utilisation: MFU's FLOPs plus the recompute's

    @property
    def memory_total(self) -> float:
        return sum(self.memory.values())

    @property
    def peak_allocated(self) -> float:
        """The prediction for ``torch.cuda.max_memory_allocated``: total minus the allowance."""
        return self.memory_total - self.allowance

    @property
    def step_seconds(self) -> float:
        return sum(self.time.values())

    @property
    def headroom(self) -> float:
        """Fraction of the card left free (negative: by how much it does not fit)."""
        return 1 - self.memory_total / self.capacity if self.capacity else float("nan")

    @property
    def risky(self) -> bool:
        """Fits, but by less than :data:`RISKY_MARGIN` of the card."""
        return self.fits and self.headroom < RISKY_MARGIN

    def row(self) -> dict[str, object]:
        c = asdict(self.candidate)
        if c["stage_layers"] is None:  # the default cut: no column
            del c["stage_layers"]
        for k in ("cp", "ep"):  # 3D layouts keep their columns
            if c[k] == 1:
                del c[k]
        c.update(
            GB=round(self.memory_total / 1e9, 1),
            fits=self.fits,
            risky=self.risky,
            step_s=round(self.step_seconds, 3),
            mfu=round(self.mfu, 3),
            hfu=round(self.hfu, 3),
        )
        return c


def hardware_flops(cfg: GPTConfig, global_batch: int, recompute: str) -> float:
    """FLOPs one iteration really executes (Narayanan et al. 2021's count): MFU's model FLOPs
    (the 72 factor) plus the recompute's: full reruns every layer's forward (the 96 factor),
    selective counts the attention core again as Korthikanti et al. 2022 do
    (:func:`~labkit.planner.flops.selective_hardware_flops`, the count their HFU uses)."""
    B, s, L, h, V = global_batch, cfg.block_size, cfg.n_layer, cfg.n_embd, cfg.vocab_size
    if recompute == "selective":
        return selective_hardware_flops(B, s, L, h, V)
    return megatron_flops_per_iteration(B, s, L, h, V, recompute=recompute == "full")


# the collective each entry of :func:`wire_bytes` is (for a ring's share of its buffer)
WIRE_OPS = {"grad_all_reduce": "all_reduce", "grad_reduce_scatter": "reduce_scatter",
            "param_all_gather": "all_gather", "grad_all_reduce_replicas": "all_reduce",
            "tied_param_all_gather": "all_gather"}  # fmt: skip


def wire_bytes(
    cand: Candidate, psi: float, precision: Precision, shard: int, micro_batches: int = 1,
    tied: float = 0.0,
) -> dict[str, tuple[float, int, int]]:
    """``{collective: (bytes of its buffer, ranks, times per step)}`` the data-parallel side
    runs for a stage of ``psi`` parameters (per tp rank); ``shard``: the ranks ZeRO shards
    over (dp, or a node's share of it under HSDP); ``micro_batches``: m per replica.
    Gradients travel at ``precision.wire_bytes`` (fp32 for Megatron's main_grad, 2 for a
    16-bit reduce), parameters at ``param_bytes``:

    * DDP: ``grad_all_reduce`` over dp, once a step (gradients accumulate locally);
    * ZeRO-1: ``grad_reduce_scatter`` once a step, then ``param_all_gather`` of the updated
      parameters (an all-reduce's bytes in two halves; Rajbhandari et al. section 7);
    * ZeRO-2: the gradients are sharded, so they cannot accumulate whole: the reduce-scatter
      runs every micro-batch (DeepSpeed's stage 2), the gather once a step;
    * ZeRO-3 (FSDP): the parameters are gathered for every micro-batch's forward and again
      for its backward (``2 m`` gathers), the gradients reduce-scattered every micro-batch;
    * ZeRO-3 with ``tied`` > 0 parameters of a tied embedding and head on this rank (one
      pipeline rank holds both ends): ``tied_param_all_gather``, the tied unit gathered once
      more every micro-batch (counted: labkit's ZeRO-3 gathers a unit for each module that
      uses it, so the shared weight goes out for the embedding and again for the head: 3
      gathers a micro-batch, not 2; ``tests/test_wire_count.py``);
    * HSDP (``shard < dp``): additionally ``grad_all_reduce_replicas``, an all-reduce of the
      ``psi / shard`` gradient shard over the ``dp / shard`` replicas, as often as the
      reduce-scatter: the only dp traffic that crosses nodes.

    A ring moves ``2(n-1)/n`` of an all-reduce's buffer per rank, ``(n-1)/n`` of a
    reduce-scatter's or all-gather's; the time side applies that, the link and the overlap.
    """
    d, m = cand.dp, micro_batches
    g, p = psi * precision.wire_bytes, psi * precision.param_bytes
    if d == 1:
        return {}
    if cand.zero == 0:
        return {"grad_all_reduce": (g, d, 1)}
    reduces = 1 if cand.zero == 1 else m
    out = {
        "grad_reduce_scatter": (g, shard, reduces),
        "param_all_gather": (p, shard, 2 * m if cand.zero == 3 else 1),
    }
    if cand.zero == 3 and tied > 0:
        out["tied_param_all_gather"] = (tied * precision.param_bytes, shard, m)
    if shard < d:
        out["grad_all_reduce_replicas"] = (g / shard, d // shard, reduces)
    return out


def enumerate_candidates(
    cfg: GPTConfig,
    cluster: Cluster,
    global_batch: int,
    *,
    micro_batches: tuple[int, ...] = (1, 2, 4, 8),
    zero_stages: tuple[int, ...] = (0,),
    recompute: tuple[str, ...] = ("full",),
    virtual: tuple[int, ...] = (1,),
    sp: tuple[bool, ...] = (False,),
    uneven: bool = False,
    shard_groups: tuple[str, ...] = ("dp",),
    offload: tuple[str, ...] = ("none",),
    lighter_ends: bool = False,
    cp: tuple[int, ...] = (1,),
    ep: tuple[int, ...] = (1,),
    n_experts: int = 0,
) -> list[Candidate]:
    """Every layout that splits the model evenly: t divides the heads (and h), p divides the
    layers (times v), dp = GPUs / (t p), and dp x micro-batch divides the global batch (and,
    interleaved, p divides the micro-batch count m). ``uneven``: also every p (times v) up to
    the layer count that does not divide it, cut by the default spread (``stages.py``).
    ``shard_groups`` with "node": HSDP where it differs from ZeRO over dp (ZeRO >= 1, a dp
    group spanning nodes with several ranks in each, in Megatron's order). With an SDPA model
    and "none" searched too, "selective" is skipped: a fused kernel never stores the scores
    and rebuilds them in its backward, so the two are one layout; likewise ZeRO >= 1 at
    dp = 1 when ZeRO-0 is searched (sharding over one rank is DDP's layout).
    ``lighter_ends``: also, for 1F1B over p >= 3 stages, Megatron's uneven first/last
    stages: one block fewer on the first stage (it stashes the most micro-batches and holds
    the embedding) and on the last (it computes the head), the two spread over the middle
    (:func:`ends_cut`). ``cp``: context-parallel degrees to search (each dividing the GPUs, the
    sequence into ``2 cp`` zigzag chunks, with SDPA); ``ep``: expert-parallel degrees (each
    dividing ``dp x cp`` and ``n_experts``, the MoE model's experts; > 1 needs one)."""
    n, g = cluster.world_size, cluster.gpus_per_node
    divisors = [k for k in range(1, n + 1) if n % k == 0]
    out = []

    def cuts(stages: int) -> bool:  # the layers can be cut into this many stages
        return stages <= cfg.n_layer and (uneven or cfg.n_layer % stages == 0)

    def hsdp(d: int, t: int) -> bool:  # dp groups span nodes, whole nodes of k > 1 ranks each
        return g % t == 0 and g // t > 1 and t * d > g and d % (g // t) == 0

    def context(c: int) -> bool:  # the ring's zigzag chunks, a flash kernel
        return c == 1 or (cfg.block_size % (2 * c) == 0 and cfg.attention == "sdpa")

    for t, p, c in itertools.product(divisors, divisors, cp):
        if n % (t * p * c) or cfg.n_head % t or cfg.n_embd % t or not cuts(p) or not context(c):
            continue
        d = n // (t * p * c)
        for b, z, r, v, q, sg, o, e in itertools.product(
            micro_batches, zero_stages, recompute, virtual, sp, shard_groups, offload, ep
        ):
            if e > 1 and ((d * c) % e or not n_experts or n_experts % e):
                continue
            if sg == "node" and max(c, e) > 1:
                continue
            if global_batch % (d * b) or (v > 1 and (p == 1 or not cuts(p * v))):
                continue
            if v > 1 and (global_batch // (d * b)) % p:  # interleaving needs m % p == 0
                continue
            if (q and t == 1) or (sg == "node" and (z == 0 or not hsdp(d, t))):
                continue
            if r == "selective" and cfg.attention == "sdpa" and "none" in recompute:
                continue  # SDPA stores no scores and recomputes them anyway: "none" is it
            if z > 0 and d == 1 and 0 in zero_stages:
                continue  # ZeRO over one rank shards nothing: DDP's layout, listed once
            out.append(Candidate(d, t, p, b, z, r, v, q, shard_group=sg, offload=o, cp=c, ep=e))
            cut = ends_cut(cfg.n_layer, p) if lighter_ends and v == 1 else None
            if cut is not None:
                out.append(Candidate(d, t, p, b, z, r, v, q, cut, shard_group=sg, offload=o,
                                     cp=c, ep=e))  # fmt: skip
    return out


def ends_cut(n_layer: int, p: int) -> tuple[int, ...] | None:
    """The cut with one block fewer on the first and last of ``p`` stages than the default
    spread, the two moved to the middle (None: p < 3, or an end would be left empty)."""
    if p < 3:
        return None
    base = layer_counts(n_layer, p)
    if min(base[0], base[-1]) < 2:
        return None
    middle = layer_counts(n_layer - base[0] - base[-1] + 2, p - 2)
    return (base[0] - 1, *middle, base[-1] - 1)
