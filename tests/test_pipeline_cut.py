"""Uneven pipeline cuts, without processes: every block in exactly one stage, the default
spread, explicit cuts checked with the values named, the simulator costing each stage by its
blocks (step time by hand), and the pipeline package's imports running one way."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest

from labkit.models.gpt import GPT, GPTConfig
from labkit.pipeline import Costs, make_schedule, simulate
from labkit.pipeline.cut import layer_counts, stage_work
from labkit.pipeline.stages import build_stages, check_pipeline, stage_layers

TINY = GPTConfig(vocab_size=16, block_size=4, n_layer=1, n_head=1, n_embd=4)


def test_every_block_lands_in_exactly_one_stage() -> None:
    """The old cut gave each stage n_layer // S blocks and dropped the rest (5 blocks on 2
    stages lost block 4). Now every (n_layer, p, v) with a block per stage keeps them all."""
    for n_layer in range(1, 10):
        model = GPT(TINY.with_(n_layer=n_layer))
        every = [f"blocks.{i}" for i in range(n_layer)]
        for p in range(1, 5):
            for v in (1, 2, 3):
                if p * v > n_layer:
                    continue
                schedule = "interleaved" if v > 1 else "1f1b"
                check_pipeline(n_layer, p, p, schedule, v)  # no refusal: any count is cut
                held = [
                    f"blocks.{i}"
                    for rank in range(p)
                    for chunk in build_stages(model, rank, p, v)
                    for i in chunk.blocks
                ]
                assert sorted(held, key=every.index) == every, (n_layer, p, v, held)
                ranges = stage_layers(n_layer, p * v)
                assert [i for r in ranges for i in r] == list(range(n_layer))  # in stage order
                assert max(map(len, ranges)) - min(map(len, ranges)) <= 1, (n_layer, p, v)


def test_default_spread_puts_the_extra_blocks_on_the_middle_stages() -> None:
    assert layer_counts(5, 2) == [3, 2]  # no middle stage: stage 0 (no FLOPs in its lookup)
    assert layer_counts(5, 3) == [2, 2, 1]
    assert layer_counts(6, 4) == [1, 2, 2, 1]  # ends keep the embedding and the logits light
    assert layer_counts(10, 4) == [2, 3, 3, 2]
    assert layer_counts(7, 4) == [2, 2, 2, 1]  # r = S - 1: the last extra to stage 0
    assert layer_counts(8, 4) == [2, 2, 2, 2]  # divisible: the even cut, as before
    assert layer_counts(9, 1) == [9]


def test_an_explicit_cut_is_used_and_bad_ones_name_the_values() -> None:
    model = GPT(TINY.with_(n_layer=5))
    r0, r1 = (build_stages(model, r, 2, layers_per_stage=(0, 5))[0] for r in (0, 1))
    assert list(r0.blocks) == [] and r0.is_first  # the embedding alone: allowed at an end
    assert list(r1.blocks) == ["0", "1", "2", "3", "4"]
    assert [len(r) for r in stage_layers(5, 4, (1, 2, 1, 1))] == [1, 2, 1, 1]
    bad: list[tuple[Any, str]] = [
        ((2, 2), r"layers per stage \[2, 2\] sum to 4, but n_layer=5"),
        ((3, 1, 1), r"\[3, 1, 1\] has 3 entries for 2 \(virtual\) pipeline stages"),
        ((6, -1), r"\[6, -1\]: a stage cannot hold a negative count"),
        ((2.5, 2.5), r"\[2.5, 2.5\] must be integers"),
    ]
    for cut, match in bad:
        with pytest.raises(ValueError, match=match):
            check_pipeline(5, 2, 4, layers_per_stage=cut)
        with pytest.raises(ValueError, match=match):
            build_stages(model, 0, 2, layers_per_stage=cut)
    with pytest.raises(ValueError, match=r"\[2, 0, 3\]: middle stage\(s\) \[1\] hold no block"):
        check_pipeline(5, 3, 4, layers_per_stage=(2, 0, 3))
    with pytest.raises(ValueError, match=r"\[1, 1, 1, 2\] has 4 entries for 6"):
        check_pipeline(5, 2, 4, "interleaved", 3, layers_per_stage=(1, 1, 1, 2))
    with pytest.raises(ValueError, match=r"3 pipeline stages \(p=3 x v=1\) but only n_layer=2"):
        check_pipeline(2, 3, 4)  # the default spread still needs a block per stage


def test_simulator_costs_each_stage_by_its_blocks_by_hand() -> None:
    """5 blocks on 2 stages cut [3, 2]; one block's forward 1, its full backward 2 (B + W).
    Stage 0: F = 3, B = 6; stage 1: F = 2, B = 4; m = 2.

    GPipe: rank 0 F0 0-3, F1 3-6; rank 1 F0 3-5, F1 6-8, B0 8-12, B1 12-16; rank 0 B0 12-18,
    B1 18-24: makespan 24 = (m - 1) 9 + (9 + 6), the slowest stage paces.
    1F1B: rank 1 F0 3-5, B0 5-9, F1 9-11, B1 11-15; rank 0 F0 0-3, F1 3-6, B0 9-15,
    B1 15-21: makespan 21."""
    work = stage_work(5, 2)
    assert work == (3.0, 2.0)
    costs = Costs(F=1, B=1, W=1, stages=work)
    gp = simulate(make_schedule("gpipe", 2, 2), costs)
    starts = [(t.rank, str(t.action), t.start) for t in gp.timeline if t.action.is_compute]
    assert (0, "B1.0", 18) in starts and (1, "F1.0", 6) in starts
    assert gp.makespan == 24 and gp.busy == [18, 12]
    assert gp.bubble == pytest.approx([1 - 18 / 24, 1 - 12 / 24])
    one = simulate(make_schedule("1f1b", 2, 2), costs)
    assert one.makespan == 21 and one.busy == [18, 12]
    # negative control: the even costing of the same 5 blocks (2.5 a stage) is another number
    even = simulate(make_schedule("gpipe", 2, 2), Costs(F=2.5, B=2 * 2.5, W=0))
    assert even.makespan == pytest.approx(22.5) != gp.makespan
    # interleaved: virtual stage s = c p + r; the cut [1, 2, 1, 1] gives rank 0 stages 0 and 2
    # (2 blocks), rank 1 stages 1 and 3 (3 blocks); busy = blocks x (F + B + W) x m
    inter = simulate(make_schedule("interleaved", 2, 2, 2), Costs(stages=stage_work(5, 4)))
    assert layer_counts(5, 4) == [1, 2, 1, 1] and inter.busy == [2 * 3 * 2, 3 * 3 * 2]
    with pytest.raises(ValueError, match=r"Costs.stages has 3 entries, but the schedule has 2"):
        simulate(make_schedule("gpipe", 2, 2), Costs(stages=(1.0, 1.0, 1.0)))
    # the embedding and the head as extra work on the end stages
    assert stage_work(4, 2, embedding=0.5, head=1.5) == (2.5, 3.5)


def _pipeline_imports() -> dict[str, set[str]]:
    """labkit.pipeline module -> the labkit.pipeline modules it imports, anywhere in it
    (function bodies included)."""
    root = Path(__file__).parents[1] / "labkit" / "pipeline"
    names = {p.stem for p in root.glob("*.py") if p.stem != "__init__"}
    graph: dict[str, set[str]] = {}
    for name in names:
        tree = ast.parse((root / f"{name}.py").read_text())
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "labkit.pipeline."
            ):
                found.add(node.module.split(".")[2])  # type: ignore[union-attr]
            elif isinstance(node, ast.Import):
                found |= {a.name.split(".")[2] for a in node.names if a.name.count(".") >= 2
                          and a.name.startswith("labkit.pipeline.")}  # fmt: skip
        graph[name] = found & names
    return graph


def test_pipeline_imports_run_one_way() -> None:
    graph = _pipeline_imports()
    assert "validator" in graph["simulator"] and "simulator" not in graph["validator"]
    assert "replay" in graph["validator"]

    def reaches(a: str, b: str, seen: frozenset[str] = frozenset()) -> bool:
        return any(n == b or (n not in seen and reaches(n, b, seen | {n})) for n in graph[a])

    circles = sorted(m for m in graph if reaches(m, m))
    assert circles == [], f"import circles through {circles}"
