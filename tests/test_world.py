"""labkit.World's contract: ranks that live across calls with launch's guarantees, and
run_ranks' isolation between the tests that share its warm worlds."""

from __future__ import annotations

import _thread
import contextlib
import os
import signal
import threading
import time
import uuid

import psutil
import pytest
import torch
import torch.distributed as dist

import labkit
from labkit.launch import JobTimeoutError, RankFailedError, World, WorldClosedError
from tests.conftest import kill_survivors
from tests.ranks import run_ranks

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def world_tag():
    tag = uuid.uuid4().hex
    yield tag
    kill_survivors(tag, "their world")


@pytest.fixture(scope="module")
def world(world_tag):
    """One world for the tests that leave it usable (or that check it restarts)."""
    w = World(2, backend="gloo", timeout=60, env={"LABKIT_TEST_TAG": world_tag})
    yield w
    w.close()


def _sum_of_ranks(offset):
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    print(f"rank {dist.get_rank()} of {dist.get_world_size()}", flush=True)
    return t.item() + offset


def test_state_set_in_one_call_is_visible_in_the_next_and_output_streams(world, capfd):
    assert world.run(_sum_of_ranks, 10) == [11.0, 11.0]
    world.exec("t = torch.full((3,), float(rank))\ndist.all_reduce(t)")
    values = world.exec("print('t is', t.tolist())\nt * (rank + 1)")
    assert [v.tolist() for v in values] == [[1.0] * 3, [2.0] * 3]  # rank 1 still holds its t
    out = capfd.readouterr().out
    assert "[rank0]: rank 0 of 2" in out and "[rank1]: rank 1 of 2" in out
    assert "[rank1]: t is [1.0, 1.0, 1.0]" in out


def _raise_on_rank_1():
    if dist.get_rank() == 1:
        raise ValueError("bad batch on rank 1")
    return "fine"


def test_a_raising_rank_gives_its_traceback_and_the_world_stays_usable(world):
    world.exec("kept = 41 + rank")
    restarts = world.restarts
    with pytest.raises(RankFailedError) as info:
        world.run(_raise_on_rank_1)
    assert info.value.rank == 1 and info.value.exc_type == "ValueError"
    assert 'raise ValueError("bad batch on rank 1")' in info.value.rank_traceback
    assert "world_rank" not in info.value.rank_traceback  # labkit's frames are trimmed
    assert world.exec("kept") == [41, 42] and world.restarts == restarts  # same processes


def _raise_mid_collective():
    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 gives up")
    dist.all_reduce(torch.ones(1))  # rank 0 waits here for a peer that never comes


def test_a_raise_mid_collective_blames_the_raiser_and_the_next_call_restarts(world, capfd):
    restarts = world.restarts
    with pytest.raises(RankFailedError) as info:
        world.run(_raise_mid_collective)
    assert info.value.rank == 1 and "rank 1 gives up" in str(info.value)
    assert world.run(_sum_of_ranks, 0, quiet=True) == [1.0, 1.0]
    assert world.restarts == restarts + 1
    assert "labkit.World: restarting 2 ranks" in capfd.readouterr().err


def _deadlock():
    if dist.get_rank() == 0:
        time.sleep(600)
    dist.all_reduce(torch.zeros(1))


def test_a_hang_ends_at_the_deadline_with_every_ranks_stack(world):
    start = time.monotonic()
    with pytest.raises(JobTimeoutError) as info:
        world.run(_deadlock, timeout=3)
    assert time.monotonic() - start < 20
    stacks = info.value.stacks
    assert set(stacks) == {0, 1}
    assert "_deadlock" in stacks[0] and "_deadlock" in stacks[1]
    assert "all_reduce" in stacks[1] and "_serve" not in str(info.value)
    assert world.run(_sum_of_ranks, 0, quiet=True) == [1.0, 1.0]


def test_a_sigkilled_rank_is_detected_and_replaced(world, capfd):
    restarts, old = world.restarts, world.pids
    os.kill(old[1], signal.SIGKILL)
    with contextlib.suppress(psutil.NoSuchProcess):  # dead (the ranks are the zygote's
        psutil.Process(old[1]).wait(timeout=10)  # children, not ours); the world must find out
    assert world.run(_sum_of_ranks, 0, quiet=True) == [1.0, 1.0]
    assert world.restarts == restarts + 1 and not set(world.pids) & set(old)
    assert "rank 1 died between calls (killed by SIGKILL)" in capfd.readouterr().err


def _die_in_native_code():
    if dist.get_rank() == 0:
        print("about to send 4 floats", flush=True)
    n = 4 if dist.get_rank() == 0 else 8  # a size mismatch: gloo aborts the process
    dist.all_reduce(torch.ones(n))


def test_a_rank_dying_in_native_code_says_why(world):
    with pytest.raises(RankFailedError) as info:
        world.run(_die_in_native_code, quiet=True)
    err = info.value
    assert err.exc_type == "ProcessDied" and "SIGABRT" in str(err)
    assert "Received data size doesn't match expected size" in err.rank_traceback
    assert "in _die_in_native_code" in err.rank_traceback  # faulthandler's frame of the user
    assert "rank_main" not in err.rank_traceback  # the serving loop's frames are trimmed
    assert world.run(_sum_of_ranks, 0, quiet=True) == [1.0, 1.0]


def _sleepy():
    print("ready", flush=True)
    time.sleep(600)


def _sleep_or_collective():
    if dist.get_rank() == 0:
        time.sleep(600)
    dist.all_reduce(torch.ones(1))  # rank 1 blocks in C++: SIGINT cannot stop it


def _interrupt_after(seconds: float) -> threading.Timer:
    timer = threading.Timer(seconds, _thread.interrupt_main)
    timer.start()
    return timer


def test_interrupt_stops_the_ranks_and_keeps_or_restarts_the_world(world, capfd):
    world.exec("kept = 7")
    restarts = world.restarts
    _interrupt_after(2.0)
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        world.run(_sleepy, quiet=True)
    assert time.monotonic() - start < 10
    assert world.exec("kept") == [7, 7] and world.restarts == restarts  # still the same world
    assert "the world is still usable" in capfd.readouterr().err
    # A rank blocked inside a collective cannot take the interrupt: the world is replaced.
    _interrupt_after(2.0)
    with pytest.raises(KeyboardInterrupt):
        world.run(_sleep_or_collective, quiet=True)
    assert "did not stop on the interrupt" in capfd.readouterr().err
    assert world.run(_sum_of_ranks, 0, quiet=True) == [1.0, 1.0] and world.restarts == restarts + 1


def _fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.timeout(240)
def test_two_hundred_calls_leak_no_threads_fds_or_memory(world):
    def footprint():
        me = psutil.Process()
        ranks = [psutil.Process(pid) for pid in world.pids]
        return {
            "threads": threading.active_count(),
            "fds": _fd_count(os.getpid()),
            "rank fds": [_fd_count(p.pid) for p in ranks],
            "rss MB": [p.memory_info().rss / 2**20 for p in [me, *ranks]],
        }

    for i in range(20):  # warm-up: allocators and caches settle
        world.run(_sum_of_ranks, i, quiet=True)
    before = footprint()
    for i in range(200):
        assert world.run(_sum_of_ranks, i, quiet=True) == [i + 1.0, i + 1.0]
    after = footprint()
    assert after["threads"] == before["threads"] and after["fds"] == before["fds"], (before, after)
    assert after["rank fds"] == before["rank fds"], (before, after)
    grew = [a - b for a, b in zip(after["rss MB"], before["rss MB"])]
    assert max(grew) < 20, f"resident memory grew by {grew} MB over 200 calls"


def test_bad_input_gives_a_clear_error_and_leaves_the_world_alone(world):
    lock = threading.Lock()
    restarts = world.restarts
    with pytest.raises(TypeError, match="pickling failed"):
        world.run(lambda: lock.locked())  # a lock cannot travel
    with pytest.raises(TypeError, match="needs a callable"):
        world.run(42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds, got 0"):
        world.run(_sum_of_ranks, 0, timeout=0)
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        labkit.World(0)
    assert world.run(_sum_of_ranks, 1, quiet=True) == [2.0, 2.0] and world.restarts == restarts


def test_a_closed_world_leaves_no_process_and_says_it_is_closed(world_tag):
    w = World(1, backend="gloo", timeout=60, quiet=True, env={"LABKIT_TEST_TAG": world_tag})
    pids = w.pids
    w.close()
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    with pytest.raises(WorldClosedError, match=r"was closed.*labkit.World\(1\)"):
        w.run(_sum_of_ranks, 1)


def test_a_dropped_world_leaves_no_process(world_tag):
    w = World(1, backend="gloo", timeout=60, quiet=True, env={"LABKIT_TEST_TAG": world_tag})
    pids = w.pids
    del w  # garbage collection ends the ranks (as does interpreter exit)
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(psutil.pid_exists(p) for p in pids)


# ---- run_ranks: warm worlds shared by the suite, isolated call by call ---------------------

_SEEN: list[int] = []


def _isolation_probe(tag: str):
    import torch.distributed.distributed_c10d as c10d

    probe = {
        "globals seen": len(_SEEN),  # a previous call's appends must not be visible
        "groups at start": len(c10d._world.pg_map),
        "env": os.environ.get("LABKIT_LEAK"),
        "cwd": os.getcwd(),
        "random": torch.rand(2),
        "grad": torch.is_grad_enabled(),
    }
    _SEEN.append(1)
    dist.new_group([0, 1])  # a subgroup the next call must not find
    os.environ["LABKIT_LEAK"] = tag
    os.chdir("/")
    torch.manual_seed(123)
    torch.set_grad_enabled(False)
    return probe


def test_run_ranks_calls_do_not_see_each_others_state():
    first = run_ranks(_isolation_probe, "a", world_size=2, timeout=60)
    second = run_ranks(_isolation_probe, "b", world_size=2, timeout=60)
    for a, b in zip(first, second):
        assert b["globals seen"] == 0 and b["groups at start"] == 1
        assert b["env"] is None and b["cwd"] == a["cwd"] and b["grad"]
        assert torch.equal(a["random"], b["random"])  # the same fresh-process seed


def _stuck_on_rank_0():
    if dist.get_rank() == 0:
        time.sleep(600)
    dist.barrier()


def test_run_ranks_honours_timeout_and_a_broken_world_is_replaced():
    # (a raise mid-collective and a dead rank break the world the same way: see above)
    start = time.monotonic()
    with pytest.raises(JobTimeoutError):
        run_ranks(_stuck_on_rank_0, world_size=2, timeout=3)
    assert time.monotonic() - start < 20
    assert run_ranks(_sum_of_ranks, 2, world_size=2, timeout=60) == [3.0, 3.0]
