"""Overlapped tensor parallelism (``labkit.tensor_parallel.overlap``) against the plain SP layers.

One launch per world size (tp = 2 and 4) runs every multi-rank case; the tests assert on its
results. Cases: a column-parallel linear whose SP all-gather is decomposed, then a ReLU, then a
row-parallel linear whose reduce-scatter is decomposed, against ``ColumnParallelLinear("gather")``
and ``RowParallelLinear("reduce_scatter")`` on the same weights: output, input gradient and
every parameter gradient after 2 accumulated backward passes, bit for bit in float32 against
labkit's ring collectives (the same summation order), and against torch's gloo collectives
(bit for bit at tp = 2; at tp = 4 gloo adds the four partial sums in another order). Every
point-to-point call of a forward and backward is recorded and replayed under NCCL's rules.
Negative controls: the same ring posting ungrouped irecv-then-isend passes under gloo but is
flagged; a chunk order sent the wrong way round the ring is rejected by ``schedule_problems``
and, run, reorders the result. Off the happy path: a sequence not divisible by tp and shapes
that differ across ranks raise the same ValueError on every rank; a chunk's compute failing
on one rank half-way makes every rank raise (``labkit.collectives.guard``) and leaves the group
usable.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from labkit.collectives.nccl_order import P2PCall, nccl_problems
from labkit.tensor_parallel.overlap_schedule import ag_order, rs_order, schedule_problems
from tests.ranks import run_ranks

# (B, T, d, o): chunks of B * T / t >= 4 rows and local GEMM widths >= 12 (o / t, d): on this
# CPU's MKL a narrower or shorter product takes a kernel whose rounding depends on the row's
# position, so the plain layer's whole GEMM and a chunk's would differ in the last bit
SHAPES = [(2, 16, 32, 48), (3, 24, 40, 48)]


def _run(shape: tuple[int, int, int, int], impl: str, overlapped: bool) -> list[torch.Tensor]:
    """Output and gradients of column -> ReLU -> row on this rank, 2 backward passes summed."""
    from labkit.measure.tp_overlap import layer_outputs

    return layer_outputs(shape, impl, overlapped)


def _equality() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for shape in SHAPES:
        for impl in ("ring", "torch"):
            plain, ovl = _run(shape, impl, False), _run(shape, impl, True)
            out[f"{shape} {impl} equal"] = [torch.equal(a, b) for a, b in zip(plain, ovl)]
            out[f"{shape} {impl} diff"] = max(
                float((a - b).abs().max()) for a, b in zip(plain, ovl)
            )
    return out


class _Ungrouped:
    """A RingSteps posting irecv, then isend, ungrouped: fine under gloo, a deadlock on NCCL."""

    def __new__(cls, group: Any, phase: str = "", timeline: Any = None) -> Any:
        import torch.distributed as dist

        from labkit.tensor_parallel.overlap_ring import RingSteps

        class Ungrouped(RingSteps):
            def start(
                self, step: int, sends: list[torch.Tensor], recvs: list[torch.Tensor]
            ) -> None:
                self._works = [dist.irecv(r, self.left) for r in recvs]
                self._works += [dist.isend(s, self.right) for s in sends]

        return Ungrouped(group, phase, timeline)


def _orders() -> dict[str, Any]:
    """The p2p log of one overlapped forward + backward, and of the ungrouped control."""
    from labkit.collectives.nccl_order import record_p2p
    from labkit.tensor_parallel import overlap

    shape = SHAPES[0]
    _run(shape, "ring", True)  # validated once: the recorded call is the steady state
    logs: dict[str, Any] = {}
    log: list[P2PCall] = []
    with record_p2p(log):
        _run(shape, "ring", True)
    logs["overlapped"] = log
    real = overlap.RingSteps
    overlap.RingSteps = _Ungrouped  # type: ignore[misc,assignment]
    try:
        bad: list[P2PCall] = []
        with record_p2p(bad):
            logs["ungrouped equal"] = all(
                torch.equal(a, b)
                for a, b in zip(_run(shape, "ring", False), _run(shape, "ring", True))
            )
    finally:
        overlap.RingSteps = real  # type: ignore[misc]
    logs["ungrouped"] = bad
    return logs


def _wrong_order() -> dict[str, Any]:
    """all_gather_matmul with the chunks sent the wrong way round the ring (t = 4 only)."""
    import torch.distributed as dist

    from labkit.tensor_parallel.overlap import all_gather_matmul
    from labkit.tensor_parallel.overlap_ring import RingSteps

    r, t = dist.get_rank(), dist.get_world_size()
    shard = torch.full((2, 3, 4), float(r))  # (n, B, d): chunk r holds r everywhere
    got = {}
    wrong_way = lambda rk, tt: [(rk + s) % tt for s in range(tt)]  # noqa: E731
    for name, order in (("right", ag_order), ("wrong", wrong_way)):
        seen: dict[int, float] = {}

        def note(k: int, rows: torch.Tensor, seen: dict[int, float] = seen) -> None:
            seen[k] = float(rows[0, 0, 0])  # the value this rank multiplied as chunk k

        full = all_gather_matmul(shard, note, RingSteps(None), order=order)
        got[name] = (seen, [float(full[k * 2, 0, 0]) for k in range(t)])
    return got


def _off_the_path() -> dict[str, Any]:
    """Uneven sequence, shapes differing across ranks, a failure half-way; then a good call."""
    import torch.distributed as dist

    from labkit.tensor_parallel.overlap import (
        all_gather_linear,
        all_gather_matmul,
        linear_reduce_scatter,
        matmul_reduce_scatter,
    )
    from labkit.tensor_parallel.overlap_ring import RingSteps
    from tests.ranks import value_errors

    r, t = dist.get_rank(), dist.get_world_size()
    w = torch.randn(6, 5)
    out: dict[str, Any] = {}
    out["uneven"] = value_errors([lambda: linear_reduce_scatter(torch.randn(2, 4 * t + 1, 5), w)])
    with torch.autocast("cpu", dtype=torch.bfloat16):  # refused clearly, on every rank
        out["autocast"] = value_errors([lambda: all_gather_linear(torch.randn(2, 4, 5), w)])
    B = 2 if r == 0 else 3  # rank 1.. differ: the message sizes would not match
    out["mismatch"] = value_errors([lambda: all_gather_linear(torch.randn(B, 7, 5), w)])

    def computes(fail: bool) -> Any:  # a chunk's product; rank 0's first one raises
        calls: list[int] = []

        def product(rows: torch.Tensor) -> torch.Tensor:
            calls.append(1)
            if fail and r == 0 and len(calls) == 1:
                raise RuntimeError("injected")
            return rows.sum(-1, keepdim=True).expand(*rows.shape[:2], 6).contiguous()

        return product

    shard = torch.full((2, 3, 5), float(r + 1))  # (n, B, d)
    try:
        ag = computes(fail=True)
        all_gather_matmul(shard, lambda k, rows: ag(rows), RingSteps(None))
        out["ag failure"] = "no error"
    except RuntimeError as exc:
        out["ag failure"] = f"{type(exc).__name__}: {exc}"
    try:
        y, _ = matmul_reduce_scatter(torch.ones(2 * t, 3, 5), computes(True), 6, RingSteps(None))
        out["rs failure"] = "no error"
    except RuntimeError as exc:
        out["rs failure"] = f"{type(exc).__name__}: {exc}"
    out["after"] = _equality()["(2, 16, 32, 48) ring equal"]  # the group is still usable
    return out


def _all_cases(tp: int) -> dict[str, Any]:
    res = {"equality": _equality(), "orders": _orders(), "off": _off_the_path()}
    if tp == 4:
        res["wrong order"] = _wrong_order()
    return res


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2", "tp4"])
def world(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    tp = request.param
    return tp, run_ranks(_all_cases, tp, world_size=tp, timeout=300)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_equal_to_the_plain_sp_layers_bit_for_bit(world: Any, shape: Any) -> None:
    tp, results = world
    for res in results:
        eq = res["equality"]
        assert all(eq[f"{shape} ring equal"]), eq  # labkit's ring: the same sums, same order
        if tp == 2:  # a + b == b + a: torch's gloo too
            assert all(eq[f"{shape} torch equal"]), eq
        assert eq[f"{shape} torch diff"] < 1e-6  # gloo's order at tp = 4: rounding only


def test_every_message_is_nccl_safe_and_the_ungrouped_control_is_flagged(world: Any) -> None:
    tp, results = world
    logs: list[list[P2PCall]] = [res["orders"]["overlapped"] for res in results]
    assert all(logs) and nccl_problems(logs) == []
    assert all(call.batch is not None for log in logs for call in log)
    # column fwd + row fwd + row bwd + column bwd: t - 1 ring batches and one settle each
    assert {len({c.batch for c in log}) for log in logs} == {2 * 4 * tp}
    bad: list[list[P2PCall]] = [res["orders"]["ungrouped"] for res in results]
    assert all(res["orders"]["ungrouped equal"] for res in results)  # gloo cannot tell
    if tp == 2:  # left is right: irecv then send on one pair deadlocks
        assert any("irecv" in p for p in nccl_problems(bad))
    else:  # left and right differ: NCCL's per-pair streams make this order safe, as modelled
        assert nccl_problems(bad) == [] and any(c.batch is None for log in bad for c in log)


def test_schedule_check_accepts_the_ring_and_rejects_wrong_orders() -> None:
    for t in (1, 2, 3, 4, 8):
        assert schedule_problems(ag_order, t) == []
        assert schedule_problems(rs_order, t, "reduce_scatter") == []
    wrong_way = lambda r, t: [(r + s) % t for s in range(t)]  # noqa: E731
    assert any("reordered" in p for p in schedule_problems(wrong_way, 4))
    early = lambda r, t: [(r + 1 + s) % t for s in range(t)]  # noqa: E731
    assert any("before it arrived" in p for p in schedule_problems(early, 2))
    short = lambda r, t: list(range(t - (r == 1)))  # noqa: E731
    assert any("hang" in p for p in schedule_problems(short, 4))
    assert any("ends holding" in p for p in schedule_problems(ag_order, 4, "reduce_scatter"))
    assert any("mixed chunks" in p for p in schedule_problems(wrong_way, 4, "reduce_scatter"))


def test_a_wrong_order_reorders_the_result(world: Any) -> None:
    tp, results = world
    if tp != 4:
        pytest.skip("at tp = 2 both directions are the same ring")
    for res in results:
        (right_seen, right_full), (wrong_seen, wrong_full) = res["wrong order"].values()
        assert right_full == [0.0, 1.0, 2.0, 3.0] and right_seen == {k: float(k) for k in range(4)}
        assert wrong_full != right_full or wrong_seen != right_seen


def test_bad_shapes_raise_on_every_rank_and_a_failure_leaves_the_group_usable(world: Any) -> None:
    tp, results = world
    for r, res in enumerate(results):
        off = res["off"]
        assert f"sequence length {4 * tp + 1} is not divisible by tp={tp}" in off["uneven"][0]
        assert "disagree" in off["mismatch"][0] or "rejected" in off["mismatch"][0]
        assert "autocast is on" in off["autocast"][0]
        for what in ("ag failure", "rs failure"):  # every rank raises, every message matched
            if r == 0:
                assert off[what] == "RuntimeError: injected"
            else:
                assert off[what].startswith("PeerFailed") and "rank 0" in off[what]
        assert all(off["after"])


def _timeline() -> Any:
    from labkit.measure.tp_overlap import layer_timeline

    return layer_timeline((2, 16, 32, 48), impl="ring")


def test_every_transfer_is_posted_before_its_chunk_is_multiplied() -> None:
    """The overlap itself: at every ring step with a message, "post" comes before "compute"
    and the wait after "computed" (an implementation that waited first would fail)."""
    for events in run_ranks(_timeline, world_size=2, timeout=120):
        at = {(ph, st, what): t for ph, st, what, t in events}
        assert {ph for ph, _, _ in at} == {"ag_fwd", "rs_fwd", "ag_bwd", "rs_bwd"}
        posted = [(ph, st) for ph, st, what in at if what == "post"]
        assert len(posted) == 4  # t - 1 = 1 message step per decomposed collective
        for ph, st in posted:
            compute_step = st if ph.startswith("ag") else st + 1  # rs: under the next GEMM
            assert at[(ph, st, "post")] <= at[(ph, compute_step, "compute")]
            assert at[(ph, compute_step, "computed")] <= at[(ph, st, "waited")]


def test_profile_intervals_union_and_overlap() -> None:
    from labkit.measure.tp_overlap import _overlap_s, _union

    assert _union([(3.0, 4.0), (0.0, 1.0), (0.5, 2.0)]) == [(0.0, 2.0), (3.0, 4.0)]
    assert _overlap_s([(0.0, 2.0), (3.0, 4.0)], [(1.0, 3.5)]) == 1.5


def _gpt(impl: str) -> dict[str, Any]:
    """A TP GPT with overlapped SP against the plain SP one and the unsharded GPT: 2 AdamW
    steps of 2 micro-batches; the largest differences of loss, gradients and parameters."""
    from labkit.models import GPT, GPTConfig, lm_loss
    from labkit.tensor_parallel import TPConfig, tensor_parallel, vocab_parallel_cross_entropy

    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=48, dropout=0.0,
                    attention="explicit")  # fmt: skip
    torch.manual_seed(0)
    ref = GPT(cfg)
    models = {
        "plain": tensor_parallel(ref, None, TPConfig(sequence_parallel=True, impl=impl)),
        "ovl": tensor_parallel(
            ref, None, TPConfig(sequence_parallel=True, impl=impl, overlap=True)
        ),
    }
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-2) for k, m in models.items()}
    opts["ref"] = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    out = {"loss": 0.0, "grads": 0.0, "params": 0.0, "vs plain": 0.0}
    for step in range(2):
        for micro in range(2):
            g = torch.Generator().manual_seed(10 * step + micro)
            idx, tgt = (
                torch.randint(0, 64, (2, 16), generator=g),
                torch.randint(0, 64, (2, 16), generator=g),
            )
            want = lm_loss(ref(idx), tgt)
            (want / 2).backward()
            for name, m in models.items():
                loss = vocab_parallel_cross_entropy(m(idx), tgt, m.comms["loss"])
                (loss / 2).backward()
                if name == "ovl":
                    out["loss"] = max(out["loss"], abs(loss.item() - want.item()))
        for m in models.values():
            m.finish_grads()  # the SP parameters' partial gradients summed over tp
        grads = {k: m.gather_full(grads=True) for k, m in models.items()}
        for n, p in ref.named_parameters():
            assert p.grad is not None
            out["grads"] = max(out["grads"], float((grads["ovl"][n] - p.grad).abs().max()))
            out["vs plain"] = max(
                out["vs plain"], float((grads["ovl"][n] - grads["plain"][n]).abs().max())
            )
        for opt in opts.values():
            opt.step()
            opt.zero_grad()
    params = models["ovl"].gather_full()
    out["params"] = max(float((params[n] - p).abs().max()) for n, p in ref.named_parameters())
    out["names"] = sorted(params) == sorted(n for n, _ in ref.named_parameters())
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_a_tp_gpt_with_overlapped_sp_trains_like_the_unsharded_one(tp: int) -> None:
    for res in run_ranks(_gpt, "ring" if tp == 4 else "torch", world_size=tp, timeout=240):
        assert res["names"]
        assert res["loss"] < 1e-5 and res["grads"] < 1e-5 and res["params"] < 1e-4, res
        assert res["vs plain"] < 1e-6, res  # q, k, v fused: their dX summed in another order


def test_overlap_needs_sequence_parallelism() -> None:
    from labkit.tensor_parallel import TPConfig

    with pytest.raises(ValueError, match="needs sequence_parallel=True"):
        TPConfig(overlap=True)


# ----------------------------------------------------------------------------- exercise check
def _solution(shard: torch.Tensor, weight: torch.Tensor, ring: Any) -> torch.Tensor:
    from torch.nn import functional as F

    t, n = ring.size, shard.shape[0]
    full = shard.new_empty(t * n, *shard.shape[1:])
    out = shard.new_empty(t * n, shard.shape[1], weight.shape[0])
    rows = [full[k * n : (k + 1) * n] for k in range(t)]
    rows[ring.rank].copy_(shard)
    for s, k in enumerate(ag_order(ring.rank, t)):
        if s < t - 1:
            ring.start(s, sends=[rows[k]], recvs=[rows[(k - 1) % t]])
        out[k * n : (k + 1) * n] = F.linear(rows[k], weight)
        if s < t - 1:
            ring.wait(s)
    return out


def _wait_first(shard: torch.Tensor, weight: torch.Tensor, ring: Any) -> torch.Tensor:
    """Right values, no overlap: every transfer waited for before its matmul."""
    from torch.nn import functional as F

    t, n = ring.size, shard.shape[0]
    full = shard.new_empty(t * n, *shard.shape[1:])
    rows = [full[k * n : (k + 1) * n] for k in range(t)]
    rows[ring.rank].copy_(shard)
    for s, k in enumerate(ag_order(ring.rank, t)[:-1]):
        ring.start(s, sends=[rows[k]], recvs=[rows[(k - 1) % t]])
        ring.wait(s)
    return F.linear(full, weight)


def _wrong_way(shard: torch.Tensor, weight: torch.Tensor, ring: Any) -> torch.Tensor:
    """Receives into the place of chunk r + s + 1: reorders at t = 4."""
    from torch.nn import functional as F

    t, n = ring.size, shard.shape[0]
    full = shard.new_empty(t * n, *shard.shape[1:])
    out = shard.new_empty(t * n, shard.shape[1], weight.shape[0])
    rows = [full[k * n : (k + 1) * n] for k in range(t)]
    rows[ring.rank].copy_(shard)
    for s in range(t):
        k = (ring.rank + s) % t
        if s < t - 1:
            ring.start(s, sends=[rows[k]], recvs=[rows[(k + 1) % t]])
        out[k * n : (k + 1) * n] = F.linear(rows[k], weight)
        if s < t - 1:
            ring.wait(s)
    return out


def _ungrouped(shard: torch.Tensor, weight: torch.Tensor, ring: Any) -> torch.Tensor:
    """Right values and overlap, but irecv then isend ungrouped: hangs on NCCL at t = 2."""
    import torch.distributed as dist
    from torch.nn import functional as F

    t, n = ring.size, shard.shape[0]
    full = shard.new_empty(t * n, *shard.shape[1:])
    out = shard.new_empty(t * n, shard.shape[1], weight.shape[0])
    rows = [full[k * n : (k + 1) * n] for k in range(t)]
    rows[ring.rank].copy_(shard)
    for s, k in enumerate(ag_order(ring.rank, t)):
        works = []
        if s < t - 1:
            ring.events.append(("start", s))
            works = [dist.irecv(rows[(k - 1) % t], ring.left), dist.isend(rows[k], ring.right)]
        out[k * n : (k + 1) * n] = F.linear(rows[k], weight)
        for w in works:
            w.wait()
        if works:
            ring.events.append(("wait", s))
    return out


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (_solution, None),
        (_wait_first, "hides nothing"),
        (_wrong_way, "holds rank"),
        (_ungrouped, "under NCCL"),
    ],  # fmt: skip
    ids=["solution", "wait_first", "wrong_way", "ungrouped"],
)
def test_exercise_check_accepts_the_ring_and_rejects_each_wrong_approach(
    fn: Any, message: Any
) -> None:
    from labkit.checks.core import CheckFailed
    from labkit.checks.tp_overlap import judge, run_on_rank

    failures = []
    for t in (2, 4):
        try:
            judge(run_ranks(run_on_rank, fn, world_size=t, timeout=120))
        except CheckFailed as exc:
            failures.append(str(exc))
    if message is None:
        assert failures == []
    else:
        assert failures and message in failures[0], failures
