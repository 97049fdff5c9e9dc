"""Pipeline schedules as data: generators, validator and simulator, without processes.

Theory the simulator must reproduce (F = B = W = 1, a full backward costs B + W = 2):
GPipe and 1F1B idle (p-1)/(m+p-1) of the total; interleaved idles (p-1)/(v m) of the ideal
time; ZB-H1's bubble is a third of 1F1B's when m >= p; stash m (GPipe), p - r (1F1B), at most
p (ZB-H1), 2(p-r-1) + (v-1)p + 1 chunks (interleaved, Megatron's warm-up plus one).
"""

from __future__ import annotations

import pytest

from labkit.pipeline import (
    Action,
    Costs,
    Schedule,
    ScheduleError,
    make_schedule,
    simulate,
    validate,
)
from labkit.pipeline.simulator import replay
from labkit.pipeline.stages import check_pipeline

GRID_P = (1, 2, 3, 4, 8)
GRID_M = (1, 2, 3, 4, 8, 16)


def _bubble_time(res) -> float:
    return res.makespan - sum(res.busy) / len(res.busy)


def test_1f1b_small_case_by_hand():
    s = make_schedule("1f1b", 2, 2)
    assert [a.label() for a in s.compute(0)] == ["F0", "F1", "B0", "B1"]
    assert [a.label() for a in s.compute(1)] == ["F0", "B0", "F1", "B1"]
    assert [a.label() for a in s.ranks[1][:4]] == ["rF0<0", "F0", "B0", "sB0>0"]
    res = simulate(s)  # F = 1, full backward = 2
    starts = {
        r: [t.start for t in res.timeline if t.rank == r and t.action.is_compute] for r in (0, 1)
    }
    # rank 1: F0 at 1 (after rank 0's F0), B0 2-4, F1 4-5, B1 5-7; rank 0 waits for the grads
    assert starts[1] == [1, 2, 4, 5]
    assert starts[0] == [0, 1, 4, 7]
    assert res.makespan == 9 and res.peak_stash == [2, 1]
    assert "rank 0 | F0    F1    B0    B1" in s.table()


def test_latency_delays_the_receiver():
    res = replay(make_schedule("gpipe", 2, 1), Costs(F=1, B=1, W=1, latency=0.5))
    f1 = next(t for t in res.timeline if t.rank == 1 and t.action.kind == "F")
    assert f1.start == 1.5  # rank 0's F0 ends at 1, the activation lands 0.5 later
    assert res.makespan == 1 + 0.5 + 1 + 2 + 0.5 + 2


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_1f1b_bubble_and_stash(name):
    for p in GRID_P:
        for m in GRID_M:
            res = simulate(make_schedule(name, p, m))
            assert res.bubble_fraction == pytest.approx((p - 1) / (m + p - 1)), (p, m)
            want = [m] * p if name == "gpipe" else [min(p - r, m) for r in range(p)]
            assert res.peak_stash == want, (p, m)


def test_interleaved_bubble_and_stash():
    for p in GRID_P:
        for v in (2, 3):
            for m in (p, 3 * p):
                res = simulate(make_schedule("interleaved", p, m, v))
                assert res.bubble_over_ideal == pytest.approx((p - 1) / (v * m)), (p, m, v)
                one = simulate(make_schedule("1f1b", p, m))
                assert res.makespan <= one.makespan + 1e-9
                want = [min(2 * (p - r - 1) + (v - 1) * p + 1, m * v) for r in range(p)]
                assert res.peak_stash == want, (p, m, v)


def test_zb_h1_bubble_is_a_third_of_1f1b_with_its_memory():
    for p in GRID_P[1:]:
        for m in GRID_M:
            zb, one = simulate(make_schedule("zb-h1", p, m)), simulate(make_schedule("1f1b", p, m))
            assert max(zb.peak_stash) <= p
            if m >= p:  # (p-1)(F+B-W) against (p-1)(F+B+W)
                assert _bubble_time(zb) == pytest.approx(_bubble_time(one) / 3), (p, m)
            else:
                assert _bubble_time(zb) < _bubble_time(one)


def test_every_generated_schedule_validates_and_sends_match():
    for name, vs in (("gpipe", [1]), ("1f1b", [1]), ("interleaved", [1, 2, 4]), ("zb-h1", [1])):
        for p in GRID_P:
            for m in (p, 2 * p, 3 * p):
                for v in vs:
                    s = validate(make_schedule(name, p, m, v))
                    sends = sum(a.kind.startswith("SEND") for r in s.ranks for a in r)
                    boundaries = (s.num_stages - 1) if p > 1 else 0
                    assert sends == 2 * m * boundaries, (name, p, m, v)


def _deadlocking() -> Schedule:
    """Rank 0 waits for B0's gradient before sending F1; rank 1 waits for F1 before B0."""
    a = Action
    r0 = [
        a("F", 0),
        a("SEND_F", 0, peer=1),
        a("RECV_B", 0, peer=1),
        a("B", 0),
        a("F", 1),
        a("SEND_F", 1, peer=1),
        a("RECV_B", 1, peer=1),
        a("B", 1),
    ]
    r1 = [
        a("RECV_F", 0, peer=0),
        a("F", 0),
        a("RECV_F", 1, peer=0),
        a("F", 1),
        a("B", 0),
        a("SEND_B", 0, peer=0),
        a("B", 1),
        a("SEND_B", 1, peer=0),
    ]
    return Schedule("bad", 2, 2, ranks=[r0, r1])


def test_deadlock_is_rejected_with_its_first_bad_action():
    with pytest.raises(
        ScheduleError, match=r"deadlock: rank 0 blocks at position 2 on rB0\.0<1 \(micro-batch 0\)"
    ) as e:
        validate(_deadlocking())
    assert (e.value.rank, e.value.position, e.value.action) == (0, 2, Action("RECV_B", 0, peer=1))


def test_backward_before_forward_is_rejected():
    s = make_schedule("1f1b", 2, 4)
    r1 = s.ranks[1]
    i, j = r1.index(Action("F", 2)), r1.index(Action("B", 2))
    r1[i], r1[j] = r1[j], r1[i]
    with pytest.raises(
        ScheduleError,
        match=f"rank 1, position {i}, B2.0 \\(micro-batch 2\\): backward before its forward",
    ):
        validate(s)


def test_swapped_receives_meet_the_wrong_tensor():
    s = make_schedule("gpipe", 2, 2)
    r1 = s.ranks[1]
    i, j = r1.index(Action("RECV_F", 0, peer=0)), r1.index(Action("RECV_F", 1, peer=0))
    r1[i], r1[j] = Action("RECV_F", 1, peer=0), Action("RECV_F", 0, peer=0)
    with pytest.raises(ScheduleError, match="forward before its input arrived"):
        validate(s)


def test_other_violations_name_rank_and_place():
    s = make_schedule("1f1b", 2, 2)
    s.ranks[0].insert(0, Action("W", 0))
    with pytest.raises(ScheduleError, match="rank 0, position 0, W0.0"):
        validate(s)
    s = make_schedule("1f1b", 2, 2)
    s.ranks[0] = [a for a in s.ranks[0] if a != Action("B", 1)]
    with pytest.raises(ScheduleError, match="rank 0: never runs B of micro-batch 1"):
        validate(s)
    s = make_schedule("gpipe", 3, 1)
    s.ranks[0][1] = Action("SEND_F", 0, peer=2)
    with pytest.raises(ScheduleError, match="rank 0, position 1, sF0.0>2.*to rank 1, not 2"):
        validate(s)


def test_bad_input_names_the_numbers():
    with pytest.raises(ValueError, match=r"4 pipeline stages \(p=4 x v=1\) but only n_layer=2"):
        check_pipeline(2, 4, 8)
    with pytest.raises(ValueError, match="m=2, p=4"):
        check_pipeline(8, 4, 2, "interleaved", 2)
    check_pipeline(6, 4, 8)  # 6 layers on 4 stages: an uneven cut, no longer refused
    with pytest.raises(ValueError, match=r"layers per stage \[2, 2, 1\] sum to 5, but n_layer=6"):
        check_pipeline(6, 3, 8, layers_per_stage=(2, 2, 1))
    with pytest.raises(
        ValueError, match="n_layer=4 is not divisible by p=2 x v=3 = 6|6 pipeline stages"
    ):
        check_pipeline(4, 2, 4, "interleaved", 3)
    with pytest.raises(ValueError, match="v=2 needs the 'interleaved' schedule"):
        check_pipeline(8, 2, 4, "1f1b", 2)
    with pytest.raises(ValueError, match="unknown schedule 'pipedream'"):
        check_pipeline(8, 2, 4, "pipedream")


def _learner(warmup):
    """A 1F1B-shaped generator with a chosen warm-up rule (the correct one is p - r - 1)."""

    def gen(p, m):
        orders = []
        for r in range(p):
            w = min(warmup(p, r), m)
            order = [Action("F", i) for i in range(w)]
            for i in range(m - w):
                order += [Action("F", w + i), Action("B", i)]
            orders.append(order + [Action("B", i) for i in range(m - w, m)])
        return orders

    return gen


def test_exercise_check_accepts_1f1b_and_names_what_is_wrong():
    from labkit.checks.core import CheckFailed
    from labkit.checks.pipeline import review_1f1b

    assert review_1f1b(_learner(lambda p, r: p - r - 1)).compute(0) == make_schedule(
        "1f1b", 2, 4
    ).compute(0)
    # negative controls: each wrong generator is rejected with the rank and the place
    with pytest.raises(CheckFailed, match=r"deadlock: rank 0 blocks at position \d+ on rB0"):
        review_1f1b(_learner(lambda p, r: r))  # warm-up reversed: rank 0 waits, rank 1 waits
    with pytest.raises(
        CheckFailed, match="rank 0 holds 3 micro-batches' activations.*min\\(p - r, m\\) = 2"
    ):
        review_1f1b(_learner(lambda p, r: p - r))  # one warm-up forward too many

    def backward_first(p, m):
        orders = _learner(lambda p, r: p - r - 1)(p, m)
        orders[-1][0], orders[-1][1] = orders[-1][1], orders[-1][0]
        return orders

    with pytest.raises(
        CheckFailed,
        match=r"rank 1, position \d+, B0.0 \(micro-batch 0\): backward before its forward",
    ):
        review_1f1b(backward_first)

    def gpipe_order(p, m):
        return [
            [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]
            for _ in range(p)
        ]

    with pytest.raises(CheckFailed, match="p=2, m=4: rank 0 holds 4 micro-batches"):
        review_1f1b(gpipe_order)  # valid, but GPipe's memory


def test_split_backward_b_then_w_equals_autograd():
    """weight_grad: B (input gradient only) then W (g^T a, LayerNorm's sums) = one backward."""
    import torch
    from torch import nn

    from labkit.pipeline.weight_grad import WeightGradRecorder, apply_weight_grads, splittable

    torch.manual_seed(0)
    net = nn.Sequential(nn.LayerNorm(6), nn.Linear(6, 5), nn.GELU(), nn.Linear(5, 6, bias=False))
    net[1].bias.requires_grad_(False)  # frozen: must get no gradient
    x = torch.randn(3, 4, 6, requires_grad=True)
    dy = torch.randn(3, 4, 6)
    net(x).backward(dy)
    want = {n: q.grad.clone() for n, q in net.named_parameters() if q.requires_grad}
    want_x = x.grad.clone()
    net.zero_grad(set_to_none=True)
    assert splittable(net) and not splittable(nn.Embedding(3, 2))
    rec = WeightGradRecorder(net)
    with rec.record() as entries:
        y = net(x)
    (dx,) = torch.autograd.grad(y, x, dy)
    assert all(q.grad is None for q in net.parameters())  # B touched no weight
    apply_weight_grads(entries)
    rec.close()
    torch.testing.assert_close(dx, want_x)
    for n, q in net.named_parameters():
        if q.requires_grad:
            torch.testing.assert_close(q.grad, want[n], msg=n)
        else:
            assert q.grad is None, n
