"""The notebooks' kernels (root conftest.py): Unix sockets, no TCP ports to race for, forked
from the suite's kernel zygote (tests/kernel_zygote.py), and a kernel that dies at start is
reported with its own stderr, not nbval's bare message."""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

import pytest

pytest.importorskip("nbval")

ROOT = Path(__file__).resolve().parents[1]


def _root_conftest():
    spec = importlib.util.spec_from_file_location("labkit_root_conftest", ROOT / "conftest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(120)
def test_kernel_uses_private_unix_sockets_and_answers():
    start = _root_conftest()._start_kernel_over_ipc
    km, kc = start(startup_timeout=60, kernel_name="python3")
    try:
        assert km.transport == "ipc"
        folder = Path(km.ip).parent
        assert folder.stat().st_uid == os.getuid()
        assert folder.stat().st_mode & 0o077 == 0, oct(folder.stat().st_mode)
        reply = kc.execute_interactive("x = 6 * 7", timeout=60)
        assert reply["content"]["status"] == "ok"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


@pytest.mark.timeout(120)
def test_a_kernel_that_dies_at_start_is_reported_with_its_stderr(tmp_path):
    # A sitecustomize that exits stands in for any crash before the kernel answers. (Its own
    # PYTHONPATH also makes this kernel a spawned interpreter, not a fork of the zygote.)
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\nsys.stderr.write('crashed-before-kernel-info\\n')\nsys.exit(3)\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    start = _root_conftest()._start_kernel_over_ipc
    with pytest.raises(RuntimeError, match="crashed-before-kernel-info"):
        start(startup_timeout=30, kernel_name="python3", env=env)


@pytest.mark.timeout(120)
def test_kernels_are_forked_from_the_zygote_and_interrupt_and_end_as_spawned_ones():
    import psutil

    from tests import kernel_zygote

    start = _root_conftest()._start_kernel_over_ipc
    km, kc = start(startup_timeout=60, kernel_name="python3")
    try:
        out: list[str] = []
        kc.execute_interactive("import os, sys; print(os.getppid(), 'torch' in sys.modules)",
                               timeout=60, output_hook=lambda m: out.append(
                                   m["content"].get("text", "")))  # fmt: skip
        zygotes = {z["proc"].pid for z in kernel_zygote._ZYGOTES.values()}
        ppid, torch_loaded = "".join(out).split()
        assert int(ppid) in zygotes and int(ppid) != os.getpid(), (out, zygotes)
        assert torch_loaded == "True"  # imported once, in the zygote, before the fork
        # an interrupt reaches the kernel's process group, as for a spawned kernel
        msg_id = kc.execute("import time; time.sleep(60)")
        time.sleep(0.5)
        km.interrupt_kernel()
        reply = kc.get_shell_msg(timeout=20)
        assert reply["parent_header"]["msg_id"] == msg_id
        assert reply["content"]["ename"] == "KeyboardInterrupt", reply["content"]
        pid = km.provisioner.pid
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)
    assert not km.is_alive() and not psutil.pid_exists(pid)


@pytest.mark.timeout(120)
def test_a_forked_kernel_dies_with_its_zygote_and_the_next_kernel_gets_a_new_one():
    import psutil

    from tests import kernel_zygote

    start = _root_conftest()._start_kernel_over_ipc
    km, kc = start(startup_timeout=60, kernel_name="python3")
    kc.stop_channels()
    kernel = psutil.Process(km.provisioner.pid)
    zygote = kernel.parent()
    assert zygote is not None and zygote.pid in {
        z["proc"].pid for z in kernel_zygote._ZYGOTES.values()}  # fmt: skip
    zygote.kill()  # as when pytest itself is killed (the zygote's death signal)
    kernel.wait(timeout=30)  # its parent poller sees the zygote gone
    km2, kc2 = start(startup_timeout=60, kernel_name="python3")
    try:
        assert psutil.Process(km2.provisioner.pid).ppid() != zygote.pid
    finally:
        kc2.stop_channels()
        km2.shutdown_kernel(now=True)
