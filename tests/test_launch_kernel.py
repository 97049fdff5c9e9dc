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
    code = '''
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
'''
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
    code = '''
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
'''
    reply, streams = run_cell(kc, code)
    assert reply["status"] == "ok", reply
    text = "".join(s for _, s in streams)
    assert "RANK 1 IndexError" in text
    assert "return values[5]  # the offending line" in text


def test_stop_button_kills_every_rank_and_kernel_stays_healthy(kernel):
    km, kc = kernel
    tag = uuid.uuid4().hex
    reply, _ = run_cell(kc, "import signal, os\nbefore = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}\nenv_before = dict(os.environ)")
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
    reply, streams = run_cell(kc, "print(before == {s: signal.getsignal(s) for s in before}, env_before == dict(os.environ), 6 * 7)")
    assert reply["status"] == "ok"
    assert "True True 42" in "".join(s for _, s in streams)
