"""How nbval starts a notebook's kernel, for ./run-tests.

nbval asks jupyter_client for a kernel over TCP: the client picks five free ports, closes
them, and the kernel binds them a moment later. ./run-tests runs the notebooks beside
tests/, whose gloo jobs open TCP stores and connections by the hundred, so a port can be
taken in that gap; the kernel then dies at start and nbval reports only "Kernel died
before replying to kernel_info" (it sends the kernel's stderr to /dev/null). CI hit this
once, on 2026-11-27.

Here the kernel talks over Unix sockets in a private folder instead (no ports to race
for), and its stderr goes to a file whose tail is put into the error if it still dies.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from typing import Any

try:
    import nbval.kernel as _nbval_kernel
    from jupyter_client.manager import KernelManager
except ImportError:  # nbval is a test extra; without it there is nothing to patch
    _nbval_kernel = None


def _start_kernel_over_ipc(startup_timeout: float = 60, kernel_name: str = "python",
                           **kwargs: Any) -> tuple[Any, Any]:
    assert _nbval_kernel is not None
    folder = tempfile.mkdtemp(prefix="labkit-kernel-")  # mode 0700, ours alone
    log_path = os.path.join(folder, "stderr.log")
    passed_stderr = kwargs.pop("stderr", None)
    if passed_stderr is not None:
        passed_stderr.close()
    log = open(log_path, "w")  # noqa: SIM115 (handed to the kernel, closed just after)
    km = KernelManager(kernel_name=kernel_name, transport="ipc",
                       ip=os.path.join(folder, "kernel"),
                       kernel_spec_manager=_nbval_kernel.NbvalKernelspecManager())
    km.start_kernel(stderr=log, **kwargs)
    log.close()  # the kernel holds its own copy
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=startup_timeout)
    except RuntimeError as error:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
        with open(log_path) as f:
            tail = f.read()[-4000:]
        shutil.rmtree(folder, ignore_errors=True)
        raise RuntimeError(f"{error}; the kernel's stderr:\n{tail or '(empty)'}") from error
    # The sockets and the log are needed while the kernel runs; the folder goes when this
    # interpreter exits (nbval keeps no per-kernel hook to clean up on).
    atexit.register(shutil.rmtree, folder, True)
    return km, kc


if _nbval_kernel is not None:
    _nbval_kernel.start_new_kernel = _start_kernel_over_ipc
