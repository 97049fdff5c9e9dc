"""Jupyter kernels for the test suite that talk over Unix sockets in a private folder.

Over TCP, jupyter_client picks five free ports, closes them, and the kernel binds them a
moment later. ./run-tests runs notebooks beside tests/, whose gloo jobs open stores and
connections by the hundred, so a port can be taken in that gap; the kernel then dies at start
("Kernel died before replying to kernel_info", CI on 2026-11-27). Unix sockets have no ports
to race for.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

from jupyter_client.manager import KernelManager

from tests.kernel_zygote import ZygoteKernelManager


def ipc_kernel_manager(
    kernel_name: str = "python3", *, fork: bool = True, **kwargs: object
) -> KernelManager:
    """A kernel manager (not started) whose kernel listens on Unix sockets in a fresh 0700
    folder, removed when this interpreter exits; with ``fork``, the kernel is forked from the
    suite's kernel zygote where it can be (``tests/kernel_zygote.py``)."""
    folder = tempfile.mkdtemp(prefix="labkit-kernel-")  # mode 0700, ours alone
    atexit.register(shutil.rmtree, folder, True)
    manager = ZygoteKernelManager if fork else KernelManager
    return manager(kernel_name=kernel_name, transport="ipc",
                   ip=os.path.join(folder, "kernel"), **kwargs)  # fmt: skip
