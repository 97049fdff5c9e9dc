"""The four design scenarios' configurations, each in one place, with the one call that plans it.

A number two notebooks show must come from one labkit function with one configuration: the
lesson that measures a scenario and notebook 13's walkthrough of it both import the scenario
from here and call its method, so a change to the planner, the memory estimate or the
configuration reaches both (``tests/test_one_source.py`` checks that they do, and agree).

* **S3, 1.3B** (notebook 11): ``gpt2-1.3b``, one 2,048-token sequence per GPU, bf16 with fp32
  Adam, SDPA attention, 8 GPUs of 24 GB; :func:`labkit.memory.estimate.estimate` per ZeRO
  stage; the choice is the first rung of DDP, ZeRO-1, -2, -3 that fits (pitfall P3).
* **S4, BERT** (notebook 09): the gradient bytes of BERT-base/large
  (:func:`labkit.labs.bert4nodes.gradient_bytes`) all-reduced on 4 nodes x 8 GPUs, NVLink
  inside and one 100 Gb/s Ethernet port per node between (alpha-beta from the hardware
  catalog: ``link.nvlink_latency``, ``a100.nvlink_per_direction``, ``link.ethernet_latency``,
  ``link.ethernet100``), flat ring against hierarchical
  (:func:`labkit.labs.bert4nodes.allreduce_times`).
* **S5, 10B** (notebook 10): :data:`labkit.labs.mixed_links.GPT_10B` on 4 nodes of
  ``a100-80gb-eth100``, 256 sequences a step; :func:`labkit.labs.mixed_links.rank_layouts`.
* **S6, 100B** (notebook 08): ``gpt_of_size(100)`` on 8 ``dgx-a100-80gb`` nodes, 512 sequences
  a step; :func:`labkit.viz.planner.plan_3d`.
* **K11, how often to checkpoint S6** (notebooks 17, 13 and 08): 100B parameters saved as fp32
  weights and Adam's two moments by 8 nodes; interruptions at the Llama 3 paper's rate scaled
  to 64 GPUs; the restart; every figure a catalog entry (``s6.*``, ``failures.*``). A
  synchronous save stalls for the bytes over the writers' bandwidth; an asynchronous one only
  for the device-to-host snapshot: each GPU's share of the bytes over its host link
  (``a100.host_link``), all GPUs copying at once. :func:`labkit.measure.node_loss.save_vs_async`
  shows the mechanism on this machine; its ratio is not scaled up (it swings run to run and
  is a CPU's, not a GPU's). Young/Daly's interval and the time wasted from
  :mod:`labkit.planner.budget`; a ZeRO shard read back after a node loss with
  :func:`labkit.checkpoint.reshard.plan_read`.

Each ``plan``/``ladder``/``allreduce`` call is cached: the walkthrough and a test can ask again
for free, and the answer is the same object the lesson printed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from labkit.checkpoint.layout import shard_range
from labkit.checkpoint.reshard import Place, plan_read, tp_place
from labkit.collectives.cost_model import AlphaBeta
from labkit.hardware import value
from labkit.labs import bert4nodes
from labkit.labs.mixed_links import GPT_10B, rank_layouts
from labkit.measure.node_loss import save_vs_async
from labkit.memory.estimate import MemoryEstimate, TrainSetup, estimate
from labkit.memory.model import STAGES
from labkit.models.bert import bert_preset
from labkit.models.gpt import GPTConfig, preset
from labkit.planner import CLUSTERS, Cluster, Prediction
from labkit.planner.budget import Failures, failure_overhead, young_daly_interval
from labkit.viz.planner import gpt_of_size, plan_3d

__all__ = ["BERT_4NODES", "CKPT_100B", "GPT_1P3B", "GPT_10B_MIXED", "GPT_100B_3D", "SCENARIOS"]


@dataclass(frozen=True)
class MemoryScenario:
    """S3: a model that does not fit one GPU with its training state; climb the ZeRO ladder."""

    model: str  # a labkit.models.gpt preset name
    micro_batch: int
    gpus: int
    card_bytes: float  # memory of one GPU
    lesson: str

    @property
    def cfg(self) -> GPTConfig:
        return preset(self.model)

    def setup(self, **changes: object) -> TrainSetup:
        """The lesson's per-GPU setup (bf16 + fp32 Adam, SDPA, no recompute) with ``changes``."""
        return TrainSetup(micro_batch=self.micro_batch, dp=self.gpus).with_(**changes)

    def ladder(self) -> dict[str, MemoryEstimate]:
        """Every ZeRO stage's per-GPU estimate at this scenario's shape (cached)."""
        return _ladder(self)

    def choice(self) -> str:
        """The first stage that fits ``card_bytes``, or ``"model parallel"`` when none does."""
        return next((s for s, e in self.ladder().items() if e.fits(self.card_bytes)),
                    "model parallel")  # fmt: skip


@functools.cache
def _ladder(s: MemoryScenario) -> dict[str, MemoryEstimate]:
    return {stage: estimate(s.cfg, s.setup(zero=stage)) for stage in STAGES}


@dataclass(frozen=True)
class PlannerScenario:
    """S5 and S6: a GPT on a cluster at a global batch, ranked by the lesson's planner call."""

    name: str
    cluster_name: str
    nodes: int
    global_batch: int  # sequences per step
    lesson: str
    search: str  # "rank_layouts" (notebook 10) or "plan_3d" (notebook 08)

    @property
    def cfg(self) -> GPTConfig:
        return GPT_10B if self.name == "10B" else gpt_of_size(100)

    @property
    def cluster(self) -> Cluster:
        return CLUSTERS[self.cluster_name].with_nodes(self.nodes)

    def plan(self) -> list[Prediction]:
        """The lesson's ranking (cached): what fits first, fastest first."""
        return _plan(self)

    def choice(self) -> Prediction:
        return self.plan()[0]

    @property
    def fallback_batch(self) -> int:
        """The global batch after a node is lost: the lost node's share is dropped, since the
        whole batch may have no layout on the nodes left (notebook 17 section 8)."""
        return self.global_batch // self.nodes * (self.nodes - 1)

    def fallback(self) -> Prediction:
        """The best layout when a node is lost (notebook 17 section 8): one node fewer at
        :attr:`fallback_batch` (the lr rescaled with it); raises when nothing fits."""
        smaller = self.fallback_batch
        ranked = _fallback(self, smaller)
        if not ranked:
            raise ValueError(f"{self.name}: nothing fits {self.nodes - 1} nodes at {smaller}")
        return ranked[0]


@functools.cache
def _fallback(s: PlannerScenario, global_batch: int) -> list[Prediction]:
    return plan_3d(s.cfg, s.cluster.with_nodes(s.nodes - 1), global_batch)


@functools.cache
def _plan(s: PlannerScenario) -> list[Prediction]:
    if s.search == "rank_layouts":
        return rank_layouts(s.cfg, s.cluster, s.global_batch)
    return plan_3d(s.cfg, s.cluster, s.global_batch)


@dataclass(frozen=True)
class CommScenario:
    """S4: BERT's gradient all-reduce across nodes, flat ring against hierarchical."""

    nodes: int
    gpus_per_node: int
    intra: AlphaBeta  # stated: NVLink inside a node
    inter: AlphaBeta  # stated: 100 Gb/s Ethernet per node
    lesson: str

    def gradient_bytes(self, model: str = "bert-base", scheme: str = "fp32") -> int:
        return _gradient_bytes(model, scheme)

    def allreduce(self, model: str = "bert-base", scheme: str = "fp32") -> dict[str, float]:
        """Seconds of one all-reduce of ``model``'s gradients: ``{"flat ring", "hierarchical"}``."""
        return bert4nodes.allreduce_times(
            self.gradient_bytes(model, scheme), self.nodes, self.gpus_per_node, self.intra,
            self.inter,
        )  # fmt: skip


@functools.cache
def _gradient_bytes(model: str, scheme: str) -> int:
    return bert4nodes.gradient_bytes(bert_preset(model), scheme)  # builds BERT on meta: cache


@dataclass(frozen=True)
class CheckpointScenario:
    """K11: how often to checkpoint S6's run, and what a node loss reads back (module doc)."""

    params: float
    bytes_per_param: float  # what a checkpoint holds per parameter
    gpus: int
    writers: int  # nodes writing in parallel
    write_bandwidth: float  # bytes/s per writer
    interruptions: int  # observed: this many failures ...
    days: float  # ... in this many days ...
    on_gpus: int  # ... on this many GPUs
    restart_seconds: float
    host_link: float  # bytes/s of one GPU's device-to-host copy (the async snapshot)
    host_sharing: int  # GPUs behind one host uplink, all copying at once
    probe_numel: int  # parameters of the state save_vs_async times on this machine
    lesson: str

    @property
    def mtbf_seconds(self) -> float:
        """The job's MTBF: failure rates of independent GPUs add, so M = days x GPUs / count."""
        return self.days * 86_400 * self.on_gpus / self.interruptions / self.gpus

    @property
    def sync_save_seconds(self) -> float:
        """A synchronous save's stall: the bytes over the writers' summed bandwidth."""
        return self.params * self.bytes_per_param / (self.writers * self.write_bandwidth)

    @property
    def bytes_per_gpu(self) -> float:
        """Each GPU's share of the checkpoint (the states are sharded over all of them)."""
        return self.params * self.bytes_per_param / self.gpus

    def measure(self) -> dict[str, float]:
        """Sync against async save stalls of ``probe_numel`` parameters, here (not cached): the
        mechanism, on a CPU; not scaled to S6 (``async_save_seconds`` is derived instead)."""
        return save_vs_async(self.probe_numel)

    def async_save_seconds(self) -> float:
        """An asynchronous save's stall at scale: the device-to-host snapshot, each GPU's
        share of the bytes over its host link, which ``host_sharing`` GPUs share (all copy at
        once)."""
        return self.bytes_per_gpu * self.host_sharing / self.host_link

    def failures(self) -> Failures:
        """The same run for :func:`labkit.planner.budget.run_budget` (notebook 08): MTBF per
        GPU, the synchronous save and the restart."""
        return Failures(mtbf_hours=self.mtbf_seconds * self.gpus / 3600, per="gpu",
                        save_seconds=self.sync_save_seconds,
                        restart_seconds=self.restart_seconds)  # fmt: skip

    def interval(self, save_seconds: float) -> float:
        return young_daly_interval(save_seconds, self.mtbf_seconds)

    def wasted(self, interval: float, save_seconds: float) -> float:
        return failure_overhead(interval, save_seconds, self.mtbf_seconds, self.restart_seconds)

    def intervals(self) -> list[tuple[str, str, float, float]]:
        """``(save, interval name, seconds, time wasted)`` for sync and async saves at
        Young/Daly's interval and at a fixed 30 minutes."""
        rows = []
        for name, delta in (("synchronous", self.sync_save_seconds),
                            ("asynchronous", self.async_save_seconds())):  # fmt: skip
            for label, t in (("Young/Daly", self.interval(delta)), ("every 30 min", 1800.0)):
                rows.append((name, label, t, self.wasted(t, delta)))
        return rows

    def reshard_reads(self, numel: int, old: int, new: int) -> list[list[tuple[int, int]]]:
        """For each of ``new`` ZeRO ranks, ``[(old rank, elements read)]`` from the flat
        shards ``old`` ranks saved of a tensor of ``numel`` elements (:func:`plan_read`)."""
        return self.reshard_layout_reads((numel,), 1, old, 1, new)

    def reshard_layout_reads(
        self, shape: tuple[int, ...], old_tp: int, old_dp: int, new_tp: int, new_dp: int
    ) -> list[list[tuple[int, int]]]:
        """A column-parallel weight of ``shape`` saved by ``old_tp`` tensor-parallel ranks
        (cut along dim 0), each slice's optimizer state ZeRO-sharded (flat ranges) over
        ``old_dp``, read back by ``new_tp x new_dp`` ranks. For new rank ``t * new_dp + d``:
        ``[(old shard t_old * old_dp + d_old, elements read)]`` (:func:`plan_read`)."""

        def places(tp: int, dp: int) -> list[Place]:
            out = []
            for t in range(tp):
                box = tp_place(shape, 0 if tp > 1 else None, t, tp)
                out += [Place(box.shape, box.offsets, box.sizes, shard_range(box.numel, d, dp))
                        for d in range(dp)]  # fmt: skip
            return out

        saved, reads_all = places(old_tp, old_dp), []
        for want in places(new_tp, new_dp):
            plan, covered = plan_read(saved, want)
            assert covered == want.numel, (want, covered)  # every shard present
            reads: dict[int, int] = {}
            for k, _, _, n in plan:
                reads[k] = reads.get(k, 0) + n
            reads_all.append(sorted(reads.items()))
        return reads_all

    def node_loss_reshard(self, hidden: int, old: tuple[int, int], new: tuple[int, int]) -> str:
        """S6's node-loss reshard in one line, for 13 and 17 alike: one layer's
        column-parallel MLP weight ``(4h, h)`` saved by ``old = (tp, dp)`` ranks of a pipeline
        stage (tp cuts, ZeRO ranges over dp) and read by ``new = (tp, dp)`` ranks."""
        reads = self.reshard_layout_reads((4 * hidden, hidden), *old, *new)
        most = max(len(r) for r in reads)
        many = sum(len(r) > 1 for r in reads)
        return (f"one layer's ({4 * hidden} x {hidden}) MLP weight, saved as {old[0] * old[1]} "
                f"shards (tp {old[0]} x ZeRO over dp {old[1]}), is read by {new[0] * new[1]} "
                f"ranks (tp {new[0]} x ZeRO over dp {new[1]}): each from {most} old shards "
                f"at most, {many} of them from more than one")


GPT_1P3B = MemoryScenario("gpt2-1.3b", micro_batch=1, gpus=8,
                          card_bytes=value("assume.s3_card_memory"), lesson="11")  # fmt: skip
BERT_4NODES = CommScenario(
    4, 8, AlphaBeta(value("link.nvlink_latency"), 1 / value("a100.nvlink_per_direction")),
    AlphaBeta(value("link.ethernet_latency"), 1 / value("link.ethernet100")), lesson="09",
)  # fmt: skip
GPT_10B_MIXED = PlannerScenario("10B", "a100-80gb-eth100", 4, 256, "10", "rank_layouts")
GPT_100B_3D = PlannerScenario("100B", "dgx-a100-80gb", 8, 512, "08", "plan_3d")
CKPT_100B = CheckpointScenario(
    100e9, value("s6.ckpt_bytes_per_param"), gpus=64, writers=int(value("s6.ckpt_writers")),
    write_bandwidth=value("s6.ckpt_write_bandwidth"),
    interruptions=int(value("failures.interruptions")), days=value("failures.days"),
    on_gpus=int(value("failures.gpus")), restart_seconds=value("s6.restart_seconds"),
    host_link=value("a100.host_link"), host_sharing=int(value("a100.gpus_per_host_uplink")),
    probe_numel=2_000_000, lesson="17",
)  # fmt: skip
SCENARIOS = {"S3": GPT_1P3B, "S4": BERT_4NODES, "S5": GPT_10B_MIXED, "S6": GPT_100B_3D}
