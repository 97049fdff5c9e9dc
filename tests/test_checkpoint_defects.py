"""Checkpoint defects of issue 34, each proven by a test that failed before its fix.

1. a resumed run keeps its new saves ("latest" is the last commit, not the largest step);
2. DCP's ``.metadata`` is never unpickled plainly (a planted one runs nothing);
10. a checkpoint of another model (5 layers into 4, untied into tied) is refused, named;
11. a same-layout resume with an explicit pipeline cut gets its RNG back;
12. the metadata is hashed in the commit record; a bad field is a CheckpointError naming it;
13. an asynchronous save in flight at interpreter exit is finished (or reported by step).

World of one and no process group unless said (a 1-rank launch for the lab's resume).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from labkit.checkpoint import (
    AsyncCheckpointer,
    CheckpointError,
    LogicalState,
    Place,
    latest_step,
    load_checkpoint,
    load_logical,
    save_checkpoint,
    save_logical,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
REPO = Path(__file__).resolve().parents[1]


def _st(step: int) -> dict:
    return {"w": torch.full((6,), float(step)), "meta": {"step": step}}


def _save(kind: str, root: Path, step: int, keep: int) -> Path:
    if kind == "sync":
        return save_checkpoint(root, step, _st(step), keep=keep)
    return AsyncCheckpointer(root, keep=keep).save(step, _st(step)).wait()


# ------------------------------------------------------------------ 1: latest = last commit
@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("keep", [1, 3])
def test_a_resumed_run_keeps_its_new_saves(tmp_path: Path, kind: str, keep: int) -> None:
    """Steps 10 and 20 saved; a run resumes from 10 and saves 11, 12, 13: each save survives
    (keep=1 used to delete the save it had just made) and a restart resumes from 13, not 20.
    Step 20 (an abandoned trajectory) is moved aside, with a warning naming it."""
    for step in (10, 20):
        save_checkpoint(tmp_path, step, _st(step), keep=3)
    assert load_checkpoint(tmp_path, 10).step == 10  # the resume
    with pytest.warns(RuntimeWarning, match="step 20 .* moved aside"):
        path = _save(kind, tmp_path, 11, keep)
    for step in (12, 13):
        assert path.is_dir() and latest_step(tmp_path) == step - 1
        path = _save(kind, tmp_path, step, keep)
    assert path.is_dir() and latest_step(tmp_path) == 13
    restart = load_checkpoint(tmp_path)
    assert restart.step == 13 and torch.equal(restart.state()["w"], _st(13)["w"])
    kept = sorted(p.name for p in tmp_path.glob("step_*"))
    assert kept == [f"step_{s:08d}" for s in (10, 11, 12, 13)][-keep:]
    (aside,) = tmp_path.glob(".abandoned-step_00000020-*")  # kept, never deleted
    assert json.loads((aside / "metadata.json").read_text())["step"] == 20


def test_a_corrupt_pointer_is_refused_not_read_as_another_step(tmp_path: Path) -> None:
    for step in (1, 2):
        save_checkpoint(tmp_path, step, _st(step))
    pointer = tmp_path / "latest.json"
    pointer.write_text(pointer.read_text().replace('"step": 2', '"step": 1'))
    with pytest.raises(CheckpointError, match=r"latest.json is corrupt"):
        load_checkpoint(tmp_path)
    pointer.unlink()  # no pointer (a folder copied by hand): the newest committed folder
    assert load_checkpoint(tmp_path).step == 2


# ------------------------------------------------------------------ 2: DCP metadata
class _Plant:
    """What an attacker pickles: unpickling calls ``open(marker, "w")``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (open, (str(self.marker), "w"))


def test_a_planted_dcp_metadata_runs_nothing(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from labkit.checkpoint.dcp import from_dcp

    state = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}
    dcp.save(state, checkpoint_id=str(tmp_path / "real"), no_dist=True)
    from_dcp(tmp_path / "real", tmp_path / "labkit", 7, prefix="")  # a real one converts
    ckpt = load_logical(tmp_path / "labkit")
    assert ckpt.step == 7 and all(torch.equal(ckpt.full(k), v) for k, v in state.items())

    marker = tmp_path / "pwned"
    for payload in (_Plant(marker), {"x": _Plant(marker)}):
        (tmp_path / "real" / ".metadata").write_bytes(pickle.dumps(payload))
        with pytest.raises(CheckpointError, match=r"refusing DCP metadata .*\.metadata.*open"):
            from_dcp(tmp_path / "real", tmp_path / "other", 8, prefix="")
        assert not marker.exists()  # nothing ran
    (tmp_path / "real" / ".metadata").write_bytes(pickle.dumps([1, 2]))  # allowed, not DCP's
    with pytest.raises(CheckpointError, match="holds a list"):
        from_dcp(tmp_path / "real", tmp_path / "other", 8, prefix="")
    assert latest_step(tmp_path / "other") is None


# ------------------------------------------------------------------ 10: one to one
def _gpt_ckpt(root: Path, **cfg: object) -> Path:
    from labkit.checkpoint.zero_state import ShardInfo, collect
    from labkit.labs.threed import TINY
    from labkit.labs.threed_ckpt import TIED
    from labkit.models.gpt import GPT

    model_cfg = TINY.with_(**cfg)
    info = ShardInfo(aliases=TIED if model_cfg.tie_weights else {})
    return save_logical(root, 2, collect(list(GPT(model_cfg).named_parameters()), None, info))


@pytest.mark.parametrize(
    ("saved", "model", "first"),
    [({"n_layer": 5}, {}, "model/blocks.4.ln1.weight"),
     ({"tie_weights": False}, {}, "model/head.weight"),
     ({}, {"tie_weights": False}, "model/head.weight"),
     ({}, {"n_layer": 3}, "model/blocks.3.ln1.weight")],
)  # fmt: skip
def test_restore_refuses_another_model_naming_the_first_tensor(tmp_path, saved, model, first):
    from labkit.checkpoint.zero_state import ShardInfo, restore
    from labkit.labs.threed import TINY
    from labkit.labs.threed_ckpt import TIED, model_shapes
    from labkit.models.gpt import GPT

    ckpt = load_logical(_gpt_ckpt(tmp_path, **saved).parent)
    live_cfg = TINY.with_(**model)
    named = list(GPT(live_cfg).named_parameters())
    info = ShardInfo(aliases=TIED if live_cfg.tie_weights else {})
    with pytest.raises(CheckpointError, match=rf"does not match the model: tensor '{first}'"):
        restore(ckpt, named, None, info, model=model_shapes(live_cfg))
    same = load_logical(_gpt_ckpt(tmp_path / "same", **model).parent)  # negative control
    restore(same, named, None, info, model=model_shapes(live_cfg))


def _resume_lab(root: str, n_layer: int, tie: bool) -> object:
    from labkit.labs.threed import TINY, LabConfig
    from labkit.labs.threed_ckpt import train
    from labkit.parallel import ParallelDegrees
    from labkit.parallel.threed import ThreeDConfig

    one = ThreeDConfig(ParallelDegrees(1, 1, 1), micro_batches=1, micro_batch=1)
    cfg = LabConfig(model=TINY.with_(n_layer=n_layer, tie_weights=tie), threed=one, steps=3)
    try:  # the checkpoints hold parameters only: fresh Adam moments
        return train(cfg, root, resume=True, load_optimizer=False)["start"]
    except CheckpointError as exc:
        return str(exc)


@pytest.mark.timeout(120)
def test_the_lab_resume_refuses_another_model(tmp_path: Path) -> None:
    """labs/threed_ckpt.train(resume=True): a 5-layer checkpoint into a 4-layer model and an
    untied one into a tied model are refused (they used to resume, dropping block 4 or the
    head); the matching checkpoint resumes (negative control). One rank."""
    from tests.ranks import run_ranks

    five, untied, four = (_gpt_ckpt(tmp_path / n, **c).parent for n, c in
                          (("five", {"n_layer": 5}), ("untied", {"tie_weights": False}),
                           ("four", {})))  # fmt: skip
    out = [run_ranks(_resume_lab, str(r), 4, True, world_size=1)[0] for r in (five, untied, four)]
    assert "'model/blocks.4.ln1.weight'" in str(out[0]), out[0]
    assert "'model/head.weight'" in str(out[1]), out[1]
    assert out[2] == 2, out[2]


def test_the_sharded_format_refuses_another_model_too(tmp_path: Path) -> None:
    """``Checkpoint.expect`` (labs/drill.py, labs/node_loss_train.py load through it): the
    saved tensors under a prefix are the model's, one to one, or the first one is named."""
    from labkit.labs.threed import TINY
    from labkit.models.gpt import GPT

    five, four = GPT(TINY.with_(n_layer=5)), GPT(TINY)
    save_checkpoint(tmp_path, 1, {"model": five.state_dict(), "step": 1})
    shapes = {k: tuple(v.shape) for k, v in four.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"tensor 'blocks.4.ln1.weight' .* not in the model"):
        load_checkpoint(tmp_path).expect(shapes, "/model/")
    wider = {**shapes, "wte.weight": (64, 48)}
    with pytest.raises(CheckpointError, match=r"'wte.weight' has shape \(64, 32\) there, the mo"):
        load_checkpoint(tmp_path).expect(wider, "/model/")
    load_checkpoint(tmp_path).expect({k: tuple(v.shape) for k, v in five.state_dict().items()},
                                     "/model/")  # fmt: skip


# ------------------------------------------------------------------ 11: a pipeline cut
def test_same_layout_with_a_cut_restores_rank_state(tmp_path: Path) -> None:
    """``stage_layers`` comes back from JSON as a list: a same-layout resume compared it with
    the live tuple and lost its RNG. (The 4-rank resume: tests/test_checkpoint_layouts.py.)"""
    rng = torch.get_rng_state()
    layout = {"dp": 2, "pp": 2, "stage_layers": (3, 1)}
    state = LogicalState(layout=layout, rank_state={"torch_rng": rng})
    state.add("w", torch.ones(4), Place.whole((4,)))
    ckpt = load_logical(save_logical(tmp_path, 1, state).parent)
    mine = ckpt.rank_state(0, layout)
    assert mine is not None and torch.equal(mine["torch_rng"], rng)
    assert ckpt.rank_state(0, {**layout, "stage_layers": (2, 2)}) is None  # another cut


# ------------------------------------------------------------------ 12: metadata checksum
def test_a_changed_digit_in_the_metadata_is_refused(tmp_path: Path) -> None:
    """One digit of metadata.json changed, the file still valid JSON of the same size: it
    used to load a different state silently (another step, another Adam step count)."""
    save_checkpoint(tmp_path / "s", 5, _st(5))
    state = LogicalState(objects={"optim/step_count": 5})
    state.add("w", torch.ones(4), Place.whole((4,)))
    save_logical(tmp_path / "l", 5, state)
    for folder, old, new in ((tmp_path / "s" / "step_00000005", '"step": 5', '"step": 6'),
                             (tmp_path / "l" / "step_00000005", '"optim/step_count": 5',
                              '"optim/step_count": 6')):  # fmt: skip
        meta = folder / "metadata.json"
        text = meta.read_text()
        assert old in text
        meta.write_text(text.replace(old, new))
        load = load_checkpoint if folder.parent.name == "s" else load_logical
        with pytest.raises(CheckpointError, match=rf"{meta}.* corrupt.*commit.json"):
            load(folder.parent)


def _reseal(folder: Path, meta: dict) -> None:
    data = json.dumps(meta).encode()
    (folder / "metadata.json").write_bytes(data)
    record = {"step": meta["step"], "metadata.json": {"bytes": len(data),
              "sha256": hashlib.sha256(data).hexdigest()}}  # fmt: skip
    (folder / "commit.json").write_text(json.dumps(record))


@pytest.mark.parametrize("edit", ["dtype", "slices", "drop_key", "files"])
def test_a_malformed_metadata_field_is_a_checkpoint_error_naming_the_file(tmp_path, edit):
    """Well-formed JSON, its hash recorded, but a bad field: named, never a foreign error
    (``torch has no attribute float33``, ``list index out of range``, a bare KeyError)."""
    save_checkpoint(tmp_path, 1, _st(1))
    folder = tmp_path / "step_00000001"
    meta = json.loads((folder / "metadata.json").read_text())
    entry = meta["tensors"]["/w"]
    if edit == "dtype":
        entry["dtype"] = "float33"
    elif edit == "slices":
        entry["slices"] = [[3, 0, 6]]  # rank 3 of a world of 1
    elif edit == "drop_key":
        del entry["numel"]
    else:
        meta["files"]["../escape.pt"] = meta["files"].pop("common.pt")
    _reseal(folder, meta)
    with pytest.raises(CheckpointError, match=rf"metadata file {folder / 'metadata.json'}"):
        load_checkpoint(tmp_path).state()


# ------------------------------------------------------------------ 13: a save at exit
_AT_EXIT = """
import sys, time, torch
from labkit.checkpoint import AsyncCheckpointer

def fault(point):
    if point == "written":
        time.sleep(2.0)  # the interpreter reaches its end while the writer is here
    if point == "before_commit" and sys.argv[2] == "fail":
        raise OSError("disk full")

saver = AsyncCheckpointer(sys.argv[1], fault=fault)
saver.save(3, {"w": torch.ones(4)})
print("main done", flush=True)  # no finish(): the program just ends
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("outcome", ["ok", "fail"])
def test_a_save_in_flight_at_exit_is_finished_or_reported(tmp_path: Path, outcome: str) -> None:
    script = tmp_path / "exit.py"
    script.write_text(textwrap.dedent(_AT_EXIT))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, str(script), str(tmp_path / "ck"), outcome],
                         capture_output=True, text=True, timeout=100, env=env)  # fmt: skip
    assert res.returncode == 0 and "main done" in res.stdout, res.stderr
    assert "checkpoint of step 3 was still being written at exit" in res.stderr, res.stderr
    if outcome == "ok":
        assert latest_step(tmp_path / "ck") == 3  # used to be None: the daemon writer died
        assert torch.equal(load_checkpoint(tmp_path / "ck").state()["w"], torch.ones(4))
    else:
        assert "WARNING: the checkpoint of step 3 was NOT written" in res.stderr, res.stderr
        assert "disk full" in res.stderr and latest_step(tmp_path / "ck") is None
