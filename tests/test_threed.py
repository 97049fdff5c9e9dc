"""3D parallelism (dp x tp x pp) on gloo ranks against single-process training.

One 8-rank call: dp=2 x tp=2 x pp=2 (DDP over dp, 1F1B), and the same degrees with ZeRO-1,
the interleaved schedule (v = 2) and every block checkpointed. One 4-rank call: dp x tp =
2 x 2 with ZeRO-1 (pp = 1) and dp x tp x pp = 1 x 2 x 2 with every 2nd block checkpointed
(each rank counts its blocks' recomputes in backward: the checkpointing really applies).
Every case: tied embeddings (the head on the last stage, the embedding on the first:
Megatron's embedding group when they sit on different ranks), a frozen parameter (wpe),
2 micro-batches per replica; after 3 AdamW steps every stage's full
parameters (tensor shards gathered) and every step's loss equal the reference's. Negative
control: the reference without the second replica's micro-batches is far from the result.
The layout and bad-input tests run without processes.
"""

from __future__ import annotations

import pytest
import torch

from labkit.labs.threed import TINY, LabConfig, reference
from labkit.parallel import ParallelDegrees
from labkit.parallel.threed import ThreeDConfig, check_threed
from tests.ranks import run_ranks

TOL = 2e-5


def _cfg(dp: int, tp: int, pp: int, **kw: object) -> LabConfig:
    return LabConfig(threed=ThreeDConfig(ParallelDegrees(dp, tp, pp), 2, **kw))  # type: ignore[arg-type]


def _train_all(cfgs: list[LabConfig]) -> list[dict]:
    """Train each config; also count the GPT blocks' forwards on this rank: in the forward
    pass, and inside backward (an activation-checkpointing recompute)."""
    from labkit.labs.threed import train
    from labkit.models.gpt import Block

    out = []
    for c in cfgs:
        counts = {"forward": 0, "recompute": 0}

        def count(module: torch.nn.Module, *_: object, counts: dict = counts) -> None:
            if isinstance(module, Block):  # a CheckpointedBlock runs its inner Block
                in_backward = torch._C._current_graph_task_id() != -1
                counts["recompute" if in_backward else "forward"] += 1

        handle = torch.nn.modules.module.register_module_forward_hook(count)
        try:
            out.append({**train(c), "block_runs": counts})
        finally:
            handle.remove()
    return out


def _check(cfg: LabConfig, per_rank: list[dict]) -> None:
    ref = reference(cfg)
    d = cfg.threed.degrees
    covered: set[str] = set()
    for r in per_rank:
        for name, p in r["params"].items():
            want = ref["params"]["wte.weight" if name == "head.weight" else name]
            torch.testing.assert_close(
                p, want, atol=TOL, rtol=TOL, msg=f"{d} rank {r['rank']} {name}"
            )
            covered.add(name)
        if r["losses"][0] is not None:  # the last stage's ranks
            assert r["losses"] == pytest.approx(ref["losses"], abs=TOL)
    assert covered >= set(ref["params"]), f"{d}: stages missing {set(ref['params']) - covered}"
    assert per_rank[0]["checksum"] == pytest.approx(ref["checksum"], abs=1e-3)
    from labkit.models.gpt import GPT

    torch.manual_seed(cfg.seed)  # the frozen parameter never moved: equal to the fresh model's
    fresh = GPT(cfg.model).wpe.weight.detach()
    assert any(torch.equal(r["params"].get("wpe.weight", fresh), fresh) for r in per_rank)
    if d.dp > 1:  # negative control: one replica's micro-batches alone give other parameters
        alone = reference(cfg, replicas=1)["params"]
        worst = max((p - alone[n if n != "head.weight" else "wte.weight"]).abs().max().item()
                    for r in per_rank for n, p in r["params"].items())  # fmt: skip
        assert worst > 100 * TOL


def _check_recomputes(per_rank: list[dict], share: float) -> None:
    """Activation checkpointing really composed: ``share`` of the block forwards each rank ran
    were recomputed in backward (1: every block, 0: none)."""
    for r in per_rank:
        runs = r["block_runs"]
        assert runs["forward"] > 0 and runs["recompute"] == share * runs["forward"], (
            r["rank"], runs
        )  # fmt: skip


def test_dp2_tp2_pp2_on_8_ranks() -> None:
    """The second config checkpoints every block (compose: after TP, before the pipeline)."""
    cfgs = [
        _cfg(2, 2, 2),
        _cfg(2, 2, 2, zero="zero1", schedule="interleaved", virtual=2, checkpoint="full"),
    ]
    out = run_ranks(_train_all, cfgs, world_size=8, timeout=300)
    for i, cfg in enumerate(cfgs):
        _check(cfg, [r[i] for r in out])
    _check_recomputes([r[0] for r in out], 0)  # negative control: no checkpointing, no recompute
    _check_recomputes([r[1] for r in out], 1)


def test_zero1_2x2_and_1x2x2_on_4_ranks() -> None:
    """The second config checkpoints every 2nd block (0 and 2 of 4: one of each stage's two)."""
    cfgs = [_cfg(2, 2, 1, zero="zero1"), _cfg(1, 2, 2, checkpoint=2)]
    out = run_ranks(_train_all, cfgs, world_size=4, timeout=300)
    for i, cfg in enumerate(cfgs):
        _check(cfg, [r[i] for r in out])
    _check_recomputes([r[0] for r in out], 0)
    _check_recomputes([r[1] for r in out], 0.5)


@pytest.mark.parametrize(
    ("degrees", "world", "model", "match"),
    [
        ((2, 2, 2), 6, TINY, r"dp=2 x tp=2 x pp=2 = 8 ranks, but world_size=6"),
        ((1, 3, 1), 3, TINY, r"hidden size 32 is not divisible by tp=3"),
        ((1, 8, 1), 8, TINY, r"head count 4 is not divisible by tp=8"),
        ((1, 2, 1), 2, TINY.with_(vocab_size=65), r"vocabulary 65 is not divisible by tp=2"),
        ((1, 1, 5), 5, TINY, r"5 pipeline stages \(p=5 x v=1\) but only n_layer=4"),
    ],
)
def test_bad_input_named_before_start(degrees, world, model, match) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=match):
        check_threed(model, ThreeDConfig(ParallelDegrees(*degrees)), world)


def test_64_rank_layout_keeps_tp_in_a_node_and_pp_across_nodes() -> None:
    from labkit.viz.layout import layout_table, node_spans

    d, gpus = ParallelDegrees(dp=2, tp=8, pp=4), 8  # 8 nodes x 8 GPUs
    spans = node_spans(d, gpus)
    assert len(spans["tp"]) == 8 and all(len(s) == 1 for s in spans["tp"])  # one node each
    assert all(len(s) == 4 for s in spans["pp"])  # every stage on its own node
    assert all(len(s) == 2 for s in spans["dp"])  # replicas on different nodes
    # negative control: tp=16 cannot stay inside an 8-GPU node
    assert any(len(s) > 1 for s in node_spans(ParallelDegrees(dp=1, tp=16, pp=4), gpus)["tp"])
    table = layout_table(d, gpus)
    assert table.splitlines()[0].startswith("node 0: 0(0,0,0) 1(0,0,1)")
    assert "tp groups (8 of 8): [0, 1, 2, 3, 4, 5, 6, 7]" in table


def test_draw_layout_makes_a_cell_per_rank() -> None:
    import matplotlib

    matplotlib.use("Agg")
    from labkit.viz.layout import draw_layout

    fig = draw_layout(ParallelDegrees(dp=2, tp=2, pp=2), gpus_per_node=4)
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert len(texts) == 8 and texts[5].startswith("5\npp1 dp0\ntp1")
