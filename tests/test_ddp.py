"""DDP from scratch, the spec: every variant equals single-process training, step by step.

One launch per world size runs every variant (plus torch DDP, plus deliberately broken
mutants that the harness must catch) with and without gradient accumulation, and returns
each rank's parameters after every step; all assertions happen here, in the test process.
"""

from __future__ import annotations

import pytest
import torch

from labkit.checks.core import CheckFailed
from labkit.checks.ddp import check_overlapped_ddp
from labkit.ddp import VARIANTS, BucketedDDP, DataParallel, OverlappedDDP, partition_buckets
from labkit.ddp import equivalence as eq
from tests.ranks import run_ranks

STEPS = 4
ACCUMS = (1, 3)
OURS = ("naive", "flat", "bucketed", "overlapped", "overlapped_ring", "overlapped_one_bucket",
        "overlapped_views")  # fmt: skip
TINY_BUCKET_MB = 0.0005  # ~520 bytes: AwkwardNet (3 KB of gradients) splits into several buckets


def _rank_job(accums: tuple[int, ...], with_mutants: bool) -> dict:
    """Runs on every rank (pickled by value: defined before use, no test-module imports)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from labkit.collectives import Comm
    from labkit.ddp import VARIANTS, FlatDDP
    from labkit.ddp import equivalence as eq

    ring = {}  # the Comm of the last "overlapped_ring" model: its counters say it was used

    def with_ring(m):
        ring["comm"] = Comm(None, impl="ring")
        return VARIANTS["overlapped"](m, comm=ring["comm"], **small)

    small = {"bucket_cap_mb": TINY_BUCKET_MB}
    wraps = {
        "naive": lambda m: VARIANTS["naive"](m),
        "flat": lambda m: VARIANTS["flat"](m),
        "bucketed": lambda m: VARIANTS["bucketed"](m, **small),
        "overlapped": lambda m: VARIANTS["overlapped"](m, **small),
        "overlapped_ring": with_ring,
        "overlapped_one_bucket": lambda m: VARIANTS["overlapped"](m, bucket_cap_mb=25.0),
        "overlapped_views": lambda m: VARIANTS["overlapped"](m, grad_as_bucket_view=True, **small),
        "torch_ddp": lambda m: DDP(m, find_unused_parameters=True),
    }
    if with_mutants:

        class ZerosForUnused(FlatDDP):  # forgets that "no rank used it" means grad=None
            def unpack(self, buf, params):
                super().unpack(buf, params)
                for p in params:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)

        class NoBroadcast(FlatDDP):
            def _broadcast_from_rank0(self):
                pass

        def summing(m):  # sums instead of averaging
            w = FlatDDP(m)
            w.world_size = 1
            return w

        wraps.update(
            mutant_sum=summing, mutant_zeros=ZerosForUnused, mutant_no_broadcast=NoBroadcast
        )

    out: dict = {"runs": {}}
    for accum in accums:
        for name, wrap in wraps.items():
            out["runs"][(name, accum)] = eq.train_distributed(wrap, steps=STEPS, accum=accum)
            if name == "overlapped_ring":
                out[("ring_calls", accum)] = ring["comm"].calls["all_reduce"]

    # group=: ranks 1 and 2 of 3 train as their own data-parallel group; rank 0 sits it out.
    if dist.get_world_size() == 3:
        sub = dist.new_group([1, 2])  # every rank must create it, members or not
        if dist.get_rank() in (1, 2):
            for name in ("naive", "overlapped"):
                wrap = lambda m, c=VARIANTS[name]: c(m, group=sub)  # noqa: E731
                out[("subgroup", name)] = eq.train_distributed(
                    wrap, steps=STEPS, accum=3, group=sub
                )[0]
            ring_on_sub = lambda m: VARIANTS["overlapped"](m, comm=Comm(sub, impl="ring"))  # noqa: E731
            out[("subgroup", "overlapped_ring")] = eq.train_distributed(
                ring_on_sub, steps=STEPS, accum=3, group=sub
            )[0]
            try:  # a Comm over WORLD with group=sub: refused before any broadcast
                VARIANTS["overlapped"](eq.AwkwardNet(), group=sub, comm=Comm(None))
                out["comm_group_mismatch"] = "no error"
            except ValueError as exc:
                out["comm_group_mismatch"] = str(exc)

    # grad_as_bucket_view: each .grad a view into a bucket after the sync (and only then); with
    # zero_grad(set_to_none=False) backward accumulates into those views, and training must
    # equal the copying mode's under the same zeroing.
    for name in ("overlapped", "overlapped_views"):
        model = wraps[name](eq.AwkwardNet())
        x, y, _ = eq.make_batches(1, 1, 12)[0]
        torch.nn.functional.cross_entropy(model(x, torch.ones(12, dtype=torch.bool)), y).backward()
        model.finish_gradient_sync()
        bufs = [b.untyped_storage().data_ptr() for b, _ in model._comm_buffers.values()]
        grads = [p.grad for p in model.params if p.grad is not None]
        out[("in_bucket", name)] = [g.untyped_storage().data_ptr() in bufs for g in grads]
        out[("keep_grads", name)] = eq.train_distributed(
            wraps[name], steps=STEPS, accum=3, set_to_none=False
        )[0]

    # One recorded step of each bucketed flavour, for the timeline invariants.
    for name in ("bucketed", "overlapped"):
        model = wraps[name](eq.AwkwardNet())
        model.record_events = True
        x, y, _ = eq.make_batches(1, 1, 12)[0]
        mask = torch.ones(12, dtype=torch.bool)  # every parameter used: no bucket stalls
        torch.nn.functional.cross_entropy(model(x, mask), y).backward()
        model.finish_gradient_sync()
        out[("events", name)] = [(e.kind, e.name, e.start, e.end) for e in model.events]
        out[("buckets", name)] = len(model.buckets)

    # Backward twice without no_sync() must be refused, naming a parameter.
    model = wraps["overlapped"](eq.AwkwardNet())
    x, y, mask = eq.make_batches(1, 1, 12)[0]
    try:
        for _ in range(2):
            torch.nn.functional.cross_entropy(model(x, mask), y).backward()
        out["double_backward"] = "no error"
    except RuntimeError as exc:
        out["double_backward"] = str(exc)
    dist.barrier()
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def world(request):
    w = request.param
    results = run_ranks(_rank_job, ACCUMS, w == 2, world_size=w, timeout=120)
    refs = {a: eq.train_reference(STEPS, a) for a in ACCUMS}
    return w, results, refs


@pytest.mark.timeout(150)
@pytest.mark.parametrize("variant", OURS)
def test_variant_equals_single_process_every_step(world, variant):
    w, results, refs = world
    for accum in ACCUMS:
        for rank in range(w):
            snaps, _ = results[rank]["runs"][(variant, accum)]
            miss = eq.first_divergence(refs[accum], snaps)
            assert miss is None, f"{variant}, world_size={w}, accum={accum}, rank {rank}: {miss}"


@pytest.mark.timeout(150)
@pytest.mark.parametrize("variant", [*OURS, "torch_ddp"])
def test_parameters_bit_identical_across_ranks(world, variant):
    w, results, _ = world
    for accum in ACCUMS:
        rank0, _ = results[0]["runs"][(variant, accum)]
        for rank in range(1, w):
            other, _ = results[rank]["runs"][(variant, accum)]
            for step, (a, b) in enumerate(zip(rank0, other)):
                for name in a:
                    assert torch.equal(a[name], b[name]), (
                        f"{variant}: rank {rank} != rank 0 at step {step}, {name}"
                    )


@pytest.mark.timeout(150)
@pytest.mark.parametrize("variant", OURS)
def test_variant_matches_torch_ddp(world, variant):
    w, results, refs = world
    for accum in ACCUMS:
        ours, _ = results[0]["runs"][(variant, accum)]
        theirs, _ = results[0]["runs"][("torch_ddp", accum)]
        assert eq.first_divergence(refs[accum], theirs) is None  # the reference itself is right
        miss = eq.first_divergence(theirs, ours)
        assert miss is None, f"{variant} vs torch DDP (world_size={w}, accum={accum}): {miss}"


@pytest.mark.timeout(150)
def test_grads_as_bucket_views_are_views_and_survive_zeroing_in_place(world):
    w, results, _ = world
    for rank in range(w):
        views, copies = (
            results[rank][("in_bucket", n)] for n in ("overlapped_views", "overlapped")
        )
        assert views and all(views), f"rank {rank}: a .grad is not a view into its bucket: {views}"
        assert copies and not any(copies), f"rank {rank}: the copying mode aliased its bucket"
        kept = [results[rank][("keep_grads", n)] for n in ("overlapped", "overlapped_views")]
        miss = eq.first_divergence(kept[0], kept[1], reference="the copying mode")
        assert miss is None, f"views under zero_grad(set_to_none=False), rank {rank}: {miss}"


@pytest.mark.timeout(150)
def test_frozen_parameter_never_moves_and_tied_weight_reduced_once(world):
    w, results, refs = world
    torch.manual_seed(0)  # the reference's seed: rank 0's frozen weight, broadcast to all
    frozen0 = eq.AwkwardNet().frozen.weight.detach()
    for variant in OURS:
        for accum in ACCUMS:
            snaps, reduced = results[w - 1]["runs"][(variant, accum)]
            assert all(torch.equal(s["frozen.weight"], frozen0) for s in snaps), variant
            # tied.weight is one Parameter used twice: counted once, frozen.weight not at all
            assert reduced == [eq.trainable_numel()] * STEPS, (variant, reduced)


@pytest.mark.timeout(150)
def test_explicit_subgroup_averages_over_its_members_only(world):
    w, results, refs = world
    if w != 3:
        pytest.skip("the subgroup case runs on 3 ranks")
    assert ("subgroup", "naive") not in results[0]
    for rank in (1, 2):
        for name in ("naive", "overlapped", "overlapped_ring"):
            miss = eq.first_divergence(refs[3], results[rank][("subgroup", name)])
            assert miss is None, f"{name} on group [1, 2], rank {rank}: {miss}"
        mismatch = results[rank]["comm_group_mismatch"]
        assert "comm runs over group" in mismatch and "group=" in mismatch, mismatch


@pytest.mark.timeout(150)
def test_the_comm_passed_in_is_the_one_used(world):
    _, results, _ = world
    buckets = results[0][("buckets", "overlapped")]
    assert buckets >= 3
    for accum in ACCUMS:  # one ring all-reduce per bucket per optimizer step, none in no_sync
        assert results[0][("ring_calls", accum)] == buckets * STEPS


@pytest.mark.timeout(150)
def test_overlapped_starts_allreduce_during_backward_bucketed_after(world):
    _, results, _ = world
    for name in ("bucketed", "overlapped"):
        events = results[0][("events", name)]
        (bwd,) = [e for e in events if e[0] == "backward"]
        comms = [e for e in events if e[0] == "allreduce"]
        assert len(comms) == results[0][("buckets", name)] >= 3
        assert all(e[2] <= e[3] for e in events)
        if name == "overlapped":
            assert comms[0][2] < bwd[3], "first bucket must be sent before backward ends"
        else:
            assert all(c[2] >= bwd[3] for c in comms)


@pytest.mark.timeout(150)
def test_harness_catches_broken_ddp(world):
    """The spec can fail: each mutant is caught, and the report names the culprit."""
    w, results, refs = world
    if w != 2:
        pytest.skip("mutants run on 2 ranks only")
    runs = results[1]["runs"]  # rank 1: with no broadcast, rank 0 would still look right
    assert eq.first_divergence(refs[1], runs[("mutant_sum", 1)][0]) is not None
    zeros = eq.first_divergence(refs[1], runs[("mutant_zeros", 1)][0])
    assert zeros is not None and "extra." in zeros, zeros
    assert eq.first_divergence(refs[1], runs[("mutant_no_broadcast", 1)][0]) is not None
    assert (
        "produced twice" in results[0]["double_backward"]
        and "no_sync" in results[0]["double_backward"]
    )


def test_partition_buckets_keeps_order_and_cap():
    assert partition_buckets([4, 4, 4, 10, 1], cap_bytes=8) == [[0, 1], [2, 3], [4]]
    assert partition_buckets([100, 1, 1], cap_bytes=8) == [[0], [1, 2]]
    assert partition_buckets([], cap_bytes=8) == []
    sizes = [3, 7, 1, 9, 2, 2, 5]
    flat = [i for b in partition_buckets(sizes, cap_bytes=6) for i in b]
    assert flat == list(range(len(sizes)))
    with pytest.raises(ValueError, match="positive"):
        partition_buckets([1], cap_bytes=0)


def test_bad_arguments_fail_before_any_communication():
    # no process group exists here: each error must come before the first collective
    for cls in (BucketedDDP, OverlappedDDP):
        with pytest.raises(ValueError, match="bucket_cap_mb must be > 0, got -1"):
            cls(eq.AwkwardNet(), bucket_cap_mb=-1)
    for cls in (DataParallel, *VARIANTS.values()):
        with pytest.raises(
            RuntimeError, match=f"{cls.__name__} needs torch.distributed initialised"
        ):
            cls(eq.AwkwardNet())


# ---- the exercise check -------------------------------------------------------------------


class _BlockingHooks(OverlappedDDP):
    """A plausible learner shortcut: start the bucket's all-reduce in the hook, then wait for it
    right there. Numbers right, started during backward, but backward stalls on every bucket."""

    def _launch(self, k):
        super()._launch(k)
        self.inflight[-1][2].wait()


class _ZerosForUnused(OverlappedDDP):
    """A plausible learner bug: a parameter no rank used gets a zero gradient, not None."""

    def unpack(self, buf, params):
        super().unpack(buf, params)
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.usefixtures("checks_on_warm_ranks")
def test_exercise_check_passes_ours_and_names_the_first_divergence(capsys):
    check_overlapped_ddp(OverlappedDDP)
    assert "PASSED" in capsys.readouterr().out
    with pytest.raises(
        CheckFailed, match=r"after step 1, parameter 'extra\.(weight|bias)'.*\n.*grad=None"
    ):
        check_overlapped_ddp(_ZerosForUnused)
    with pytest.raises(CheckFailed, match="nothing overlaps"):
        check_overlapped_ddp(BucketedDDP)  # right numbers, all sent after backward
    with pytest.raises(CheckFailed, match=r"backward stalls: bucket 0's all-reduce was waited"):
        check_overlapped_ddp(_BlockingHooks)  # right numbers, started in the hook, but blocking
    with pytest.raises(CheckFailed, match="subclass of labkit.ddp.BucketedDDP"):
        check_overlapped_ddp(torch.nn.Linear)
