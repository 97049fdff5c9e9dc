"""The launcher's contract (labkit/launch.py docstring), one behaviour per test."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

import labkit
from labkit.launch import JobTimeoutError, LaunchConfig, RankFailedError, launch
from tests.conftest import processes_tagged

pytestmark = pytest.mark.timeout(120)


# Worker functions. Module-level here, but the notebook test covers cell-defined ones.
def _rank_info(offset):
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    print(f"rank {dist.get_rank()} says hi", flush=True)
    return {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "sum_of_ranks": t.item() + offset,
        "backend": dist.get_backend(),
        "master_addr": os.environ["MASTER_ADDR"],
        "threads": torch.get_num_threads(),
        "tensor": torch.full((2,), float(dist.get_rank())),
    }


def test_returns_per_rank_values_in_rank_order(job_tag, capfd):
    results = launch(_rank_info, 100, world_size=3, timeout=60, env={"LABKIT_TEST_TAG": job_tag})
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert all(r["world_size"] == 3 and r["sum_of_ranks"] == 103 for r in results)
    assert all(r["backend"] == "gloo" for r in results)  # no GPU on CI
    assert all(r["master_addr"] == "127.0.0.1" for r in results)  # rendezvous stays local
    assert all(torch.equal(r["tensor"], torch.full((2,), float(r["rank"]))) for r in results)
    # ranks share the cores instead of each taking all of them
    assert all(r["threads"] == max(1, (os.cpu_count() or 1) // 3) for r in results)
    out = capfd.readouterr().out
    for rank in range(3):
        assert f"[rank{rank}]: rank {rank} says hi" in out


def _raise_on_rank_1_with_teardown():
    # The trap from the field notes: tearing the group down in `finally` makes the
    # bystanders fail with "Connection closed by peer", possibly before the culprit reports.
    try:
        if dist.get_rank() == 1:
            time.sleep(0.2)
            raise ValueError("bad batch on rank 1")
        t = torch.zeros(1)
        dist.all_reduce(t)
        dist.all_reduce(t)
    finally:
        dist.destroy_process_group()


def test_raising_rank_is_named_with_its_traceback_fast(job_tag, tmp_path):
    start = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        launch(
            _raise_on_rank_1_with_teardown,
            world_size=3,
            timeout=60,
            log_dir=tmp_path,
            env={"LABKIT_TEST_TAG": job_tag},
        )
    caught = time.time()
    err = info.value
    assert err.rank == 1 and err.exc_type == "ValueError"
    assert "bad batch on rank 1" in str(err)
    assert 'raise ValueError("bad batch on rank 1")' in err.rank_traceback
    assert "_raise_on_rank_1_with_teardown" in err.rank_traceback
    # From the raise to the exception in the caller: well under the launch cost itself.
    # the final record, or the pending one written before teardown when the job was killed
    # first (sorted: "error.1.json" before "error.1.pending.json")
    record = json.loads(sorted(tmp_path.glob("*/error.1*.json"))[0].read_text())
    assert caught - record["time"] < 2.0, f"failure took {caught - record['time']:.2f}s to surface"
    assert time.monotonic() - start < 30
    # Every rank's log stays on disk.
    assert err.log_dir is not None and any(err.log_dir.rglob("stdout.log"))


def _killed_on_rank_1():
    if dist.get_rank() == 1:
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)  # no Python record can be written
    dist.all_reduce(torch.zeros(1))
    dist.all_reduce(torch.zeros(1))


def test_rank_killed_by_a_signal_is_blamed_not_its_peers(job_tag):
    with pytest.raises(RankFailedError) as info:
        launch(_killed_on_rank_1, world_size=3, timeout=60, env={"LABKIT_TEST_TAG": job_tag})
    assert info.value.rank == 1 and info.value.exc_type == "ProcessDied"
    assert "SIGKILL" in str(info.value) or "without reporting" in str(info.value)


def _native_abort_on_size_mismatch():
    n = 4 if dist.get_rank() == 0 else 8  # mismatched sizes: gloo aborts the process
    dist.all_reduce(torch.ones(n))


def test_rank_dying_in_native_code_shows_the_native_message_and_its_frame(job_tag):
    with pytest.raises(RankFailedError) as info:
        launch(
            _native_abort_on_size_mismatch,
            world_size=2,
            timeout=60,
            quiet=True,
            env={"LABKIT_TEST_TAG": job_tag},
        )
    err = info.value
    assert err.exc_type == "ProcessDied"
    assert "Received data size doesn't match expected size" in err.rank_traceback  # gloo's words
    assert "Fatal Python error: Aborted" in err.rank_traceback
    assert "in _native_abort_on_size_mismatch" in err.rank_traceback  # the learner's frame
    assert "in _worker" not in err.rank_traceback and "Extension modules" not in str(err)


def _deadlock():
    if dist.get_rank() == 0:
        time.sleep(600)  # rank 0 never joins the collective
    t = torch.zeros(1)
    dist.all_reduce(t)


def test_hang_times_out_with_every_ranks_stack(job_tag):
    start = time.monotonic()
    with pytest.raises(JobTimeoutError) as info:
        # the deadline counts from the launch, so it must leave the ranks time to start
        # (seconds on a loaded 2-core machine) and reach the hang
        launch(_deadlock, world_size=2, timeout=15, env={"LABKIT_TEST_TAG": job_tag})
    assert time.monotonic() - start < 40
    stacks = info.value.stacks
    assert set(stacks) == {0, 1}
    assert "time.sleep(600)" not in stacks[0]  # faulthandler gives file/line/function
    assert "_deadlock" in stacks[0] and "_deadlock" in stacks[1]
    assert "all_reduce" in stacks[1]  # rank 1 is stuck in the collective
    assert "_worker" not in str(info.value)  # launcher machinery trimmed away


def _collective_timeout():
    if dist.get_rank() == 0:
        time.sleep(30)
    dist.all_reduce(torch.zeros(1))


def test_collectives_time_out_too(job_tag):
    # Rank 1's all_reduce must give up on its own, well before the job's wall clock.
    start = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        launch(
            _collective_timeout,
            world_size=2,
            timeout=60,
            collective_timeout=3,
            env={"LABKIT_TEST_TAG": job_tag},
        )
    assert info.value.rank == 1
    assert "timed out" in str(info.value).lower() or "timeout" in str(info.value).lower()
    assert time.monotonic() - start < 20


def _fail_first_attempt():
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if attempt == 0 and dist.get_rank() == 1:
        raise RuntimeError("transient failure")
    return attempt


def test_max_restarts_reruns_the_group(job_tag):
    assert launch(
        _fail_first_attempt,
        world_size=2,
        timeout=60,
        max_restarts=1,
        env={"LABKIT_TEST_TAG": job_tag},
    ) == [1, 1]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 0}, "world_size must be >= 1, got 0"),
        ({"world_size": -2}, "world_size must be >= 1, got -2"),
        ({"world_size": "2"}, "world_size must be an int, got '2'"),
        ({"backend": "mpi"}, "backend must be 'gloo', 'nccl' or None, got 'mpi'"),
        ({"backend": "nccl"}, "needs one GPU per rank: world_size=2 but 0 GPU(s) visible"),
        ({"timeout": 0}, "timeout must be a positive number of seconds, got 0"),
        ({"max_restarts": -1}, "max_restarts must be >= 0, got -1"),
    ],
)
def test_bad_input_fails_before_any_process_starts(kwargs, message, monkeypatch):
    if kwargs.get("backend") == "nccl" and torch.cuda.is_available():
        pytest.skip("this machine has GPUs")

    def no_process(*a, **k):
        raise AssertionError("a process was started")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    with pytest.raises(
        (ValueError, TypeError), match=message.replace("(", r"\(").replace(")", r"\)")
    ):
        launch(_rank_info, 0, **kwargs)


def test_uncallable_fn_is_rejected(monkeypatch):
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("a process was started"))
    with pytest.raises(TypeError, match="needs a callable.*int: 42"):
        launch(42)


_INTERRUPT_SCRIPT = textwrap.dedent(
    """
    import sys, time
    import labkit
    def sleepy():
        print("ready", flush=True)
        time.sleep(600)
    try:
        labkit.launch(sleepy, world_size=2, timeout=300, env={"LABKIT_TEST_TAG": sys.argv[1]})
    except KeyboardInterrupt:
        print("INTERRUPTED", flush=True)
        sys.exit(3)
    """
)


def test_interrupt_kills_every_rank(job_tag, tmp_path):
    script = tmp_path / "interrupt.py"
    script.write_text(_INTERRUPT_SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script), job_tag], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    ready = 0
    deadline = time.monotonic() + 60
    while ready < 2 and time.monotonic() < deadline:
        ready += "ready" in proc.stdout.readline()
    assert ready == 2, "ranks never started"
    assert len(processes_tagged(job_tag)) >= 3  # the agent and both ranks are alive
    start = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 3 and "INTERRUPTED" in out
    assert time.monotonic() - start < 10
    # job_tag's teardown asserts that nothing survived


def _tiny(x):
    return x * 10 + dist.get_rank()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_overlapping_launches_never_collide(job_tag):
    # The failure this guards against, a fixed rendezvous port (plain torchrun's 29500), makes
    # *every* pair of overlapping launches collide: the second fails with EADDRINUSE. So four
    # launches that provably overlap in time catch it as surely as twenty did, at a fifth of
    # the processes (the twenty took ~86 s of the suite on 2 cores).
    spans: dict[int, tuple[float, float]] = {}

    def one(i):
        start = time.monotonic()
        out = launch(
            _tiny, i, world_size=2, timeout=180, quiet=True, env={"LABKIT_TEST_TAG": job_tag}
        )
        spans[i] = (start, time.monotonic())
        return out

    n = 4
    with ThreadPoolExecutor(max_workers=n) as pool:
        results = list(pool.map(one, range(n)))
    assert results == [[i * 10, i * 10 + 1] for i in range(n)]
    latest_start = max(s for s, _ in spans.values())
    earliest_end = min(e for _, e in spans.values())
    assert latest_start < earliest_end, "the launches did not all run at the same time"


def test_default_backend_follows_the_gpus_per_rank(monkeypatch):
    # NCCL exactly when every rank can have its own GPU; gloo otherwise (whatever this box has)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    assert LaunchConfig(world_size=4).backend == "nccl"
    assert LaunchConfig(world_size=5).backend == "gloo"
    assert LaunchConfig(world_size=4, backend="gloo").backend == "gloo"
    with pytest.raises(ValueError, match="world_size=5 but 4 GPU"):
        LaunchConfig(world_size=5, backend="nccl")


def test_launch_is_a_callable_package_that_leaves_caller_signals_and_environment_alone(job_tag):
    # One launch (a world of one) checks both: labkit.launch is the entry point and the package
    # behind it, and a launch restores the caller's signal handlers and os.environ.
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
    before = {s: signal.getsignal(s) for s in signals}
    env_before = dict(os.environ)
    assert labkit.launch(
        _tiny, 5, world_size=1, timeout=60, quiet=True, backend="gloo",
        env={"LABKIT_TEST_TAG": job_tag},
    ) == [50]  # fmt: skip
    assert {s: signal.getsignal(s) for s in signals} == before
    assert dict(os.environ) == env_before
    assert labkit.launch.local_device().type in ("cpu", "cuda")


_TORCHRUN_SCRIPT = textwrap.dedent(
    """
    import torch, torch.distributed as dist
    from labkit.launch import run_from_env

    def work(offset):  # the same kind of function labkit.launch runs
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t)
        rank, world = dist.get_rank(), dist.get_world_size()
        print(f"RESULT rank={rank} world={world} sum={t.item() + offset}", flush=True)

    run_from_env(work, 100)
    """
)


@pytest.mark.timeout(120)
def test_worker_functions_run_unchanged_under_torchrun(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(_TORCHRUN_SCRIPT)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        f"--log-dir={tmp_path / 'agent'}",  # not a torchelastic_* folder left in the system temp
        str(script),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stderr[-2000:]
    for rank in range(2):
        assert f"RESULT rank={rank} world=2 sum=101.0" in out.stdout
    # and as a plain script: a world of one
    single = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=110
    )
    assert "RESULT rank=0 world=1 sum=100.0" in single.stdout, single.stderr[-2000:]


def test_ranks_import_this_labkit_from_any_working_directory() -> None:
    """The job's PYTHONPATH starts with the folder that holds this ``labkit/`` (not ``labkit/``
    itself, where ``import labkit`` would find nothing), so a checkout runs without an install."""
    from pathlib import Path

    from labkit.launch.shipping import _worker_env

    first = _worker_env(LaunchConfig(world_size=2), "run-id")["PYTHONPATH"].split(os.pathsep)[0]
    assert (Path(first) / "labkit" / "__init__.py").resolve() == Path(labkit.__file__).resolve()
