"""Sharded checkpoints: reshard 4 -> 2 and 4 -> 3 bit-identically, atomic commits, verified
loads, and the fault drill (SIGKILL a rank, restart, end bit-identical). fp32, CPU, gloo.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
from pathlib import Path

import pytest
import torch

from labkit.checkpoint import (
    CheckpointError,
    latest_step,
    load_checkpoint,
    save_checkpoint,
    shard_range,
)
from labkit.labs.drill import DrillConfig, run_drill, train
from labkit.launch import LaunchError
from tests.ranks import run_ranks

RESHARD = DrillConfig(steps=6, ckpt_every=2, keep=3, reshardable=True)


def _drill_on_warm_ranks(cfg: DrillConfig, ckpt_dir: Path, world_size: int) -> list:
    """``run_drill`` without a fresh launch: the runs that kill nothing share warm ranks."""
    cfg.validate(world_size)
    return run_ranks(train, cfg, str(ckpt_dir), world_size=world_size, timeout=90)


@pytest.fixture(scope="module")
def reshard_runs(tmp_path_factory):
    """Train 6 steps on 4 ranks (checkpoints at 2, 4, 6); continue from step 2 on 2 ranks and
    from step 4 on 3 ranks, each in a folder holding only that checkpoint."""
    root = tmp_path_factory.mktemp("reshard")
    runs = {4: _drill_on_warm_ranks(RESHARD, root / "w4", world_size=4)}
    for world_size, start in ((2, 2), (3, 4)):
        src = root / "w4" / f"step_{start:08d}"
        shutil.copytree(src, root / f"w{world_size}" / src.name)
        runs[world_size] = _drill_on_warm_ranks(RESHARD, root / f"w{world_size}", world_size)
    return root, runs


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_reshard_4_to_2_and_3_continues_bit_identically(reshard_runs):
    _, runs = reshard_runs
    ref = runs[4][0]
    assert ref["resumed_from"] is None and ref["scales"][3] < ref["scales"][2]  # step 3 overflowed
    for world_size, start in ((2, 2), (3, 4)):
        for rank, out in enumerate(runs[world_size]):
            assert out["resumed_from"] == start
            assert torch.equal(out["params"], ref["params"]), f"{world_size} ranks, rank {rank}"
            assert out["scaler"] == ref["scaler"]
            assert out["scales"] == ref["scales"][start:]


@pytest.mark.timeout(240)
def test_layout_metadata_and_partial_reads(reshard_runs):
    root, _ = reshard_runs
    assert latest_step(root / "w4") == 6
    ckpt = load_checkpoint(root / "w4", 4)
    assert ckpt.world_size == 4 and ckpt.step == 4
    assert sorted(p.name for p in ckpt.path.iterdir()) == [
        "commit.json",
        "common.pt",
        "metadata.json",
        *(f"shard_{r:05d}.pt" for r in range(4)),
    ]
    for key, entry in ckpt.meta["tensors"].items():
        ranges = [(s, e) for _, s, e in entry["slices"]]
        assert ranges == [shard_range(entry["numel"], r, 4) for r in range(4)], key
    state = ckpt.state()
    assert state["sampler"]["step"] == 4 and set(state) == {"model", "optim", "scaler", "sampler"}
    assert state["optim"]["state"][0]["exp_avg"].shape == state["model"]["wte.weight"].shape
    # a range inside rank 0's slice reads only rank 0's file
    fresh = load_checkpoint(root / "w4", 4)
    key = "/model/wte.weight"
    head = fresh.read_slice(key, 0, 10)
    assert list(fresh._cache) == ["shard_00000.pt"]
    assert torch.equal(head, state["model"]["wte.weight"].reshape(-1)[:10])
    assert ckpt.rank_state(1, 4) is not None and ckpt.rank_state(1, 3) is None


def _copy_ckpt(root: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "c"
    shutil.copytree(root / "w4" / "step_00000004", dst / "step_00000004")
    return dst


@pytest.mark.timeout(240)
@pytest.mark.parametrize("damage", ["corrupt", "truncated", "missing", "common"])
def test_damaged_files_give_a_clear_error_naming_the_file(reshard_runs, tmp_path, damage):
    root, _ = reshard_runs
    dst = _copy_ckpt(root, tmp_path)
    folder = dst / "step_00000004"
    name = {"corrupt": "shard_00002.pt", "truncated": "shard_00001.pt", "missing": "shard_00003.pt",
            "common": "common.pt"}[damage]  # fmt: skip
    target = folder / name
    data = bytearray(target.read_bytes())
    if damage == "truncated":
        target.write_bytes(data[: len(data) // 2])
    elif damage == "missing":
        target.unlink()
    else:
        data[len(data) // 2] ^= 0x01  # one flipped bit
        target.write_bytes(data)
    with pytest.raises(
        CheckpointError,
        match={"truncated": "truncated", "missing": "missing"}.get(damage, "corrupt"),
    ) as err:
        load_checkpoint(dst)
    assert str(target) in str(err.value)


def _reseal(folder: Path) -> None:
    """Rewrite the commit record for an edited metadata.json (what a forger would do)."""
    data = (folder / "metadata.json").read_bytes()
    record = json.loads((folder / "commit.json").read_text())
    record["metadata.json"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / "commit.json").write_text(json.dumps(record))


def test_loading_refuses_arbitrary_pickles_even_with_matching_checksums(tmp_path):
    save_checkpoint(tmp_path, 1, {"w": torch.ones(3)})
    folder = tmp_path / "step_00000001"
    buf = io.BytesIO()
    torch.save({"slices": {}, "rank_state": {"evil": Path("/")}}, buf)  # not a tensor/container
    (folder / "shard_00000.pt").write_bytes(buf.getvalue())
    meta = json.loads((folder / "metadata.json").read_text())

    meta["files"]["shard_00000.pt"] = {
        "bytes": len(buf.getvalue()),
        "sha256": hashlib.sha256(buf.getvalue()).hexdigest(),
    }
    (folder / "metadata.json").write_text(json.dumps(meta))
    _reseal(folder)
    with pytest.raises(CheckpointError, match="weights_only"):
        load_checkpoint(tmp_path).rank_state(0, 1)


def test_crash_between_shard_writes_and_commit_keeps_previous_checkpoint(tmp_path):
    """World of one, no processes: the crash hook raises after the shard is durable."""
    states = {s: {"w": torch.full((5,), float(s)), "meta": {"step": s}} for s in (1, 2, 3)}
    save_checkpoint(tmp_path, 1, states[1], keep=2)
    save_checkpoint(tmp_path, 2, states[2], keep=2)

    def crash() -> None:
        raise KeyboardInterrupt("power cut")

    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 3, states[3], keep=2, before_commit=crash)
    assert (tmp_path / ".tmp-step_00000003" / "shard_00000.pt").is_file()  # written, not committed
    assert latest_step(tmp_path) == 2
    assert torch.equal(load_checkpoint(tmp_path).state()["w"], states[2]["w"])
    # the next save of that step cleans the debris, commits, and keeps only the newest 2
    save_checkpoint(tmp_path, 3, states[3], keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest.json",
        "step_00000002",
        "step_00000003",
    ]
    loaded = load_checkpoint(tmp_path).state()
    assert loaded["meta"] == {"step": 3} and torch.equal(loaded["w"], states[3]["w"])


def test_no_checkpoint_and_bad_arguments(tmp_path):
    with pytest.raises(CheckpointError, match="no committed checkpoint"):
        load_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="keep"):
        save_checkpoint(tmp_path, 1, {}, keep=0)
    with pytest.raises(ValueError, match="not divisible"):
        run_drill(DrillConfig(global_batch=10), tmp_path, world_size=3)
    with pytest.raises(ValueError, match="kill_marker"):
        run_drill(DrillConfig(kill_rank=1, kill_at_step=3), tmp_path, world_size=2)
    assert shard_range(10, 3, 4) == (9, 10) and shard_range(2, 3, 4) == (2, 2)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_kill_a_rank_and_resume_bit_identically(tmp_path):
    """dp mode on 2 ranks (all_reduce, one RNG stream per rank, restored from the shards).

    A: rank 1 SIGKILLs itself in the middle of step 5; the launcher's max_restarts=1
       restarts both ranks, which resume from step 4.
    B: rank 1 SIGKILLs itself between writing its shard of step 4 and the commit; the job
       fails, step 2 is still the newest checkpoint; a relaunch resumes from it.
    Both end bit-identical to an uninterrupted run of the same length.
    """
    cfg = DrillConfig(steps=6, ckpt_every=2)
    ref = _drill_on_warm_ranks(cfg, tmp_path / "ref", world_size=2)

    a = DrillConfig(
        steps=6, ckpt_every=2, kill_rank=1, kill_at_step=5, kill_marker=str(tmp_path / "a.killed")
    )
    out_a = run_drill(a, tmp_path / "a", world_size=2, max_restarts=1)
    assert (tmp_path / "a.killed").exists()

    b = DrillConfig(steps=6, ckpt_every=2, kill_rank=1, kill_at_step=4, kill_in_save=True,
                    kill_marker=str(tmp_path / "b.killed"))  # fmt: skip
    with pytest.raises(LaunchError):
        run_drill(b, tmp_path / "b", world_size=2)
    assert latest_step(tmp_path / "b") == 2
    assert (tmp_path / "b" / ".tmp-step_00000004" / "shard_00000.pt").exists() or (
        tmp_path / "b" / ".tmp-step_00000004" / "shard_00001.pt"
    ).exists()
    # the relaunch kills nothing (the marker is there): warm ranks, from the shards alone
    out_b = _drill_on_warm_ranks(b, tmp_path / "b", world_size=2)

    for name, out, start in (("A", out_a, 4), ("B", out_b, 2)):
        for rank in range(2):
            assert out[rank]["resumed_from"] == start, name
            assert torch.equal(out[rank]["params"], ref[rank]["params"]), f"{name}: rank {rank}"
            assert out[rank]["scaler"] == ref[rank]["scaler"]
            assert out[rank]["losses"] == ref[rank]["losses"][start:]


def test_crash_between_the_renames_of_a_resave_keeps_the_good_checkpoint(tmp_path, monkeypatch):
    """Re-saving step 2 displaces the committed step_2 before the new one is renamed in. A crash
    between the two renames must leave step 2 loadable, and the next save must not prune it."""
    import os

    good, newer = {"w": torch.full((5,), 2.0)}, {"w": torch.full((5,), 20.0)}
    save_checkpoint(tmp_path, 1, {"w": torch.ones(5)}, keep=2)
    save_checkpoint(tmp_path, 2, good, keep=2)
    real_rename = os.rename

    def crash_on_commit(src, dst):  # the displacing rename goes through, the commit does not
        if Path(src).name.startswith(".tmp-"):
            raise KeyboardInterrupt("power cut between the renames")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", crash_on_commit)  # the commit lives in checkpoint.layout
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 2, newer, keep=2)
    monkeypatch.setattr(os, "rename", real_rename)
    assert not (tmp_path / "step_00000002").exists()  # the crash window really was hit
    assert latest_step(tmp_path) == 2
    assert torch.equal(load_checkpoint(tmp_path).state()["w"], good["w"])
    assert torch.equal(load_checkpoint(tmp_path, 2).state()["w"], good["w"])
    # the next save (keep=2) restores step 2 before pruning: steps 2 and 3 survive, step 1 goes
    save_checkpoint(tmp_path, 3, {"w": torch.full((5,), 3.0)}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest.json",
        "step_00000002",
        "step_00000003",
    ]
    assert torch.equal(load_checkpoint(tmp_path, 2).state()["w"], good["w"])
    # and a re-save that completes replaces step 2 and leaves no displaced copy behind; step 3
    # (newer than the re-saved step: an abandoned trajectory) is moved aside, not resumed
    with pytest.warns(RuntimeWarning, match="step 3 .* moved aside"):
        save_checkpoint(tmp_path, 2, newer, keep=3)
    assert torch.equal(load_checkpoint(tmp_path, 2).state()["w"], newer["w"])
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names[1:] == ["latest.json", "step_00000002"], names
    assert names[0].startswith(".abandoned-step_00000003-") and latest_step(tmp_path) == 2
