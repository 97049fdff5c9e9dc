"""The launcher inside a real Jupyter kernel: cell-defined code, live output, the stop button."""

from __future__ import annotations

import time
import uuid
from queue import Empty

import pytest
from jupyter_client.manager import start_new_kernel

from tests.conftest import processes_tagged

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def kernel():
    km, kc = start_new_kernel(kernel_name="python3")
    yield km, kc
    kc.stop_channels()
    km.shutdown_kernel(now=True)


def run_cell(kc, code: str, timeout: float = 120.0, on_output=None):
    """Execute ``code``; return (reply content, [(arrival time, stream text)])."""
    msg_id = kc.execute(code)
    streams = []
    deadline = time.monotonic() + timeout
    while True:
        try:
            msg = kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
        except Empty:
            raise AssertionError(f"cell did not finish in {timeout}s") from None
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            streams.append((time.monotonic(), msg["content"]["text"]))
            if on_output:
                on_output(msg["content"]["text"])
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    while True:
        reply = kc.get_shell_msg(timeout=10)
        if reply["parent_header"].get("msg_id") == msg_id:
            return reply["content"], streams


def test_cell_defined_function_class_and_helper_run_on_ranks_with_live_output(kernel):
    _, kc = kernel
    code = """
import time, torch, torch.distributed as dist
import labkit
from torch import nn

class Scale(nn.Module):            # a class defined in a cell
    def __init__(self, k):
        super().__init__(); self.k = nn.Parameter(torch.tensor(float(k)))
    def forward(self, x):
        return self.k * x

def helper(x):                      # a helper defined in a cell
    return x + 1

def work(n):
    print("started", flush=True)
    time.sleep(2.0)
    out = Scale(helper(dist.get_rank()))(torch.ones(n))
    dist.all_reduce(out)
    print("finished", flush=True)
    return out.sum().item()

results = labkit.launch(work, 3, world_size=2, timeout=60)
print("RESULTS", results)
"""
    reply, streams = run_cell(kc, code)
    assert reply["status"] == "ok", reply
    text = "".join(s for _, s in streams)
    assert "RESULTS [9.0, 9.0]" in text  # (1 + 2) * 3 on both ranks
    started = [t for t, s in streams if "started" in s]
    finished = [t for t, s in streams if "RESULTS" in s]
    assert "[rank0]: started" in text and "[rank1]: started" in text
    # live: "started" reached the cell while the ranks were still sleeping
    assert started and finished and finished[0] - started[0] > 1.5


def test_rank_traceback_shows_the_cells_own_source(kernel):
    _, kc = kernel
    code = """
from labkit.launch import RankFailedError
def explode():
    if dist.get_rank() == 1:
        values = [1, 2]
        return values[5]  # the offending line
    return 0
try:
    labkit.launch(explode, world_size=2, timeout=60)
except RankFailedError as e:
    print("RANK", e.rank, e.exc_type)
    print(e.rank_traceback)
"""
    reply, streams = run_cell(kc, code)
    assert reply["status"] == "ok", reply
    text = "".join(s for _, s in streams)
    assert "RANK 1 IndexError" in text
    assert "return values[5]  # the offending line" in text


def test_stop_button_kills_every_rank_and_kernel_stays_healthy(kernel):
    km, kc = kernel
    tag = uuid.uuid4().hex
    reply, _ = run_cell(
        kc,
        "import signal, os\n"
        "before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}\n"
        "env_before = dict(os.environ)",
    )
    assert reply["status"] == "ok"
    code = f'''
def sleepy():
    print("ready", flush=True)
    time.sleep(600)
labkit.launch(sleepy, world_size=2, timeout=300, env={{"LABKIT_TEST_TAG": "{tag}"}})
'''
    seen = []

    def on_output(text):
        seen.append(text)
        if sum(t.count("ready") for t in seen) == 2 and not interrupted:
            interrupted.append(time.monotonic())
            km.interrupt_kernel()

    interrupted: list[float] = []
    reply, _ = run_cell(kc, code, timeout=60, on_output=on_output)
    assert interrupted, "ranks never reported ready"
    assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt"
    assert time.monotonic() - interrupted[0] < 15
    assert not processes_tagged(tag), "ranks survived the interrupt"
    reply, streams = run_cell(
        kc,
        "print(before == {s: signal.getsignal(s) for s in before}, "
        "env_before == dict(os.environ), 6 * 7)",
    )
    assert reply["status"] == "ok"
    assert "True True 42" in "".join(s for _, s in streams)


def test_world_in_a_kernel_keeps_rank_state_across_ranks_cells_and_dies_with_the_kernel():
    """%%ranks cells share each rank's namespace; the stop button keeps the world; killing
    the kernel ends every rank (the lifeline: launch/lifeline.py), with no close() ever called."""
    tag = uuid.uuid4().hex
    km, kc = start_new_kernel(kernel_name="python3")
    try:
        reply, _ = run_cell(
            kc,
            "import labkit\n"
            f'world = labkit.World(2, backend="gloo", env={{"LABKIT_TEST_TAG": "{tag}"}})',
        )
        assert reply["status"] == "ok", reply
        reply, _ = run_cell(
            kc, "%%ranks\nimport time\nt = torch.full((2,), float(rank))\ndist.all_reduce(t)"
        )
        assert reply["status"] == "ok", reply
        reply, streams = run_cell(kc, "%%ranks\nprint('on rank', rank)\nt * (rank + 1)")
        text = "".join(s for _, s in streams)
        assert reply["status"] == "ok", reply
        assert "[rank1]: on rank 1" in text and "[rank1]: tensor([2., 2.])" in text  # rank 1's t
        assert "[rank0]: tensor([1., 1.])" in text

        interrupted: list[float] = []

        def on_output(text):
            if "ready" in text and not interrupted:
                interrupted.append(time.monotonic())
                km.interrupt_kernel()

        reply, _ = run_cell(
            kc,
            "%%ranks\nprint('ready', flush=True)\ntime.sleep(600)",
            timeout=60,
            on_output=on_output,
        )
        assert interrupted and reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt"
        assert time.monotonic() - interrupted[0] < 15
        reply, streams = run_cell(kc, "%%ranks\nt.sum()")
        assert reply["status"] == "ok" and "[rank1]: tensor(2.)" in "".join(s for _, s in streams)

        reply, _ = run_cell(kc, "%%ranks\nraise ValueError('cell fails on rank ' + str(rank))")
        assert reply["status"] == "error" and reply["ename"] == "RankFailedError"
        assert "cell fails on rank" in reply["evalue"]
        assert len(processes_tagged(tag)) == 4  # two ranks, the zygote they were forked from
        # and the world's lifeline watchdog
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    deadline = time.monotonic() + 10
    while processes_tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not processes_tagged(tag), "ranks outlived their kernel"
