"""Corruption fuzz: every file of two small 2-rank checkpoints (the sharded and the logical
format: shards, metadata, commit records, the ``latest.json`` pointer, part records), damaged
at random -- a few bytes flipped, the file truncated, or deleted -- hundreds of times.

Each try must either load the *identical* state (a damaged file nothing reads, a flipped
byte that leaves JSON meaning the same, a deleted pointer that falls back to the newest
folder) or raise a :class:`CheckpointError` whose message names the damaged file. Never a
different state, never another exception. Negative control: the comparison tells the two
saved steps apart. The seed is fixed; the counts are printed (``pytest -s``).
"""

from __future__ import annotations

import random
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from labkit.checkpoint import CheckpointError, LogicalState, Place, load_checkpoint, load_logical
from tests.ranks import run_ranks

TRIES = 400
LAYOUT = {"dp": 2, "stage_layers": [3, 1]}


def _save_both(root: str) -> None:
    """Two ranks save steps 1 and 2 in both formats (state differs between the steps)."""
    import torch.distributed as dist

    from labkit.checkpoint import save_checkpoint, save_logical

    rank = dist.get_rank()
    for step in (1, 2):
        g = torch.Generator().manual_seed(step)
        w, b = torch.randn(7, 5, generator=g), torch.randn(3, generator=g).to(torch.bfloat16)
        state = {"model": {"w": w, "b": b}, "optim": {"step": step, "m": w * 0.5},
                 "sampler": {"epoch": step, "order": [3, 1, 2]}}  # fmt: skip
        save_checkpoint(f"{root}/sharded", step, state, rank_state={"rng": torch.randn(4)})
        logical = LogicalState(objects={"optim/step_count": step, "scaler": {"scale": 2.0**step}},
                               layout=LAYOUT, rank_state={"rng": torch.randn(4)})  # fmt: skip
        rows = slice(4 * rank, min(4 * rank + 4, 7))  # a dim-0 cut: rows 0-3 and 4-6
        box = Place((7, 5), (rows.start, 0), (rows.stop - rows.start, 5))
        logical.add("model/w", w[rows], box, 0)
        flat = (0, 2) if rank == 0 else (2, 3)  # a ZeRO-style flat range of a replicated tensor
        logical.add("model/b", b[flat[0] : flat[1]], Place.whole((3,), flat))
        save_logical(f"{root}/logical", step, logical)


def _load(kind: str, root: Path) -> Any:
    if kind == "sharded":
        ck = load_checkpoint(root)
        return ck.step, ck.state(), [ck.rank_state(r, 2) for r in range(2)]
    lc = load_logical(root)
    full = {k: lc.full(k) for k in lc.tensors}
    return lc.step, full, lc.objects, lc.layout, [lc.rank_state(r, LAYOUT) for r in range(2)]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b))  # fmt: skip
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b


def _damage(file: Path, rng: random.Random) -> str:
    data = bytearray(file.read_bytes())
    how = rng.choice(["flip", "flip", "truncate", "delete"])
    if how == "delete" or not data:
        file.unlink()
        return "delete"
    if how == "truncate":
        file.write_bytes(data[: rng.randrange(len(data))])
        return how
    for _ in range(rng.randint(1, 3)):
        data[rng.randrange(len(data))] ^= rng.randint(1, 255)
    file.write_bytes(data)
    return how


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fuzz")
    run_ranks(_save_both, str(root), world_size=2, timeout=120)
    return root


@pytest.mark.timeout(240)
def test_every_damage_loads_the_same_state_or_is_refused_naming_the_file(saved, tmp_path):
    refs = {kind: _load(kind, saved / kind) for kind in ("sharded", "logical")}
    older = load_checkpoint(saved / "sharded", 1)  # negative control: the comparison sees it
    assert not _same((1, older.state(), [older.rank_state(r, 2) for r in range(2)]),
                     refs["sharded"])  # fmt: skip
    files = [(kind, p.relative_to(saved / kind)) for kind in refs  # step 2 and the pointer;
             for p in sorted((saved / kind).rglob("*"))  # step 1 stays: a pointer misread
             if p.is_file() and "step_00000001" not in p.parts]  # as 1 would load it  # fmt: skip
    rng = random.Random(34)
    outcomes: Counter[tuple[str, str, str]] = Counter()
    start = time.perf_counter()
    for i in range(TRIES):
        kind, rel = files[i % len(files)] if i < len(files) else rng.choice(files)
        work = tmp_path / f"t{i}"
        shutil.copytree(saved / kind, work)
        how = _damage(work / rel, rng)
        try:
            got = _load(kind, work)
        except CheckpointError as exc:
            assert str(work / rel) in str(exc), f"{how} {rel}: the error names another file: {exc}"
            outcomes[(kind, str(rel), "refused")] += 1
        else:
            assert _same(got, refs[kind]), f"try {i}: {how} of {kind}/{rel} loaded another state"
            outcomes[(kind, str(rel), "same")] += 1
        shutil.rmtree(work)
    seconds = time.perf_counter() - start
    print(f"\n{TRIES} tries over {len(files)} files in {seconds:.1f} s (refused, same):")
    for kind, rel in files:
        print(
            f"  {kind}/{rel}: {outcomes[(kind, str(rel), 'refused')]}, "
            f"{outcomes[(kind, str(rel), 'same')]}"
        )
    assert sum(outcomes.values()) == TRIES
    for kind, rel in files:  # every file the loader reads (the latest step's): damage is seen
        if rel.parts[0] in ("latest.json", "step_00000002") and "part_" not in rel.name:
            assert outcomes[(kind, str(rel), "refused")] > 0, (kind, rel)
