"""Process hygiene and the runs folder (labkit/launch/lifeline.py and runs.py).

No process outlives its launcher (SIGKILL included), its job or its world, however they end,
and that includes what a rank starts; a job's pickles live only where their user alone can
write. The process-life tests start fresh processes: they test process life itself, which
run_ranks' warm worlds cannot. Each is bounded.
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from labkit.cluster import netns
from labkit.launch import JobTimeoutError, RankFailedError, World, launch
from labkit.launch.runs import check_run_dir
from tests.conftest import processes_tagged

pytestmark = pytest.mark.timeout(120)

_LAUNCHER = textwrap.dedent(
    """
    import subprocess, sys, time
    import labkit
    def sleepy():
        subprocess.Popen(["sleep", "300"])  # a rank's child: it must die too
        subprocess.Popen(["sleep", "300"], start_new_session=True)  # one that left the group
        print("ready", flush=True)
        time.sleep(600)
    env = {"LABKIT_TEST_TAG": sys.argv[1]}
    if sys.argv[2] == "launch":
        labkit.launch(sleepy, world_size=2, timeout=300, env=env)
    else:
        labkit.World(2, backend="gloo", env=env).run(sleepy)
    """
)


def _gone_within(tag: str, seconds: float) -> list[str]:
    deadline = time.monotonic() + seconds
    while processes_tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [f"{p.pid} {' '.join(p.cmdline())[:70]}" for p in processes_tagged(tag)]


@pytest.mark.parametrize("kind", ["launch", "World"])
def test_a_sigkilled_launcher_takes_its_whole_job_along(kind, job_tag):
    """Agent, forkserver, resource tracker, ranks and the ranks' children: all gone in 5 s."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _LAUNCHER, job_tag, kind], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        ready, deadline = 0, time.monotonic() + 60
        while ready < 2 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            ready += "ready" in line
        assert ready == 2, "ranks never started"
        running = processes_tagged(job_tag)
        assert sum(p.name() == "sleep" for p in running) == 4  # negative control: all seen
        assert len(running) >= (7 if kind == "launch" else 4)
        proc.kill()
        proc.wait()
        left = _gone_within(job_tag, 5.0)
        assert not left, f"alive 5 s after the {kind} caller's SIGKILL: {left}"
    finally:
        proc.kill()
        proc.wait()


def _start_children() -> None:
    subprocess.Popen(["sleep", "60"])  # inherits the rank's output pipes
    subprocess.Popen(["sleep", "60"], start_new_session=True)  # leaves the job's group
    subprocess.Popen(["sh", "-c", "sleep 60 &"])  # a daemon: its parent exits, it is orphaned


def _sleeps(tag: str, expected: int) -> int:
    deadline = time.monotonic() + 10  # the daemon's shell may not have forked yet
    while (n := sum(p.name() == "sleep" for p in processes_tagged(tag))) < expected:
        if time.monotonic() > deadline:
            break
        time.sleep(0.02)
    return n


def test_close_ends_what_the_ranks_started_and_returns_at_once(job_tag):
    w = World(2, backend="gloo", timeout=60, quiet=True, env={"LABKIT_TEST_TAG": job_tag})
    run = w._holder[0].run  # type: ignore[union-attr]
    assert stat.S_IMODE(run.stat().st_mode) == 0o700  # the world's files are private too
    w.run(_start_children)
    assert _sleeps(job_tag, 6) == 6  # negative control: every one is seen
    start = time.monotonic()
    w.close()
    took = time.monotonic() - start
    left = [f"{p.pid} {p.name()}" for p in processes_tagged(job_tag)]
    assert not left and took < 2.0, f"close() took {took:.1f} s; alive after it: {left}"


def _children_then(how: str) -> int:
    _start_children()
    if how == "raise" and dist.get_rank() == 1:
        raise ValueError("rank 1 fails on purpose")
    if how == "hang":
        time.sleep(600)
    return dist.get_rank()


def test_launch_leaves_nothing_a_rank_started_on_any_way_out(job_tag):
    env = {"LABKIT_TEST_TAG": job_tag}
    assert launch(_children_then, "return", world_size=2, timeout=60, quiet=True, env=env) == [
        0,
        1,
    ]
    assert not processes_tagged(job_tag), "after success"
    with pytest.raises(RankFailedError, match="rank 1 raised ValueError"):
        launch(_children_then, "raise", world_size=2, timeout=60, quiet=True, env=env)
    assert not processes_tagged(job_tag), "after a failure"
    with pytest.raises(JobTimeoutError) as timed_out:
        launch(_children_then, "hang", world_size=2, timeout=8, quiet=True, env=env)
    assert all("in _children_then" in s for s in timed_out.value.stacks.values())  # it ran
    assert not processes_tagged(job_tag), "after a timeout"


# ---- the runs folder: private to its user, checked on every use ----------------------------


@pytest.fixture
def runs_root(tmp_path, monkeypatch) -> Path:
    """Where this user's runs go when the temporary folder is ``tmp_path``."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path / f"labkit-runs-{os.geteuid()}"


def _tiny() -> int:
    return 1


def _no_process(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a process was started")

    monkeypatch.setattr(subprocess, "Popen", refuse)


def _world_writable(root: Path) -> str:
    root.mkdir()
    root.chmod(0o777)
    return r"others can write it \(mode 0777\)\. .*Fix: chmod 700 "


def _a_link(root: Path) -> str:
    (root.parent / "elsewhere").mkdir(mode=0o700)
    root.symlink_to(root.parent / "elsewhere")
    return r"it is a symbolic link\. .*Fix: remove the link"


def _someone_elses(root: Path) -> str:
    if os.geteuid() != 0:
        pytest.skip("making a folder someone else's needs root")
    root.mkdir(mode=0o700)
    os.chown(root, 12345, -1)
    return rf"it is owned by uid 12345, not by you \(uid {os.geteuid()}\)\. .*Fix: remove it"


@pytest.mark.parametrize("make", [_world_writable, _a_link, _someone_elses])
def test_a_runs_root_others_could_write_is_refused_before_any_process_starts(
    make, runs_root, monkeypatch
):
    problem = make(runs_root)
    _no_process(monkeypatch)
    message = re.escape(f"refuses the runs folder {runs_root}: ") + problem
    with pytest.raises(PermissionError, match=message):
        launch(_tiny, world_size=1)
    with pytest.raises(PermissionError, match=message):
        World(1, backend="gloo")


def test_runs_root_and_each_run_are_private(runs_root, tmp_path, monkeypatch):
    def stop_here(*args, **kwargs):
        raise RuntimeError("stopped before the first process")

    monkeypatch.setattr(subprocess, "Popen", stop_here)
    with pytest.raises(RuntimeError, match="stopped before"):
        launch(_tiny, world_size=1)
    [run] = runs_root.iterdir()
    assert (run / "job.pkl").is_file()  # the job was written, into private folders only
    assert [stat.S_IMODE(p.stat().st_mode) for p in (runs_root, run)] == [0o700, 0o700]
    # a log_dir of the user's own may be readable by others, never writable
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with pytest.raises(PermissionError, match=r"shared: others can write it \(mode 0777\)"):
        launch(_tiny, world_size=1, log_dir=shared)
    # the reader's side (the agent, a rank) refuses a run folder others can get into
    run.chmod(0o755)
    with pytest.raises(PermissionError, match=r"others can read it \(mode 0755\)"):
        check_run_dir(run)


def test_netns_records_are_whole_and_the_sweep_reads_only_its_users_complete_ones(
    tmp_path, monkeypatch
):
    records = tmp_path / "records"
    monkeypatch.setattr(netns, "RECORDS", records)
    monkeypatch.setattr(netns, "leftovers", lambda tag=None: [])  # no `ip` here
    removed: list[str] = []
    monkeypatch.setattr(netns, "remove", lambda plan: removed.append(str(plan)))
    netns.write_record("aaaaaa")  # this (live) process's run
    assert [p.name for p in records.iterdir()] == ["aaaaaa"]  # no temporary file left over
    assert stat.S_IMODE(records.stat().st_mode) == 0o700
    whole = (records / "aaaaaa").read_text()
    mine = json.loads(whole)
    (records / "bbbbbb").write_text(whole[: len(whole) // 2])  # a record caught half-written
    dead = f"{os.getpid()} 1"  # this pid with another start time: its creator is gone
    (records / "cccccc").write_text(json.dumps({**mine, "creator": dead}))
    (records / "dddddd").write_text(json.dumps({**mine, "creator": dead, "uid": mine["uid"] + 1}))
    (records / ".eeeeee.99.tmp").write_text(json.dumps({**mine, "creator": dead}))
    assert netns.sweep_stale() == ["cccccc"]  # negative control: a stale record is acted on
    assert removed == ["cccccc"]
    records.chmod(0o777)
    with pytest.raises(PermissionError, match=r"records: others can write it"):
        netns.sweep_stale()


def _temp_folder() -> str:
    return tempfile.gettempdir()


def test_a_jobs_temp_files_live_in_its_private_run_folder() -> None:
    """multiprocessing's ``pymp-*`` and the elastic agent's ``torchelastic_*`` folders are
    removed only at a clean exit: a killed job would leave them in the shared temp folder.
    Its processes' TMPDIR is the run folder's ``tmp`` (private, pruned with the run)."""
    from labkit.launch.config import LaunchConfig
    from labkit.launch.runs import default_root
    from labkit.launch.shipping import _worker_env
    from tests.ranks import run_ranks

    for folder in run_ranks(_temp_folder, world_size=2):  # a World's ranks
        path = Path(folder)
        assert path.name == "tmp" and path.parent.parent == default_root(), folder
        assert (path.stat().st_mode & 0o077) == 0, oct(path.stat().st_mode)
    cfg = LaunchConfig(world_size=2)
    deep = Path("/tmp") / ("x" * 80)  # a Unix socket path under it would pass 107 bytes
    assert _worker_env(cfg, "id", deep).get("TMPDIR") == os.environ.get("TMPDIR")
    mine = LaunchConfig(world_size=2, env={"TMPDIR": "/somewhere"})
    assert _worker_env(mine, "id", default_root())["TMPDIR"] == "/somewhere"  # the user's wins


# ---- a live run is never pruned; a new log folder gets its mode (issue 34, defects 4 and 6) --


def _age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def _prune_under_me(root: str) -> bool:
    """In a rank: make this live run look like an old one (2 hours, 30 newer runs beside it),
    prune as the next launch() would, and say whether the run folder survived."""
    from labkit.launch.runs import prune_old_runs

    [run] = [p for p in Path(root).iterdir() if not p.name.startswith("newer-")]
    for i in range(30):
        os.mkdir(Path(root) / f"newer-{i:02d}")
    _age(run, 7200)
    prune_old_runs(Path(root))
    return run.is_dir()


def test_a_live_run_is_never_pruned_and_a_finished_one_is(tmp_path):
    """Before: prune_old_runs judged by mtime alone, deleted the live run's folder, and the
    job, whose rank had finished, failed at its end (no result file)."""
    from labkit.launch.runs import prune_old_runs

    root = tmp_path / "runs"
    assert launch(_prune_under_me, str(root), world_size=1, log_dir=root, quiet=True) == [True]
    [run] = [p for p in root.iterdir() if not p.name.startswith("newer-")]
    _age(run, 7200)  # the job is over: the same folder, just as old, goes now
    assert prune_old_runs(root) == [run.name]
    assert len(list(root.iterdir())) == 30  # the newest 30 stay


def test_a_live_worlds_run_is_never_pruned(runs_root):
    from labkit.launch.runs import prune_old_runs

    world = World(1, backend="gloo")
    try:
        assert world.run(_tiny) == [1]
        [run] = runs_root.iterdir()
        for i in range(30):
            os.mkdir(runs_root / f"newer-{i:02d}")
        _age(run, 7200)
        prune_old_runs(runs_root)
        assert run.is_dir()
        assert world.run(_tiny) == [1]  # the world goes on
    finally:
        world.close()
    _age(run, 7200)
    prune_old_runs(runs_root)
    assert not run.exists()  # negative control: closed, it goes


def test_a_new_log_dir_gets_its_mode_whatever_the_umask(tmp_path, monkeypatch):
    """Under umask 002 a plain mkdir made the log folder 0775, which the check then refused."""

    def stop_here(*args, **kwargs):
        raise RuntimeError("stopped before the first process")

    monkeypatch.setattr(subprocess, "Popen", stop_here)
    logs = tmp_path / "new" / "logs"
    old = os.umask(0o002)
    try:
        with pytest.raises(RuntimeError, match="stopped before"):
            launch(_tiny, world_size=1, log_dir=logs)
    finally:
        os.umask(old)
    [run] = [p for p in logs.iterdir() if p.is_dir()]
    modes = [stat.S_IMODE(p.stat().st_mode) for p in (logs.parent, logs, run, run / "job.pkl")]
    assert modes == [0o755, 0o755, 0o700, 0o600]
