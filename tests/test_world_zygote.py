"""A World's ranks are forked from one zygote that imported torch once (world_zygote.py), are
fresh interpreters when forking is unsafe, and a zygote that dies at start is reported."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from labkit import World
from labkit.launch import world_procs
from labkit.launch.config import LaunchError

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(sys.platform != "linux", reason="ranks are forked on Linux only"),
]
ROOT = Path(__file__).resolve().parent.parent


def _origin():
    import psutil
    import torch.distributed as dist

    me = psutil.Process()
    t = __import__("torch").ones(1)
    dist.all_reduce(t)
    return {"ppid": me.ppid(), "cmdline": " ".join(me.cmdline()), "sum": float(t)}


def _site(tmp_path: Path, source: str) -> dict[str, str]:
    """An environment whose interpreters run ``source`` at startup (a sitecustomize)."""
    (tmp_path / "sitecustomize.py").write_text(source)
    return {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}


def test_ranks_are_forked_from_one_zygote():
    with World(3, timeout=60) as world:
        got = world.run(_origin)
    parents = {r["ppid"] for r in got}
    assert len(parents) == 1 and os.getpid() not in parents, got  # one zygote, not us
    for r in got:
        assert "world_zygote" in r["cmdline"], r  # the zygote's command line: forked
        assert r["sum"] == 3.0, r


def test_where_ranks_are_not_forked_each_is_its_own_interpreter(monkeypatch):
    # the path other platforms take (world_procs.FORK_RANKS), kept working here
    monkeypatch.setattr(world_procs, "FORK_RANKS", False)
    with World(2, timeout=60) as world:
        got = world.run(_origin)
    for r in got:
        assert r["ppid"] == os.getpid(), r
        assert "from labkit.launch.world_rank import rank_main" in r["cmdline"], r
        assert r["sum"] == 2.0, r


def test_a_thread_in_the_zygote_makes_each_rank_a_fresh_interpreter(tmp_path):
    # negative control of the fork: with a second thread alive, forking could copy a held
    # lock, so each rank execs its own interpreter (and still joins the group)
    env = _site(tmp_path, "import threading, time\n"
                          "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n")
    with World(2, timeout=60, env=env) as world:
        got = world.run(_origin)
    for r in got:
        assert "world_zygote" not in r["cmdline"], r
        assert "from labkit.launch.world_rank import rank_main" in r["cmdline"], r
        assert r["sum"] == 2.0, r


def test_a_zygote_that_dies_at_start_is_reported_with_its_stderr(tmp_path):
    env = _site(tmp_path, "import sys\nprint('no torch on this interpreter', file=sys.stderr)\n"
                          "raise SystemExit(3)\n")
    with pytest.raises(LaunchError) as info:
        World(2, timeout=60, env=env)
    message = str(info.value)
    assert "the world's zygote exited with code" in message, message
    assert "before forking it" in message, message
    assert "no torch on this interpreter" in message, message
