"""Slurm for real (labkit/cluster/slurm.py): slurmctld and one slurmd per emulated node.

``examples/slurm/threed.sbatch`` is submitted unchanged (its GPU request overridden on the
sbatch command line, as a user would on a CPU partition) across 2 nodes, each in its own
network and UTS namespace, and must end with the same checksum as single-process training.
The cluster must leave nothing behind, whether the block ends normally or by an exception.
Skipped, with the reason, where Slurm cannot start (not root, slurm-wlm or munge missing).
"""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from labkit.cluster import netns
from labkit.cluster.netns import NetnsPlan
from labkit.cluster.slurm import (
    NETNS_ETC,
    hosts_file,
    slurm_cluster,
    slurm_conf,
    slurm_unavailable,
)
from tests.conftest import processes_tagged
from tests.test_hygiene import _a_link, _someone_elses

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "slurm" / "threed.sbatch"
LAB_ARGS = "--dp 1 --tp 1 --pp 2 --steps 2"  # 2 nodes x 1 rank: the pipeline crosses the nodes

pytestmark = pytest.mark.timeout(180)


def _slurm_or_skip() -> None:
    why = slurm_unavailable()
    if why:
        pytest.skip(f"Slurm cannot start here: {why}")


def test_config_names_every_node_by_its_address(tmp_path):
    plan = NetnsPlan("abc123", 3, 1e6)
    conf = slurm_conf(plan, tmp_path, cpus=2)
    assert "SlurmctldHost=head(10.77.255.254)" in conf
    assert re.findall(r"NodeName=(\S+) NodeAddr=(\S+)", conf) == [
        ("node0", "10.77.0.1"), ("node1", "10.77.0.2"), ("node2", "10.77.0.3")]  # fmt: skip
    assert f"AuthInfo=socket={tmp_path}/munge.socket" in conf
    assert "10.77.0.3 node2" in hosts_file(plan).splitlines()


def test_missing_packages_are_named_with_the_install(monkeypatch):
    import shutil

    from labkit.cluster import slurm

    monkeypatch.setattr(slurm.spec, "netns_unavailable", lambda: None)
    monkeypatch.setattr(shutil, "which", lambda tool: None if tool == "munged" else "/bin/x")
    assert slurm_unavailable() == "munged not found (apt-get install slurm-wlm munge)"
    monkeypatch.setattr(slurm.spec, "netns_unavailable", lambda: "it needs root (euid=1000)")
    assert "needs root" in str(slurm_unavailable())


def test_stale_etc_entries_go_and_live_ones_stay(tmp_path, monkeypatch):
    from labkit.cluster import slurm

    etc, run = tmp_path / "etc", tmp_path / "run"
    for name in ("lk-aaaaaa-n0", "lk-bbbbbb-sw", "other"):
        (etc / name).mkdir(parents=True)
    run.mkdir()
    (run / "lk-bbbbbb-sw").touch()  # its namespace exists: a live run
    monkeypatch.setattr(slurm, "NETNS_ETC", etc)
    monkeypatch.setattr(slurm, "NETNS_DIR", run)
    assert slurm.sweep_stale_etc() == ["lk-aaaaaa-n0"]
    assert sorted(p.name for p in etc.iterdir()) == ["lk-bbbbbb-sw", "other"]


def test_threed_sbatch_on_two_slurm_nodes_matches_one_process(tmp_path, job_tag):
    _slurm_or_skip()
    from labkit.labs.threed import LabConfig, reference
    from labkit.parallel import ParallelDegrees
    from labkit.parallel.threed import ThreeDConfig

    out = tmp_path / "out"
    out.mkdir()
    with slurm_cluster(2, run_dir=tmp_path / "slurm", env={"LABKIT_TEST_TAG": job_tag}) as s:
        tag = s.plan.tag
        # each node is its own host: name and address (a job step on each)
        hello = out / "hello.sh"
        hello.write_text("#!/bin/bash\nsrun bash -c 'echo $(hostname) $(hostname -i)'\n")
        job = s.sbatch(hello, "--nodes=2", f"--output={out}/hello-%j.out", cwd=out)
        assert s.wait(job, 60) == "COMPLETED", s.logs()
        seen = sorted((out / f"hello-{job}.out").read_text().split("\n"))
        assert [x for x in seen if x] == ["node0 10.77.0.1", "node1 10.77.0.2"]
        job = s.sbatch(
            SCRIPT, "--gpus-per-node=0", "--cpus-per-task=1", f"--output={out}/threed-%j.out",
            cwd=ROOT, env={"GPUS_PER_NODE": "1", "LAB_ARGS": LAB_ARGS, "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
        state = s.wait(job, 150)
        text = (out / f"threed-{job}.out").read_text()
        assert state == "COMPLETED", text[-3000:] + s.logs()
    sums = [float(m) for m in re.findall(r"^checksum (\S+)$", text, re.M)]
    assert len(sums) == 1, text[-3000:]
    cfg = LabConfig(threed=ThreeDConfig(ParallelDegrees(1, 1, 2), 2), steps=2)
    assert sums[0] == pytest.approx(reference(cfg)["checksum"], abs=1e-3)
    # negative control: another number of steps is another checksum
    assert abs(sums[0] - reference(LabConfig(threed=cfg.threed, steps=3))["checksum"]) > 1e-2
    assert netns.leftovers(tag) == []
    assert not any(NETNS_ETC.glob(f"lk-{tag}-*"))
    assert processes_tagged(job_tag) == []


def test_an_exception_tears_down_daemons_and_running_jobs(tmp_path, job_tag):
    _slurm_or_skip()
    tag = ""
    cluster = slurm_cluster(2, run_dir=tmp_path, env={"LABKIT_TEST_TAG": job_tag})
    with pytest.raises(RuntimeError, match="the caller failed"), cluster as s:
        tag = s.plan.tag
        sleeper = tmp_path / "sleep.sh"
        sleeper.write_text("#!/bin/bash\nsrun sleep 300\n")
        job = s.sbatch(sleeper, "--nodes=2", f"--output={tmp_path}/sleep-%j.out", cwd=tmp_path)
        for _ in range(100):  # until the job's step runs on both nodes
            sleeps = sum(p.name() == "sleep" for p in processes_tagged(job_tag))
            if s.state(job) == "RUNNING" and sleeps == 2:
                break
            time.sleep(0.1)
        names = [p.name() for p in processes_tagged(job_tag)]  # negative control: all seen
        assert {"slurmctld", "munged"} <= set(names)
        assert names.count("slurmd") == 2 and names.count("sleep") == 2, names
        raise RuntimeError("the caller failed")
    assert netns.leftovers(tag) == []
    assert not any(NETNS_ETC.glob(f"lk-{tag}-*"))
    assert processes_tagged(job_tag) == []  # daemons, slurmstepd and the job's sleeps


def test_stale_run_folders_go_at_the_next_start(tmp_path):
    from labkit.cluster.slurm_reaper import RUN_PREFIX, process_id, sweep_stale_runs

    dead, live, starting = (tmp_path / f"{RUN_PREFIX}{n}" for n in ("dead", "live", "new"))
    for run in (dead, live, starting):
        run.mkdir()
    (dead / "creator").write_text(f"{2**22 + 1} 1")  # above pid_max's default: no such process
    (live / "creator").write_text(process_id(os.getpid()))
    assert sweep_stale_runs(tmp_path) == [dead.name]
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name, starting.name]


HOLD = """
import sys, time
from labkit.cluster.slurm import slurm_cluster
with slurm_cluster(2, env={"LABKIT_TEST_TAG": sys.argv[1]}) as s:
    print(s.plan.tag, s.run_dir, flush=True)
    time.sleep(120)
"""


def test_a_sigkilled_caller_leaves_nothing(job_tag):
    _slurm_or_skip()
    env = {**os.environ, "LABKIT_TEST_TAG": job_tag, "PYTHONPATH": str(ROOT)}
    caller = subprocess.Popen([sys.executable, "-c", HOLD, job_tag], env=env, cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert caller.stdout is not None
        ready, _, _ = select.select([caller.stdout], [], [], 60)
        assert ready, "the cluster did not come up within 60 s"
        tag, run = caller.stdout.readline().split()
        names = [p.name() for p in processes_tagged(job_tag)]  # negative control: all there
        assert {"slurmctld", "munged"} <= set(names) and names.count("slurmd") == 2, names
        assert netns.leftovers(tag) and any(NETNS_ETC.glob(f"lk-{tag}-*")) and Path(run).is_dir()
    finally:
        caller.kill()  # SIGKILL: no finally, no atexit runs in the caller
        caller.wait()

    def left() -> list[object]:
        return [*netns.leftovers(tag), *NETNS_ETC.glob(f"lk-{tag}-*"),
                *([run] if Path(run).exists() else []),
                *(p.name() for p in processes_tagged(job_tag))]  # fmt: skip

    deadline = time.monotonic() + 10  # at once (about 1 s): the watchdog and the reaper act on EOF
    while left() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert left() == []


# ---- bad arguments, other users' folders, failed starts (issue 34, defects 3 and 5) ---------


def _no_process(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a process was started")

    monkeypatch.setattr(subprocess, "Popen", refuse)


@pytest.mark.parametrize("nodes", [0, -1, 2.0, True])
def test_bad_nodes_are_refused_before_anything_starts(nodes, monkeypatch):
    _no_process(monkeypatch)  # (before: slurm_cluster(0) started the reaper and slurmctld)
    cluster = slurm_cluster(nodes)
    with pytest.raises(ValueError, match=rf"nodes must be an int .* got nodes={nodes!r}"), cluster:
        pass


def _others_can_write(run: Path) -> str:
    run.mkdir(mode=0o700)
    run.chmod(0o777)
    return r"others can write it \(mode 0777\)"


def _parent_others_can_write(run: Path) -> str:
    run.parent.chmod(0o777)
    return rf"others can write the folder above it, {run.parent} \(mode 0777\)"


@pytest.mark.parametrize("make", [_others_can_write, _parent_others_can_write, _someone_elses,
                                  _a_link])  # fmt: skip
def test_a_run_dir_another_user_controls_is_refused_before_anything_starts(
    make, tmp_path, monkeypatch
):
    run = tmp_path / "box" / "run"
    run.parent.mkdir(mode=0o700)
    problem = make(run)
    _no_process(monkeypatch)
    cluster = slurm_cluster(1, run_dir=run)
    message = rf"refuses the Slurm run folder .*: {problem}"
    with pytest.raises(PermissionError, match=message), cluster:
        pass
    assert not any(p.name == "slurm.conf" for p in tmp_path.rglob("*"))  # nothing written


def test_a_run_dir_with_files_in_it_is_refused(tmp_path, monkeypatch):
    (tmp_path / "hosts").symlink_to(tmp_path / "victim")  # what a planted link looks like
    _no_process(monkeypatch)
    cluster = slurm_cluster(1, run_dir=tmp_path)
    with pytest.raises(ValueError, match=r"is not empty \(it holds hosts\)"), cluster:
        pass
    assert not (tmp_path / "victim").exists()


def _fake_network(monkeypatch, tmp_path: Path, on_create) -> None:
    """Everything up to the first daemon, without root: no namespaces, /etc/netns in tmp."""
    from labkit.cluster import slurm

    monkeypatch.setattr(slurm, "slurm_unavailable", lambda: None)
    monkeypatch.setattr(slurm, "NETNS_ETC", tmp_path / "etc-netns")
    monkeypatch.setattr(netns, "sweep_stale", lambda: [])
    monkeypatch.setattr(netns, "create", on_create)
    monkeypatch.setattr(netns, "remove", lambda plan: None)
    monkeypatch.setattr(slurm.subprocess, "run", lambda *a, **k: None)

    def no_daemons(*args, **kwargs):
        raise RuntimeError("stopped before the first daemon")

    monkeypatch.setattr(slurm, "Lifeline", no_daemons)


def test_a_link_planted_in_the_run_dir_is_never_followed(tmp_path, monkeypatch, job_tag):
    """Should another user get into the run folder after the check (they cannot: it is
    checked private), every file is still created new and no link is followed: the victim
    stays as it was. Before: ``write_text`` followed the link and overwrote it as root."""
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    run = tmp_path / "run"

    def plant(plan) -> None:
        for name in ("hosts", "slurm.conf", "munge.key"):
            (run / name).symlink_to(victim)

    _fake_network(monkeypatch, tmp_path, plant)
    cluster = slurm_cluster(1, run_dir=run, env={"LABKIT_TEST_TAG": job_tag})
    with pytest.raises(FileExistsError, match=r"creates .*/run/hosts only as a new file"), cluster:
        pass
    assert victim.read_text() == "precious\n"
    _reapers_gone(job_tag)


def _reapers_gone(job_tag: str) -> None:
    deadline = time.monotonic() + 10
    while processes_tagged(job_tag) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [" ".join(p.cmdline()) for p in processes_tagged(job_tag)] == []


@pytest.mark.parametrize("where", ["own_folder", "plan"])
def test_failed_starts_leave_no_reaper_alive(where, tmp_path, monkeypatch, job_tag):
    """A start that fails right after the reaper started (the first steps inside the cleanup's
    reach) ends the reaper too: 3 failed calls, no reaper left (before: 3 reapers alive)."""
    from labkit.cluster import slurm
    from labkit.cluster.slurm_reaper import Reaper

    def fail(*args, **kwargs):
        raise OSError(f"injected failure in {where}")

    _fake_network(monkeypatch, tmp_path, lambda plan: None)
    if where == "own_folder":
        monkeypatch.setattr(Reaper, "own_folder", fail)
    else:
        monkeypatch.setattr(slurm.NetnsPlan, "new", fail)
    started = []
    real_init = Reaper.__init__

    def counted(self, env=None):
        real_init(self, env)
        started.append(self.proc.pid)

    monkeypatch.setattr(Reaper, "__init__", counted)
    for _ in range(3):
        cluster = slurm_cluster(1, env={"LABKIT_TEST_TAG": job_tag})
        with pytest.raises(OSError, match=f"injected failure in {where}"), cluster:
            pass
    assert len(started) == 3  # negative control: each call did start a reaper
    _reapers_gone(job_tag)
