"""The ranks' forkserver is forked from the agent after its one import of torch (zygote.py),
and what it inherited from the agent does not leak into the ranks."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from labkit.launch import launch

pytestmark = pytest.mark.timeout(120)


def _forkserver_origin_and_own_child():
    import multiprocessing
    import os
    import time

    import psutil

    server = psutil.Process(os.getppid())  # a launched rank's parent is the forkserver
    agent = server.parent()
    # The rank's own forkserver context: needs the lock the agent held at fork time released
    # and the patched spawn restored, or this start hangs or forks the rank itself.
    child = multiprocessing.get_context("forkserver").Process(target=time.sleep, args=(0.01,))
    child.start()
    child.join(60)
    return {
        "server_cmdline": " ".join(server.cmdline()),
        "same_cmdline_as_agent": server.cmdline() == agent.cmdline(),
        "torch_in_server": "torch" in sys.modules,  # inherited from the server, unimported
        "child_exitcode": child.exitcode,
    }


def test_launched_ranks_fork_from_a_fork_of_the_agent_and_can_start_their_own_forkserver():
    for info in launch(_forkserver_origin_and_own_child, world_size=2, timeout=90, quiet=True):
        assert info["same_cmdline_as_agent"], info  # forked, not a second interpreter
        assert "start_forkserver_here" in info["server_cmdline"], info
        assert "multiprocessing.forkserver import main" not in info["server_cmdline"], info
        assert info["torch_in_server"], info
        assert info["child_exitcode"] == 0, info


_PROBE = textwrap.dedent(
    """
    import sys, threading, time
    from multiprocessing import forkserver
    import psutil
    if sys.argv[1] == "thread":
        threading.Thread(target=time.sleep, args=(5,), daemon=True).start()
    from labkit.launch.zygote import start_forkserver_here
    start_forkserver_here(["json"])
    pid = forkserver._forkserver._forkserver_pid
    # An ordinary start forks, then execs a new interpreter: until the exec its command line
    # is ours (or briefly empty), so wait for it; a forked server keeps ours for good.
    start = time.monotonic()
    while True:
        cmd = " ".join(psutil.Process(pid).cmdline())
        waited = time.monotonic() - start
        if "multiprocessing.forkserver" in cmd or waited > 30:
            break
        if sys.argv[1] == "single" and waited > 2 and cmd:
            break
        time.sleep(0.05)
    print(cmd)
    """
)


@pytest.mark.parametrize("state", ["single", "thread"])
def test_a_multithreaded_caller_gets_the_ordinary_forkserver(state):
    # The negative control: with a second thread alive, forking would copy it, so the
    # ordinary interpreter start must be used.
    out = subprocess.run([sys.executable, "-c", _PROBE, state], capture_output=True, text=True,
                         timeout=60, check=True).stdout  # fmt: skip
    ordinary = "multiprocessing.forkserver import main" in out
    assert ordinary == (state == "thread"), out
    assert ("start_forkserver_here" in out) == (state == "single"), out  # this probe, forked
