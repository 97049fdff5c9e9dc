"""Every communication pattern labkit builds, off the happy path (issue 34, defects 7 and 8).

One table, one warm 4-rank world (``tests/ranks.py``), one call. For each pattern (the ring,
tuned ring, tree and hierarchical all-reduces, the all-to-all, ring attention, Ulysses,
pipeline send/recv, expert-parallel dispatch (Ulysses and the experts faulted once in their
forward and once in their backward; ring attention in its backward), and the tuned ring as
``Comm`` calls it, with
``check=False``: no check, no settle, the peers of a failing rank complete instead of raising)
every rank runs these steps in order, on the same group:

1. ``shape``: one rank (rank 1) passes another shape; 2. ``dtype``: another dtype. Each must
   be a ValueError on EVERY rank (gloo would abort a rank with SIGABRT, NCCL would hang);
3. ``ok``: a correct call, checked against a reference each rank computes alone;
4. ``fault1``: an exception injected half-way on rank 1 (a compute step of the pattern,
   monkeypatched to raise on its n-th call, after messages were posted): rank 1 gets its own
   exception, every other rank :class:`~labkit.collectives.guard.PeerFailed`, nobody hangs;
5. ``ok``: the next correct call on the same group returns the right result;
6. ``fault_all``: the exception on every rank; 7. ``ok`` again.

Every point-to-point message of the table is recorded (``nccl_order.record_p2p``) and replayed
under NCCL's matching rules: the send-only schedules of failing ranks must match too. Negative
controls, each in its own short call (the world restarts after them): Ulysses with its shape
check switched off (gloo aborts a rank: not "a ValueError on every rank"), and ring attention
with its guard replaced by a pass-through (the failing rank leaves the ring half-way: the
group wedges, caught by the call's timeout or by a wrong next result).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from labkit.collectives.nccl_order import nccl_problems
from tests.ranks import run_ranks

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ranks cannot import tests/

WORLD = 4
UNCHECKED = "tuned ring, check=False"
STEPS = ("shape", "dtype", "ok", "fault1", "ok", "fault_all", "ok")


class Injected(RuntimeError):
    """The exception the table injects half-way through a pattern."""


@contextlib.contextmanager
def _raising(module: str, attr: str, nth: int) -> Iterator[list[int]]:
    """``module.attr`` raises :class:`Injected` on its ``nth`` call while active."""
    mod = importlib.import_module(module)
    original = getattr(mod, attr)
    calls = [0]

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == nth:
            raise Injected(f"injected into {attr}, call {nth}")
        return original(*args, **kwargs)

    setattr(mod, attr, wrapper)
    try:
        yield calls
    finally:
        setattr(mod, attr, original)


def _odd(variant: str) -> bool:
    """Whether this rank is the one that disagrees in a ``shape``/``dtype`` step."""
    return dist.get_rank() == 1 and variant in ("shape", "dtype")


def _dtype(variant: str) -> torch.dtype:
    return torch.float64 if variant == "dtype" and _odd(variant) else torch.float32


def _seeded(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


# ---- the patterns: each returns True when its result is right ---------------------------


def _all_reduce(name: str, check: bool = True) -> Callable[[str, dict[str, Any]], bool]:
    def case(variant: str, ctx: dict[str, Any]) -> bool:
        from labkit import collectives as c

        n = 41 if variant == "shape" and _odd(variant) else 40
        xs = [_seeded((n,), 100 + r) for r in range(WORLD)]
        x = xs[dist.get_rank()].to(_dtype(variant), copy=True)  # in place: keep xs
        if name == "hierarchical":
            c.hierarchical_all_reduce(x, ctx["nodes"], check=check)
        else:
            fn = {"ring": c.ring_all_reduce, "tuned ring": c.tuned_all_reduce}.get(name)
            (fn or c.recursive_doubling_all_reduce)(x, check=check)
        return torch.allclose(x.float(), sum(xs), atol=1e-5)

    return case


def _rows(src: int, dst: int) -> int:
    return (src + 2 * dst) % 3 + 1  # uneven, never empty


def _all_to_all(variant: str, ctx: dict[str, Any]) -> bool:
    from labkit.collectives.all_to_all import all_to_all

    rank, width = dist.get_rank(), 4 if variant == "shape" and _odd(variant) else 3
    send = [_rows(rank, q) for q in range(WORLD)]
    recv = [_rows(q, rank) for q in range(WORLD)]
    inputs = [_seeded((sum(_rows(r, q) for q in range(WORLD)), 3), 200 + r) for r in range(WORLD)]
    x = torch.randn(sum(send), width) if width != 3 else inputs[rank]
    out = torch.empty(sum(recv), width, dtype=_dtype(variant))
    all_to_all(out, x.to(_dtype(variant)), recv, send)
    want = [inputs[q].split([_rows(q, d) for d in range(WORLD)])[rank] for q in range(WORLD)]
    return torch.allclose(out.float(), torch.cat(want))


def _attention(kind: str) -> Callable[[str, dict[str, Any]], bool]:
    """Ring attention (zigzag, causal, forward and backward) or Ulysses, against SDPA."""

    def case(variant: str, ctx: dict[str, Any]) -> bool:
        import torch.nn.functional as F

        from labkit.context_parallel import ring_attention, shard_sequence, ulysses_attention

        rank, scheme = dist.get_rank(), "zigzag" if kind == "ring" else "contiguous"
        s = 16
        if variant == "shape" and _odd(variant):  # ring: local 6 against 4; Ulysses: 5 rows
            s = 24 if kind == "ring" else 20
        dtype = ctx.get("dtype", _dtype(variant))
        full = [_seeded((1, 4, s, 4), 300 + i).to(dtype) for i in range(4)]  # q, k, v, dout
        leaves = [t.clone().requires_grad_() for t in full[:3]]
        want = F.scaled_dot_product_attention(*leaves, is_causal=True)
        want.backward(full[3])
        expect = [want.detach()] + [t.grad for t in leaves]

        def shard(t: torch.Tensor) -> torch.Tensor:  # Ulysses: rank r's contiguous s/cp rows
            if kind == "ring":
                return shard_sequence(t, WORLD, rank, scheme)
            return t[..., rank * (s // WORLD) : (rank + 1) * (s // WORLD), :]

        mine = [shard(t).requires_grad_() for t in full[:3]]
        if kind == "ring":
            o = ring_attention(*mine, causal=True, scheme=scheme)
        else:
            o = ulysses_attention(*mine, causal=True)
        o.backward(shard(full[3]))
        got = [o.detach()] + [t.grad for t in mine]
        tol = 1e-9 if dtype == torch.float64 else 1e-4
        return all(torch.allclose(g, shard(e), atol=tol) for g, e in zip(got, expect))

    return case


def _pipeline(variant: str, ctx: dict[str, Any]) -> bool:
    """1F1B over the 4 ranks, m = 4: the last stage's loss and every stage's gradients
    against the same stages chained in one process."""
    from labkit.models.gpt import lm_loss
    from labkit.pipeline import make_schedule
    from labkit.pipeline.equivalence import PipeCase, _model, micro_batches
    from labkit.pipeline.executor import pipeline_step
    from labkit.pipeline.stages import build_stages

    rank, case = dist.get_rank(), PipeCase()
    sched = make_schedule("1f1b", WORLD, case.m)
    inputs, targets = micro_batches(case, 0)
    everyone = [build_stages(_model(case), r, WORLD)[0] for r in range(WORLD)]
    ref_loss = 0.0
    for x, t in zip(inputs, targets):  # the reference: the four stages chained
        h = x
        for stage in everyone:
            h = stage(h)
        loss = lm_loss(h, t) / case.m
        loss.backward()
        ref_loss += loss.item()
    chunk = build_stages(_model(case), rank, WORLD)[0]
    if ctx.get("fault"):  # this rank's stage raises at its second micro-batch's forward
        calls, forward = [0], chunk.forward

        def failing(x: torch.Tensor) -> torch.Tensor:
            calls[0] += 1
            if calls[0] == 2:
                raise Injected("injected into the stage's forward, micro-batch 1")
            return forward(x)

        chunk.forward = failing  # type: ignore[method-assign]
    batch = 3 if variant == "shape" and _odd(variant) else case.batch
    shape = (batch, case.seq, case.cfg.n_embd)
    res = pipeline_step(sched, [chunk], inputs, targets, shape, dtype=_dtype(variant))
    ref = dict(everyone[rank].named_parameters())
    grads_ok = all(
        torch.allclose(q.grad, ref[n].grad, atol=1e-6)  # type: ignore[arg-type]
        for n, q in chunk.named_parameters()
        if q.requires_grad
    )
    loss_ok = res.loss is None or abs(res.loss - ref_loss) < 1e-5  # on the last stage
    return grads_ok and loss_ok


def _experts(variant: str, ctx: dict[str, Any]) -> bool:
    """Expert parallelism over the 4 ranks (one expert each, top-2, dropless) against the
    whole layer on this rank's tokens: outputs and input gradients."""
    from labkit.experts.layer import MoELayer
    from labkit.experts.parallel import ExpertParallelMoE

    torch.manual_seed(0)
    layer = MoELayer(8, 16, 4, top_k=2, capacity_factor=None)
    moe = ExpertParallelMoE(layer, dist.group.WORLD)
    if ctx.get("fault"):  # this rank's experts raise, after the dispatch was sent

        def failing(*args: Any) -> torch.Tensor:
            raise Injected("injected into the experts")

        moe.experts.forward = failing  # type: ignore[method-assign]
    d = 9 if variant == "shape" and _odd(variant) else 8
    x = _seeded((6 + dist.get_rank(), d), 400 + dist.get_rank()).to(_dtype(variant))
    x.requires_grad_()
    y = moe(x)
    y.square().sum().backward()
    ref_x = x.detach().clone().requires_grad_()
    ref = layer(ref_x)
    ref.square().sum().backward()
    return torch.allclose(y, ref, atol=1e-5) and torch.allclose(x.grad, ref_x.grad, atol=1e-5)  # type: ignore[arg-type]


# name -> (the case, the compute step the faults are injected into: (module, attr, n-th call);
# None: the case injects its own, a stage or the experts failing)
TABLE: dict[str, tuple[Callable[[str, dict[str, Any]], bool], tuple[str, str, int] | None]] = {
    "ring": (_all_reduce("ring"), ("labkit.collectives.common", "combine_", 2)),
    "tuned ring": (_all_reduce("tuned ring"), ("labkit.collectives.ring_tuned", "combine_", 1)),
    "tree": (_all_reduce("tree"), ("labkit.collectives.tree", "combine_", 1)),
    "hierarchical": (_all_reduce("hierarchical"), ("labkit.collectives.tree", "combine_", 1)),
    "all-to-all": (_all_to_all, ("labkit.collectives.all_to_all", "_own_piece", 1)),
    "ring attention": (
        _attention("ring"),
        ("labkit.context_parallel.ring", "tile_backward", 2),
    ),
    "ulysses": (_attention("ulysses"), ("labkit.context_parallel.ulysses", "_local_attention", 1)),
    "ulysses backward": (
        _attention("ulysses"),
        ("labkit.context_parallel.ulysses", "_local_grads", 1),
    ),
    "pipeline send/recv": (_pipeline, None),
    "expert dispatch": (_experts, None),
    "expert dispatch backward": (_experts, ("labkit.experts.parallel", "_local_backward", 1)),
    # Comm's hot path: no check, no settle; a failing rank's peers complete, the group lives
    UNCHECKED: (
        _all_reduce("tuned ring", check=False),
        ("labkit.collectives.ring_tuned", "combine_", 1),
    ),
}


def _outcome(fn: Callable[[], bool]) -> str:
    from labkit.collectives.guard import PeerFailed

    try:
        return "ok" if fn() else "wrong result"
    except ValueError as exc:
        return f"ValueError: {exc}"
    except PeerFailed:
        return "PeerFailed"
    except Injected:
        return "Injected"
    except Exception as exc:  # noqa: BLE001 - reported, and the test fails on it
        return f"other {type(exc).__name__}: {exc}"


def _step(name: str, step: str, ctx: dict[str, Any]) -> str:
    from labkit.collectives.common import DEFAULT_POOL

    case, seam = TABLE[name]
    rank = dist.get_rank()
    if step in ("shape", "dtype") and name == UNCHECKED:
        return "not checked"  # check=False promises no check: a mismatch would abort gloo
    if step in ("shape", "dtype"):
        DEFAULT_POOL.clear()  # a cached combination must not hide the check (guard.py's price)
        return _outcome(lambda: case(step, ctx))
    if step == "ok":
        return _outcome(lambda: case("ok", ctx))
    failing = step == "fault_all" or rank == 1
    if seam is None:
        return _outcome(lambda: case("ok", {**ctx, "fault": failing}))
    if not failing:
        return _outcome(lambda: case("ok", ctx))
    with _raising(*seam) as calls:
        outcome = _outcome(lambda: case("ok", ctx))
    return outcome if calls[0] >= seam[2] else f"the fault never fired ({calls[0]} calls)"


def _table(names: list[str]) -> dict[str, Any]:
    from labkit.collectives import node_groups
    from labkit.collectives.nccl_order import record_p2p

    ctx: dict[str, Any] = {"nodes": node_groups(2)}
    out: dict[str, Any] = {}
    log: list[Any] = []
    with record_p2p(log):
        for name in names:
            out[name] = [_step(name, step, ctx) for step in STEPS]
        # defect 8's first half: float64 ring attention, default kernel, forward and backward
        out["ring attention float64"] = _outcome(
            lambda: _attention("ring")("ok", {"dtype": torch.float64})
        )
    out["log"] = log
    return out


@pytest.mark.timeout(400)
def test_every_pattern_refuses_mismatches_and_survives_a_failure_half_way() -> None:
    results = run_ranks(_table, list(TABLE), world_size=WORLD, timeout=360)
    for name in TABLE:
        rows = [res[name] for res in results]  # rows[rank][step]
        for i, step in enumerate(STEPS):
            got = [row[i] for row in rows]
            if step in ("shape", "dtype") and name == UNCHECKED:
                assert got == ["not checked"] * WORLD
            elif step in ("shape", "dtype"):
                assert all(g.startswith("ValueError") for g in got), (name, step, got)
            elif step == "ok":
                assert got == ["ok"] * WORLD, (name, step, i, got)
            elif step == "fault1" and name == UNCHECKED:  # the peers complete, no one waits
                assert got[1] == "Injected", got
                assert all(g in ("ok", "wrong result") for g in got[:1] + got[2:]), got
            elif step == "fault1":
                want = ["PeerFailed", "Injected", "PeerFailed", "PeerFailed"]
                assert got == want, (name, step, got)
            else:
                assert got == ["Injected"] * WORLD, (name, step, got)
    assert [res["ring attention float64"] for res in results] == ["ok"] * WORLD
    # the send-only schedules of failing ranks match their peers' under NCCL's rules too
    logs = [res["log"] for res in results]
    assert all(len(log) > 200 for log in logs)
    assert nccl_problems(logs) == []


def _unvalidated_ulysses() -> str:
    """Negative control: Ulysses with its shape check switched off, 5 rows against 4."""
    import labkit.context_parallel.ulysses as ulysses

    ulysses.same_everywhere = lambda *a, **k: None  # type: ignore[assignment]
    return _outcome(lambda: _attention("ulysses")("shape", {}))


def _unguarded_ring() -> list[str]:
    """Negative control: ring attention whose guard passes exceptions straight through."""
    import labkit.context_parallel.ring as ring

    class PassThrough:
        ok = True

        def catch(self) -> contextlib.AbstractContextManager[None]:
            return contextlib.nullcontext()

    ring.guarded = lambda *a: contextlib.nullcontext(PassThrough())  # type: ignore[assignment]
    steps = []
    if dist.get_rank() == 1:
        with _raising("labkit.context_parallel.ring", "tile_forward", 2):
            steps.append(_outcome(lambda: _attention("ring")("ok", {})))
    else:
        steps.append(_outcome(lambda: _attention("ring")("ok", {})))
    steps.append(_outcome(lambda: _attention("ring")("ok", {})))
    return steps


@pytest.mark.timeout(200)
def test_the_table_catches_a_missing_check_and_a_missing_guard() -> None:
    from labkit.launch.config import JobTimeoutError, RankFailedError

    # without the check, 5 rows against 4 is no ValueError on every rank: a rank dies (SIGABRT)
    try:
        outcomes = run_ranks(_unvalidated_ulysses, world_size=WORLD, timeout=30)
    except RankFailedError as exc:  # what gloo does here: "Received data size doesn't match"
        assert "SIGABRT" in str(exc), exc
    except JobTimeoutError:  # (NCCL would hang instead: caught all the same)
        pass
    else:
        assert not all(o.startswith("ValueError") for o in outcomes), outcomes
    # without the guard, a tile failing on rank 1 wedges the group: the next call hangs
    # (the call's timeout) or returns a wrong result somewhere
    try:
        steps = run_ranks(_unguarded_ring, world_size=WORLD, timeout=15)
    except (JobTimeoutError, RankFailedError):
        return
    assert any(s[1] != "ok" for s in steps), steps
