"""Logical checkpoints of a 3D run (dp x tp x pp, ZeRO-1, tied embeddings, loss scaler, RNG)
loaded under other layouts, continuing equal to the uninterrupted single-process run.

One 4-rank call saves four runs after step 2 (two of them in the background); one 4-rank
and one 3-rank call resume them under other layouts (``LOADS``: tp 2->4 and 4->1, pp 2 with
an uneven 3+1 cut -> 4 and -> 3 (2+1+1), dp 2->3 and 1->3 with the ZeRO-1 shards
repartitioned, all at once both ways, and the same layout, with and without a pipeline cut,
where the RNG streams come back too) and run steps 3-4. Every resumed run's full
parameters, losses and scaler state equal the reference's (lab 08's, one process, the same
6 sequences a step: dp x micro-batches = 6 in every layout). Negative control: the same
resume without the optimizer state lands far from the reference. The 4-rank call also loads
a checkpoint that DCP wrote from a plain GPT. Bad input and damaged files are tested without
processes (the resharding arithmetic: in tests/test_checkpoint_reshard.py)."""

from __future__ import annotations

import dataclasses
import functools
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from labkit.checkpoint import CheckpointError, Place, load_logical, plan_read
from labkit.labs.threed import TINY, LabConfig, reference
from labkit.parallel import ParallelDegrees
from labkit.parallel.threed import ThreeDConfig
from tests.ranks import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
TOL = 2e-5
STEPS, SAVE_AT = 4, 2


def _cfg(dp: int, tp: int, pp: int, cut: tuple[int, ...] | None = None) -> LabConfig:
    three = ThreeDConfig(ParallelDegrees(dp, tp, pp), 6 // dp, micro_batch=1, zero="zero1",
                         stage_layers=cut)  # fmt: skip
    return LabConfig(model=TINY, threed=three, steps=STEPS)


SAVES = {  # name -> the layout that saves after step 2 (4 ranks each)
    "dp1tp2pp2": _cfg(1, 2, 2),
    "dp1tp4pp1": _cfg(1, 4, 1),
    "dp2tp1pp2-cut31": _cfg(2, 1, 2, (3, 1)),
    "dp2tp2pp1": _cfg(2, 2, 1),
}
LOADS = {  # (saved, what changes) -> the layout that resumes
    4: [("dp1tp2pp2", "tp 2->4, pp 2->1", _cfg(1, 4, 1)),
        ("dp2tp1pp2-cut31", "pp 2 (cut 3+1) -> 4, dp 2->1, ZeRO 2->1", _cfg(1, 1, 4)),
        ("dp2tp1pp2-cut31", "all at once: dp 2->1, tp 1->4, pp 2->1, ZeRO 2->1", _cfg(1, 4, 1)),
        ("dp1tp2pp2", "all at once: dp 1->2, tp 2->1, pp cut 2+2 -> 1+3", _cfg(2, 1, 2, (1, 3))),
        ("dp1tp2pp2", "the same layout (RNG restored)", _cfg(1, 2, 2)),
        ("dp2tp1pp2-cut31", "the same layout, cut 3+1 (RNG restored)", _cfg(2, 1, 2, (3, 1)))],
    3: [("dp1tp4pp1", "tp 4->1, dp 1->3, ZeRO 1->3", _cfg(3, 1, 1)),
        ("dp2tp2pp1", "dp 2->3, ZeRO 2->3, tp 2->1", _cfg(3, 1, 1)),
        ("dp2tp1pp2-cut31", "pp 2->3 uneven (2+1+1), dp 2->1", _cfg(1, 1, 3))],
}  # fmt: skip


@functools.cache
def _reference(steps: int) -> dict:
    """One process, 6 sequences a step: every layout's reference (the batch of a step depends
    only on dp x micro-batches, micro_batch and the seed, equal in all of them)."""
    return reference(dataclasses.replace(_cfg(1, 1, 1), steps=steps))


def _save_all(root: str) -> None:
    from labkit.labs.threed_ckpt import train

    for i, (name, cfg) in enumerate(SAVES.items()):
        short = dataclasses.replace(cfg, steps=SAVE_AT)  # the steps after it: resumed runs
        train(short, f"{root}/{name}", save_at=SAVE_AT, background=i % 2 == 1)


def _load_all(root: str, cases: list, tag: str) -> list[dict]:
    from labkit.labs.threed_ckpt import train

    out = []
    for i, (saved, _, cfg) in enumerate(cases):
        folder = f"{root}/{tag}{i}"
        if torch.distributed.get_rank() == 0:
            shutil.copytree(f"{root}/{saved}", folder)
        torch.distributed.barrier()
        if saved == "from-dcp":  # parameters only: load them, train no step
            out.append(train(dataclasses.replace(cfg, steps=SAVE_AT), folder, resume=True,
                             load_optimizer=False))  # fmt: skip
        else:
            out.append(train(cfg, folder, resume=True))
    if tag == "w3-":  # negative control: the same resume without the optimizer state
        out.append(train(cases[1][2], f"{root}/{tag}1", resume=True, load_optimizer=False))
    return out


def _dcp_of_reference(root: str) -> None:
    """A plain GPT after the reference's first 2 steps, saved by DCP itself, imported."""
    import torch.distributed.checkpoint as dcp

    from labkit.checkpoint.dcp import from_dcp
    from labkit.labs.threed_ckpt import TIED
    from labkit.models.gpt import GPT

    model = GPT(TINY)
    ref = _reference(SAVE_AT)["params"]
    model.load_state_dict(ref, strict=False)  # the tied head follows wte
    dcp.save(model.state_dict(), checkpoint_id=f"{root}/dcp-native", no_dist=True)
    from_dcp(f"{root}/dcp-native", f"{root}/from-dcp", SAVE_AT, aliases=TIED)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("layouts"))
    # DCP's own save of the reference (this process, its own folders) while the ranks save
    with ThreadPoolExecutor(max_workers=1) as pool:
        dcp = pool.submit(_dcp_of_reference, root)
        run_ranks(_save_all, root, world_size=4, timeout=240)
        dcp.result()
    cases = {4: [*LOADS[4], ("from-dcp", "DCP -> dp1 tp2 pp2", _cfg(1, 2, 2))], 3: LOADS[3]}
    res = {w: run_ranks(_load_all, root, cases[w], f"w{w}-", world_size=w, timeout=240)
           for w in (4, 3)}  # fmt: skip
    return root, res


def _check(cfg: LabConfig, per_rank: list[dict], what: str) -> None:
    ref = _reference(cfg.steps)
    covered = set()
    for r in per_rank:
        assert r["start"] == SAVE_AT, what
        assert r["rng_restored"] == ("the same layout" in what), what
        for name, p in r["params"].items():
            want = ref["params"]["wte.weight" if name == "head.weight" else name]
            torch.testing.assert_close(p, want, atol=TOL, rtol=TOL, msg=f"{what}: {name}")
            covered.add(name)
        if r["losses"][0] is not None:
            assert r["losses"] == pytest.approx(ref["losses"][SAVE_AT:], abs=TOL), what
        assert r["scaler"]["scale"] == 64.0 and r["scaler"]["_growth_tracker"] == 0, what
    assert covered >= set(ref["params"]), what


@pytest.mark.timeout(600)
def test_resume_under_other_layouts_equals_single_process(matrix) -> None:
    _, res = matrix
    for world, cases in LOADS.items():
        for i, (saved, what, cfg) in enumerate(cases):
            _check(cfg, [r[i] for r in res[world]], f"{saved} -> {what}")
    # negative control: params restored but Adam's moments fresh: far from the reference
    cfg = LOADS[3][1][2]
    ref = _reference(cfg.steps)["params"]
    worst = max((p - ref[n]).abs().max().item() for r in res[3] for n, p in r[-1]["params"].items())
    assert worst > 100 * TOL


@pytest.mark.timeout(600)
def test_each_tensor_written_once_with_its_place(matrix) -> None:
    root, _ = matrix
    ckpt = load_logical(f"{root}/dp2tp2pp1")
    assert ckpt.layout["dp"] == 2 and ckpt.world_size == 4 and ckpt.step == SAVE_AT
    q = ckpt.tensors["optim/exp_avg/blocks.0.attn.q.weight"]
    assert q["shape"] == [32, 32] and q["tp_dim"] == 0
    assert len(q["chunks"]) == 4  # 2 tp boxes x 2 ZeRO ranges, one writer each
    assert "model/head.weight" not in ckpt.tensors  # the tied copy: stored once, as wte
    ln = ckpt.tensors["model/ln_f.weight"]  # replicated over tp: tp rank 0 writes, ZeRO-split
    assert {c["file"] for c in ln["chunks"]} <= {"rank_00000.pt", "rank_00002.pt"}
    assert ckpt.objects["scaler"]["scale"] == 32.0
    full = ckpt.full("model/wte.weight")
    assert full.shape == (64, 32) and torch.isfinite(full).all()
    for name in SAVES:  # every element of every tensor written exactly once, by one rank
        for key, e in load_logical(f"{root}/{name}").tensors.items():
            places = [Place(tuple(e["shape"]), tuple(c["offsets"]), tuple(c["sizes"]),
                            c["flat"] and tuple(c["flat"])) for c in e["chunks"]]  # fmt: skip
            whole = Place.whole(tuple(e["shape"]))
            covered = plan_read(places, whole)[1]
            assert covered == whole.numel == sum(p.numel for p in places), (name, key)


# ------------------------------------------------------------------ bad input
def _copy(matrix, tmp_path, name: str = "dp2tp2pp1"):
    root, _ = matrix
    shutil.copytree(f"{root}/{name}", tmp_path / name)
    return tmp_path / name


@pytest.mark.timeout(600)
def test_bad_input_names_the_tensor_and_both_shapes(matrix, tmp_path) -> None:
    from labkit.labs.threed_ckpt import check_checkpoint

    ckpt = load_logical(_copy(matrix, tmp_path))
    check_checkpoint(_cfg(1, 4, 1), ckpt)  # fits: no error
    wider = LabConfig(model=TINY.with_(n_embd=48), threed=_cfg(1, 2, 1).threed)
    with pytest.raises(CheckpointError, match=r"tensor 'model/wte.weight': the checkpoint "
                       r"holds shape \(64, 32\), the model expects \(64, 48\)"):  # fmt: skip
        check_checkpoint(wider, ckpt)
    with pytest.raises(CheckpointError, match=r"'model/blocks.4.ln1.weight' is not in"):
        check_checkpoint(LabConfig(model=TINY.with_(n_layer=5)), ckpt)
    with pytest.raises(CheckpointError, match=r"holds tensors this model lacks: \['model/blocks.3"):
        check_checkpoint(LabConfig(model=TINY.with_(n_layer=3)), ckpt)
    with pytest.raises(ValueError, match=r"tensor 'model/wte.weight' of shape \(64, 32\) cannot "
                       r"be cut into tp=3 shards of shape \(64/3, 32\)"):  # fmt: skip
        check_checkpoint(LabConfig(model=TINY, threed=ThreeDConfig(ParallelDegrees(1, 3, 1))), ckpt)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("damage", ["missing_file", "missing_chunk", "flipped_byte"])
def test_missing_shard_or_flipped_byte_refused(matrix, tmp_path, damage) -> None:
    import hashlib
    import json

    root = _copy(matrix, tmp_path)
    folder = root / f"step_{SAVE_AT:08d}"
    key = "model/blocks.0.mlp.fc.weight"  # (128, 32), cut by tp along dim 0
    if damage == "missing_file":
        (folder / "rank_00001.pt").unlink()
        match = r"missing: .*rank_00001.pt \(holds model/"
    elif damage == "missing_chunk":
        meta = json.loads((folder / "metadata.json").read_text())
        meta["tensors"][key]["chunks"].pop()
        data = json.dumps(meta).encode()  # a writer that forgot a chunk: its metadata sealed
        (folder / "metadata.json").write_bytes(data)
        record = json.loads((folder / "commit.json").read_text())
        record["metadata.json"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        (folder / "commit.json").write_text(json.dumps(record))
        match = rf"tensor '{key}' of shape \(128, 32\): the saved shards cover \d+ of the 4096"
    else:
        data = bytearray((folder / "rank_00003.pt").read_bytes())
        data[len(data) // 2] ^= 0x01
        (folder / "rank_00003.pt").write_bytes(data)
        match = r"corrupt \(sha256 mismatch\): .*rank_00003.pt"
    ckpt = load_logical(root)
    with pytest.raises(CheckpointError, match=match):
        for k in ckpt.tensors:
            ckpt.full(k)


# ------------------------------------------------------------------ DCP, both ways
@pytest.mark.timeout(600)
def test_dcp_reads_labkit_and_labkit_reads_dcp(matrix, tmp_path) -> None:
    """labkit (dp2 tp2 ZeRO-1 shards) -> DCP -> a plain GPT's state dict; and a plain GPT's
    DCP checkpoint -> labkit's dp1 x tp2 x pp2 layout (the fixture's last 4-rank case).
    Both equal the reference after the 2 steps the checkpoints hold. One process, CPU."""
    import torch.distributed.checkpoint as dcp

    from labkit.checkpoint.dcp import to_dcp
    from labkit.labs.threed_ckpt import TIED
    from labkit.models.gpt import GPT

    root, res = matrix
    ref = _reference(SAVE_AT)["params"]
    keys = to_dcp(load_logical(f"{root}/dp2tp2pp1"), tmp_path / "dcp", aliases=TIED)
    model = GPT(TINY)  # another init: every value must come from the checkpoint
    assert "head.weight" in keys and not torch.equal(model.wte.weight, ref["wte.weight"])
    state = model.state_dict()
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), ref[name], atol=TOL, rtol=TOL, msg=name)
    assert model.head.weight is model.wte.weight  # still tied after the load
    imported = [r[-1] for r in res[4]]  # the DCP -> labkit case
    for r in imported:
        assert r["start"] == SAVE_AT and r["losses"] == []
        for name, p in r["params"].items():
            want = ref["wte.weight" if name == "head.weight" else name]
            torch.testing.assert_close(p, want, atol=TOL, rtol=TOL, msg=f"dcp import: {name}")
    assert {n for r in imported for n in r["params"]} >= set(ref)
