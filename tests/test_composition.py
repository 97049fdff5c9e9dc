"""The composition matrix: every pair of techniques a user combines, each configuration
trained on its ranks and compared with one process (docs/composition.md lists it).

Pure tests (no processes): the covering array covers every valid pair and generates no
refused one, every refused pair raises a ValueError naming both parts, the doc lists the
matrix, the tolerance arithmetic. Rank tests: one warm-world call per world size (2, 4, 8)
runs all of that size's configurations in turn; each must equal
:func:`labkit.parallel.composed_ref.reference` (parameters after every step, losses) within
its precision's tolerance. A failure names the configuration and its first divergence, after
every configuration has run. Negative controls: a run that skips the dp gradient average,
and a reference missing replica 1's micro-batches, are both detected as different.
"""

from __future__ import annotations

from itertools import combinations
from pathlib import Path

import pytest
import torch

from labkit.parallel.composed_ref import compare, reference, tolerance
from labkit.parallel.matrix import (
    DIMENSIONS,
    REFUSED,
    Combo,
    check_combo,
    covering_array,
    matrix_table,
    refusal,
    uncovered_pairs,
    valid_pairs,
)
from tests.ranks import run_ranks

# A seam the issue found by hand (tp on labkit's ring under overlapped DDP on the ring,
# whose communication thread runs the ring while tp's collectives run on the main thread).
SEEDS = [Combo(dp="overlapped", dp_comm="ring", tp_comm="ring", tp="2", accum=2)]
COMBOS = covering_array(SEEDS)
WRONG = Combo(dp="flat")  # trained with wrong="no_dp_sync": must be detected


# ----------------------------------------------------------------------------- pure
def test_covering_array_covers_every_valid_pair_and_no_refused_one() -> None:
    assert uncovered_pairs(COMBOS) == set()
    assert 20 <= len(COMBOS) <= 60, len(COMBOS)  # tens, not the 69,120 of the full product
    for c in COMBOS:
        check_combo(c)  # raises on a refused pair
        for (a, va), (b, vb) in combinations(c.values().items(), 2):
            assert refusal(a, va, b, vb) is None, c.name
    assert covering_array(SEEDS) == COMBOS  # deterministic
    # negative control: drop one configuration and some pair is left uncovered
    assert uncovered_pairs(COMBOS[1:]) != set()
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


def test_tolerance_follows_the_precision() -> None:
    assert tolerance(Combo(precision="fp32")) == (2e-5, 2e-5)
    assert tolerance(Combo(precision="bf16")) == (0.5 * 4 * 2**-8, 4 * 2**-8)
    assert tolerance(Combo(precision="fp16")) == (0.5 * 4 * 2**-11, 4 * 2**-11)


# ----------------------------------------------------------------------------- ranks
def _train(combos: list[Combo], wrong: list[str | None]) -> list[dict]:
    from labkit.parallel.composed import train_combos

    return train_combos(combos, wrong)


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
    if world == 2:  # the negative control rides along in the cheapest world
        runnable.append(WRONG)
        wrong.append("no_dp_sync")
    try:
        out = run_ranks(_train, runnable, wrong, world_size=world, timeout=240)
    except Exception as exc:  # noqa: BLE001 - a rank died or hung: name what was running
        names = "\n".join(c.name for c in runnable)
        pytest.fail(f"the {world}-rank batch broke, running:\n{names}\n{type(exc).__name__}: {exc}")
    for i, c in enumerate(runnable):
        ranks = [r[i] for r in out]
        miss = compare(c, ranks, reference(c))
        if wrong[i] is not None:
            assert miss is not None and "diverges" in miss, f"{wrong[i]} went unseen: {miss}"
            continue
        if miss is not None:
            failures.append(f"{c.name}: {miss}")
        elif world == 2 and c.precision == "fp32":
            # negative control: the reference without replica 1's micro-batches differs
            assert compare(c, ranks, reference(c, replicas=1)) is not None, c.name
    assert not failures, (
        f"{len(failures)} of {len(combos)} configurations on {world} ranks failed:\n"
        + "\n".join(failures)
    )
