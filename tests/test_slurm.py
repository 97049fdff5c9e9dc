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
