"""Asynchronous saves: the snapshot is taken at the call, the write runs while training goes
on, the next save waits for the previous one, and a crash or kill during the background write
leaves the previous checkpoint the newest (and no half-written one is ever read).

World of one, no process group (the 4-rank background saves of a 3D run are loaded under
other layouts in tests/test_checkpoint_layouts.py); one subprocess for the SIGKILL.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from labkit.checkpoint import (
    AsyncCheckpointer,
    CheckpointError,
    latest_step,
    load_checkpoint,
    load_logical,
)
from labkit.checkpoint.commit import commit, prepare, write_part


def _state(step: int) -> dict:
    return {"w": torch.full((1000,), float(step)), "meta": {"step": step}}


def test_snapshot_at_the_call_write_while_training_runs(tmp_path: Path) -> None:
    """The writer is held at "written" until the main thread has changed the tensor: the
    checkpoint still holds the values at the call (the copy was taken), and the main thread
    ran while the save was in flight."""
    release, reached = threading.Event(), threading.Event()

    def hold(point: str) -> None:
        if point == "written":
            reached.set()
            assert release.wait(30)

    saver = AsyncCheckpointer(tmp_path, keep=2, fault=hold)
    state = _state(1)
    handle = saver.save(1, state, rank_state={"rng": torch.get_rng_state()})
    assert reached.wait(30) and not handle.done()
    state["w"].add_(100.0)  # training goes on: the parameters change in place
    assert latest_step(tmp_path) is None  # nothing committed yet
    release.set()
    assert handle.wait(30) == tmp_path / "step_00000001" and handle.done()
    loaded = load_checkpoint(tmp_path)
    assert torch.equal(loaded.state()["w"], torch.full((1000,), 1.0))
    mine = loaded.rank_state(0, 1)
    assert mine is not None and torch.equal(mine["rng"], torch.get_rng_state())


def test_next_save_waits_for_the_previous_and_keeps_the_newest(tmp_path: Path) -> None:
    order: list[str] = []

    def slow(point: str) -> None:
        if point == "written":
            time.sleep(0.2)
            order.append("written")

    saver = AsyncCheckpointer(tmp_path, keep=2, fault=slow)
    for step in (1, 2, 3):
        saver.save(step, _state(step))
        order.append(f"called {step}")
    saver.wait()
    # each save returned before its write ended, and started only after the previous's
    assert order == ["called 1", "written", "called 2", "written", "called 3", "written"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest.json",
        "step_00000002",
        "step_00000003",
    ]
    assert load_checkpoint(tmp_path).state()["meta"] == {"step": 3}


@pytest.mark.parametrize("point", ["written", "before_commit"])
def test_exception_in_the_background_write_keeps_the_last_good(tmp_path: Path, point) -> None:
    def crash(at: str) -> None:
        if at == point:
            raise OSError(f"disk full at {at}")

    AsyncCheckpointer(tmp_path).save(1, _state(1)).wait()
    saver = AsyncCheckpointer(tmp_path, fault=crash)
    handle = saver.save(2, _state(2))
    with pytest.raises(OSError, match="disk full"):
        handle.wait(30)
    assert latest_step(tmp_path) == 1 and (tmp_path / ".tmp-step_00000002").is_dir()
    assert torch.equal(load_checkpoint(tmp_path).state()["w"], _state(1)["w"])
    AsyncCheckpointer(tmp_path).save(2, _state(2)).wait()  # the retry commits, debris gone
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest.json",
        "step_00000001",
        "step_00000002",
    ]


KILLED = """
import os, signal, sys, torch
from labkit.checkpoint import AsyncCheckpointer, LogicalState, Place
root = sys.argv[1]
def state(v):
    s = LogicalState(layout={"dp": 1})
    s.add("model/w", torch.full((4, 250), v), Place.whole((4, 250)))
    return s
AsyncCheckpointer(root).save_logical(1, state(1.0)).wait()
def die(point):
    if point == "written":  # the shard is on disk, its part record is not
        os.kill(os.getpid(), signal.SIGKILL)
AsyncCheckpointer(root, fault=die).save_logical(2, state(2.0)).wait()
print("not reached")
"""


@pytest.mark.timeout(120)
def test_sigkill_during_the_background_write_keeps_the_last_good(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", KILLED, str(tmp_path)], capture_output=True,
                          text=True, timeout=100)  # fmt: skip
    assert proc.returncode == -9 and "not reached" not in proc.stdout, proc.stderr
    assert (tmp_path / ".tmp-step_00000002" / "rank_00000.pt").is_file()  # really mid-write
    assert latest_step(tmp_path) == 1
    ckpt = load_logical(tmp_path)
    ckpt.verify()
    assert ckpt.step == 1 and torch.equal(ckpt.full("model/w"), torch.full((4, 250), 1.0))


def test_commit_refuses_when_a_rank_never_writes_its_part(tmp_path: Path) -> None:
    """Two ranks, rank 1 died before its part: rank 0's commit names it, commits nothing."""
    tmp, final = prepare(tmp_path, 5, None)
    write_part(tmp, 0, {"rank_00000.pt": b"x"}, {"chunks": {}, "tp_dims": {}, "objects": {},
                                                 "layout": {}}, None)  # fmt: skip
    with pytest.raises(CheckpointError, match=r"ranks \[1\] of 2 never wrote their part"):
        commit(tmp_path, tmp, final, 2, lambda parts: {}, keep=3, timeout=0.2)
    assert latest_step(tmp_path) is None and not final.exists()


def _two_ranks(root: str) -> list[float]:
    """Each rank saves steps 1-3 in the background and runs all-reduces (training) meanwhile;
    rank 1's writer is slow, so rank 0's commit must wait for its part."""
    import torch.distributed as dist

    rank = dist.get_rank()

    def slow(point: str) -> None:
        if point == "written" and rank == 1:
            time.sleep(0.3)

    saver = AsyncCheckpointer(root, keep=2, fault=slow)
    sums = []
    for step in (1, 2, 3):
        w = torch.arange(10.0) * step  # replicated state, each rank writes its flat slice
        saver.save(step, {"w": w, "step": step}, rank_state={"rank": torch.tensor(rank)})
        x = torch.ones(4) * step
        dist.all_reduce(x)  # a training collective while the write is in flight
        sums.append(x[0].item())
    assert saver.finish() == Path(root) / "step_00000003"  # committed on every rank
    assert load_checkpoint(root).step == 3
    return sums


@pytest.mark.timeout(120)
def test_two_ranks_save_in_the_background_while_collectives_run(tmp_path: Path) -> None:
    from tests.ranks import run_ranks

    out = run_ranks(_two_ranks, str(tmp_path), world_size=2, timeout=90)
    assert out == [[2.0, 4.0, 6.0]] * 2
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.step == 3 and ckpt.world_size == 2
    assert torch.equal(ckpt.state()["w"], torch.arange(10.0) * 3)
    assert [ckpt.rank_state(r, 2)["rank"].item() for r in (0, 1)] == [0, 1]  # type: ignore[index]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest.json",
        "step_00000002",
        "step_00000003",
    ]
