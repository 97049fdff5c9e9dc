"""The composition matrix: every pair of techniques a user combines, each configuration
trained on its ranks and compared with one process (docs/composition.md lists it).

Pure tests (no processes): the covering array covers every valid pair and generates no
refused one, every refused pair raises a ValueError naming both parts, the doc lists the
matrix, the tolerance arithmetic. Rank tests: one warm-world call per world size (2, 4, 8)
runs all of that size's configurations in turn; each must equal
:func:`labkit.parallel.composed_ref.reference` (parameters after every step, losses) within
its precision's tolerance. A failure names the configuration and its first divergence, after
every configuration has run. Negative controls: a run that skips the dp gradient average, a
context-parallel run that averages dense gradients over dp only (not dp x cp), a 16-bit MoE run
whose experts get each other's gates, and a reference missing replica 1's micro-batches, are
all detected as different.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from itertools import combinations
from pathlib import Path

import pytest
import torch

from labkit.parallel.composed_ref import compare, reference, tolerance
from labkit.parallel.matrix import (
    DIMENSIONS,
    REFUSED,
    SUITE,
    Combo,
    check_combo,
    covering_array,
    matrix_table,
    refusal,
    uncovered_pairs,
    valid_pairs,
)
from labkit.reference import Trace
from tests.ranks import run_ranks

# A seam the issue found by hand (tp on labkit's ring under overlapped DDP on the ring,
# whose communication thread runs the ring while tp's collectives run on the main thread).
SEEDS = [Combo(dp="overlapped", dp_comm="ring", tp_comm="ring", tp="2", accum=2)]
# Every pair of SUITE's values (all but Ulysses), then one Ulysses configuration (time: see
# docs/composition.md): Ulysses' all-to-all on the cp group beside the experts' all-to-all on
# the ep group (the same two ranks), under tp and overlapped DDP.
ULYSSES = Combo(dp="overlapped", tp="2", cp="2-ulysses", ep="2", precision="bf16", accum=2)
# Overlapped SP (tp=2+osp) once too, where its p2p rings meet the most: overlapped DDP's
# communication thread on labkit's ring, the pipeline's sends, full recompute, 5 uneven layers
OSP = Combo(dp="overlapped", dp_comm="ring", tp_comm="ring", tp="2+osp", pp="1f1b", layers=5,
            checkpoint=True, accum=2, frozen=True)  # fmt: skip
COMBOS = [*covering_array(SEEDS, SUITE), ULYSSES, OSP]
# a 2-rank 16-bit MoE configuration of the matrix (dense routing there: composed_ref.moe_config)
MOE16 = next(c for c in COMBOS if c.world_size == 2 and c.ep != "0" and c.precision != "fp32")
# trained wrong, each must be detected: no dp average at all; at cp = 2, dense gradients
# averaged over dp (1 rank) instead of dp x cp (each cp rank steps on its half-sequence grads);
# MOE16 with each expert weighted by another choice's gate (dense routing still sees routing)
WRONG = [
    (Combo(dp="flat"), "no_dp_sync"),
    (Combo(dp="flat", cp="2"), "dp_only"),
    (MOE16, "gates_reversed"),
]


# ----------------------------------------------------------------------------- pure
def test_covering_array_covers_every_valid_pair_and_no_refused_one() -> None:
    assert uncovered_pairs(COMBOS, SUITE) == set()
    # of all of DIMENSIONS' pairs, only pairs with Ulysses or overlapped SP go uncovered (each
    # runs once)
    left = uncovered_pairs(COMBOS)
    assert left and all({"2-ulysses", "2+osp"} & {va, vb} for (_, va), (_, vb) in left)
    assert 20 <= len(COMBOS) <= 60, len(COMBOS)  # tens, not the 1,244,160 of the full product
    for c in COMBOS:
        check_combo(c)  # raises on a refused pair
        for (a, va), (b, vb) in combinations(c.values().items(), 2):
            assert refusal(a, va, b, vb) is None, c.name
    assert [*covering_array(SEEDS, SUITE), ULYSSES, OSP] == COMBOS  # deterministic
    # negative control: drop one configuration and some pair is left uncovered
    assert uncovered_pairs(COMBOS[1:], SUITE) != set()
    assert uncovered_pairs(covering_array(SEEDS)) == set()  # every pair of every value: 38
    # the refused pairs are exactly the complement of the valid ones
    every = {
        ((a, va), (b, vb))
        for a, b in combinations(DIMENSIONS, 2)
        for va in DIMENSIONS[a]
        for vb in DIMENSIONS[b]
    }
    refused = every - valid_pairs()
    assert refused and all(refusal(a, va, b, vb) for (a, va), (b, vb) in refused)


REFUSED_EXAMPLES = [
    (Combo(dp="zero2", pp="1f1b"), "dp='zero2' with pp='1f1b'", "pipeline"),
    (Combo(dp="zero3", pp="gpipe"), "dp='zero3' with pp='gpipe'", "pipeline"),
    (Combo(dp="zero3+prefetch", pp="zbh1"), "dp='zero3+prefetch' with pp='zbh1'", "pipeline"),
    (Combo(dp="zero3", branch=True), "dp='zero3' with branch=True", "same modules"),
    (Combo(pp="interleaved", accum=3), "pp='interleaved' with accum=3", "multiple"),
    (Combo(pp="interleaved", accum=1), "pp='interleaved' with accum=1", "multiple"),
    (Combo(cp="2", branch=True), "cp='2' with branch=True", "position 0"),
    (Combo(cp="2-ulysses", branch=True), "cp='2-ulysses' with branch=True", "position 0"),
    (Combo(tp="2+sp", ep="moe"), "ep='moe' with tp='2+sp'", "replicated over tp"),
    (Combo(tp="2+sp", ep="2"), "ep='2' with tp='2+sp'", "replicated over tp"),
    (Combo(dp="zero1", ep="2"), "ep='2' with dp='zero1'", "edp"),
    (Combo(dp="zero3", ep="2"), "ep='2' with dp='zero3'", "edp"),
    (Combo(tp="2+osp", ep="2"), "ep='2' with tp='2+osp'", "replicated over tp"),
    (Combo(tp="2+osp", precision="bf16"), "tp='2+osp' with precision='bf16'", "autocast"),
    (Combo(tp="2+osp", precision="fp16"), "tp='2+osp' with precision='fp16'", "autocast"),
]


@pytest.mark.parametrize(("combo", "parts", "why"), REFUSED_EXAMPLES)
def test_refused_pair_raises_naming_both_parts(combo: Combo, parts: str, why: str) -> None:
    from labkit.parallel.composed import check

    with pytest.raises(ValueError, match="not supported") as info:
        check(combo)  # before any process starts
    assert parts in str(info.value) and why in str(info.value)


def test_every_refusal_rule_has_an_example() -> None:
    for da, pa, db, pb, why in REFUSED:
        hits = [c for c, _, _ in REFUSED_EXAMPLES if pa(getattr(c, da)) and pb(getattr(c, db))]
        assert hits, f"no example of the rule {da} x {db}: {why[:60]}"
    with pytest.raises(ValueError, match=r"dp='zero4': expected one of"):
        check_combo(Combo(dp="zero4"))


def test_doc_lists_the_matrix() -> None:
    doc = (Path(__file__).parent.parent / "docs" / "composition.md").read_text()
    assert matrix_table(COMBOS) in doc, "regenerate the table: labkit.parallel.matrix.matrix_table"
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    assert "docs/composition.md" in readme


def test_the_model_dimensions_are_not_vacuous() -> None:
    """The branch runs in step 0 on replica 0 only and in step 1 nowhere: the reference moves
    ``extra`` once, then AdamW leaves it (grad None); the frozen wpe never moves."""
    from labkit.parallel.composed_ref import batch, build_model

    x, _ = batch(Combo(), 0)
    assert (x[:, :, 0] == 0).sum() == 1 and x[0, 0, 0] == 0  # replica 0's first micro-batch
    assert (batch(Combo(), 1)[0][:, :, 0] != 0).all()
    c = Combo(branch=True, frozen=True, tied=False)
    fresh = dict(build_model(c).named_parameters())
    trace = reference(c)
    extra = [snap["wte.extra.weight"] for snap in trace.params]
    assert not torch.equal(extra[0], fresh["wte.extra.weight"]) and torch.equal(extra[1], extra[0])
    assert all(torch.equal(s["wpe.weight"], fresh["wpe.weight"]) for s in trace.params)
    assert "head.weight" in trace.params[0]  # untied: its own parameter


def test_split_weight_gradient_accumulates_as_autograd_does() -> None:
    """ZB-H1's W step (found by the matrix): a 16-bit gradient lands in the fp32 parameter's
    dtype, and the post-accumulate-grad hooks run (ZeRO's "used" flags, DDP's buckets)."""
    from labkit.pipeline.weight_grad import apply_weight_grads

    lin = torch.nn.Linear(3, 2)
    fired: list[str] = []
    lin.weight.register_post_accumulate_grad_hook(lambda p: fired.append("weight"))
    lin.bias.register_post_accumulate_grad_hook(lambda p: fired.append("bias"))
    a = torch.randn(4, 3, dtype=torch.bfloat16)  # (tokens, in)
    g = torch.randn(4, 2, dtype=torch.bfloat16)  # (tokens, out)
    apply_weight_grads([[lin, a, g]])
    assert lin.weight.grad is not None and lin.weight.grad.dtype == torch.float32
    torch.testing.assert_close(lin.weight.grad, (g.t() @ a).float())
    assert fired == ["weight", "bias"]


def test_context_parallel_positions_and_sequence_split() -> None:
    """Each cp rank's tokens and position ids are its zigzag chunks (ring) or its contiguous
    half (Ulysses); together they are the sequence; a length not divisible by 2 cp is refused."""
    from labkit.parallel.cp_ep import ShardPositions, split_sequence

    seq = torch.arange(8).view(1, 8)  # (B, T)
    ring = [split_sequence(seq, 2, r, "ring") for r in range(2)]
    assert ring[0].tolist() == [[0, 1, 6, 7]] and ring[1].tolist() == [[2, 3, 4, 5]]
    assert split_sequence(seq, 2, 1, "ulysses").tolist() == [[4, 5, 6, 7]]
    emb = torch.nn.Embedding(8, 3)
    shard = ShardPositions(emb, ring[1][0])
    torch.testing.assert_close(shard(torch.arange(4)), emb.weight[2:6])
    assert shard.weight is emb.weight  # tied lookups still find the Parameter
    with pytest.raises(ValueError, match="not divisible by 2 x cp = 4"):
        split_sequence(torch.arange(6).view(1, 6), 2, 0, "ring")


def test_layout_picture_places_cp() -> None:
    """rank_coords inverts the (pp, dp, cp, tp) numbering: each cp group differs in cp only."""
    from labkit.parallel.layout import ParallelDegrees, rank_grid
    from labkit.viz.layout import rank_coords

    d = ParallelDegrees(dp=2, tp=2, pp=2, cp=2, ep=2)
    coords, grid = rank_coords(d), rank_grid(d)
    for axis, i in (("pp", 0), ("dp", 1), ("cp", 2), ("tp", 3)):
        for g in grid[axis]:
            assert sorted(coords[r][i] for r in g) == list(range(len(g))), (axis, g)
            assert len({coords[r][:i] + coords[r][i + 1 :] for r in g}) == 1, (axis, g)
    assert len(rank_coords(ParallelDegrees(dp=2, tp=2))[3]) == 3  # cp = 1: (pp, dp, tp)


def test_16bit_moe_routes_every_token_to_every_expert() -> None:
    """A token of the zero2/tp2/bf16 configuration (4 ranks, step 0, replica 1's first
    micro-batch, layer 0): its router logits in one process and on the tp ranks differ by bf16
    rounding only, yet top-2 picks experts [3, 0] against [3, 2]. Routed to all 4 experts (the
    matrix's 16-bit MoE), each expert's weight moves by bf16 noise only."""
    from labkit.experts.router import route
    from labkit.parallel.composed_ref import moe_config

    one = torch.tensor([[-0.006256103515625, -0.0703125, -0.006439208984375, 0.07861328125]])
    tp = torch.tensor([[-0.00628662109375, -0.0703125, -0.006195068359375, 0.07861328125]])
    one, tp = one.bfloat16(), tp.bfloat16()  # as the router's bf16 linear returns them

    def weights(logits: torch.Tensor, k: int) -> torch.Tensor:
        r = route(logits, k)  # (1, E): each expert's gate, 0 where not chosen
        return torch.zeros(1, 4).scatter(1, r.experts, r.gates.float())

    assert moe_config(Combo(ep="moe")).top_k == 2  # fp32: a real top-2 choice
    k16 = moe_config(Combo(ep="moe", precision="bf16")).top_k
    assert k16 == moe_config(Combo(ep="2", precision="fp16")).top_k == 4
    torch.testing.assert_close(weights(tp, k16), weights(one, k16), atol=0, rtol=4 * 2**-8)
    # negative control: top-2 on the same logits flips expert 0 for expert 2 (gate ~0.48)
    assert route(one, 2).experts.tolist() == [[3, 0]] and route(tp, 2).experts.tolist() == [[3, 2]]
    assert (weights(tp, 2) - weights(one, 2)).abs().max() > 0.4


def test_tolerance_follows_the_precision() -> None:
    assert tolerance(Combo(precision="fp32")) == (2e-5, 2e-5)
    assert tolerance(Combo(precision="bf16")) == (0.5 * 4 * 2**-8, 4 * 2**-8)
    assert tolerance(Combo(precision="fp16")) == (0.5 * 4 * 2**-11, 4 * 2**-11)


# ----------------------------------------------------------------------------- ranks
def _train(combos: list[Combo], wrong: list[str | None]) -> list[dict]:
    from labkit.parallel.composed import train_combos

    return train_combos(combos, wrong)


def _one_replica_control(c: Combo, wrong: str | None, world: int) -> bool:
    return wrong is None and world == 2 and c.precision == "fp32" and c.cp == "1"


def _references(
    combos: list[Combo], wrong: list[str | None], world: int
) -> tuple[list[Trace], dict[int, Trace]]:
    """Each configuration's reference, and (negative control) the reference without replica
    1's micro-batches where the test compares against it."""
    refs = [reference(c) for c in combos]
    one = {
        i: reference(c, replicas=1)
        for i, c in enumerate(combos)
        if _one_replica_control(c, wrong[i], world)
    }
    return refs, one


@pytest.mark.parametrize("world", [2, 4, 8])
def test_matrix_on_ranks(world: int) -> None:
    from labkit.parallel.composed import check

    combos = [c for c in COMBOS if c.world_size == world]
    failures = []
    runnable = []
    for c in combos:
        try:
            check(c)
            runnable.append(c)
        except ValueError as exc:  # a generated configuration must be runnable
            failures.append(f"{c.name}: refused before start: {exc}")
    wrong: list[str | None] = [None] * len(runnable)
    if world == 2:  # the negative controls ride along in the cheapest world
        runnable += [c for c, _ in WRONG]
        wrong += [w for _, w in WRONG]
    # The single-process references (seconds: a third of this test's time) are computed in a
    # thread while the ranks train: this process only waits on them meanwhile, and uses no
    # torch state (RNG, grad mode, dtype) a reference run sets.
    with ThreadPoolExecutor(max_workers=1) as pool:
        refs = pool.submit(_references, runnable, wrong, world)
        try:
            out = run_ranks(_train, runnable, wrong, world_size=world, timeout=240)
        except Exception as exc:  # noqa: BLE001 - a rank died or hung: name what was running
            names = "\n".join(c.name for c in runnable)
            pytest.fail(
                f"the {world}-rank batch broke, running:\n{names}\n{type(exc).__name__}: {exc}"
            )
        ref, one_replica = refs.result()
    for i, c in enumerate(runnable):
        ranks = [r[i] for r in out]
        miss = compare(c, ranks, ref[i])
        if wrong[i] is not None:
            assert miss is not None and "diverges" in miss, f"{wrong[i]} went unseen: {miss}"
            continue
        if miss is not None:
            failures.append(f"{c.name}: {miss}")
        elif _one_replica_control(c, wrong[i], world):
            # negative control: the reference without replica 1's micro-batches differs
            assert compare(c, ranks, one_replica[i]) is not None, c.name
    assert not failures, (
        f"{len(failures)} of {len(combos)} configurations on {world} ranks failed:\n"
        + "\n".join(failures)
    )
