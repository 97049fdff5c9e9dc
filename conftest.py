"""How nbval starts a notebook's kernel, for ./run-tests: over Unix sockets, never TCP ports
that tests/' gloo jobs can take first (``tests/kernels.py``), and with the kernel's stderr in
the error when it dies at start (nbval sends it to /dev/null and reports only "Kernel died
before replying to kernel_info", which is all CI showed on 2026-11-27)."""

from __future__ import annotations

import os
from typing import Any

try:
    import nbval.kernel as _nbval_kernel

    from tests.kernels import ipc_kernel_manager
except ImportError:  # nbval is a test extra; without it there is nothing to patch
    _nbval_kernel = None


def _start_kernel_over_ipc(startup_timeout: float = 60, kernel_name: str = "python",
                           **kwargs: Any) -> tuple[Any, Any]:
    """nbval's ``start_new_kernel``, over Unix sockets, reporting the kernel's stderr."""
    assert _nbval_kernel is not None
    km = ipc_kernel_manager(kernel_name,
                            kernel_spec_manager=_nbval_kernel.NbvalKernelspecManager())
    passed_stderr = kwargs.pop("stderr", None)
    if passed_stderr is not None:
        passed_stderr.close()
    log_path = os.path.join(os.path.dirname(km.ip), "stderr.log")
    with open(log_path, "w") as log:  # the kernel holds its own copy
        km.start_kernel(stderr=log, **kwargs)
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=startup_timeout)
    except RuntimeError as error:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
        with open(log_path) as f:
            tail = f.read()[-4000:]
        raise RuntimeError(f"{error}; the kernel's stderr:\n{tail or '(empty)'}") from error
    return km, kc


if _nbval_kernel is not None:
    _nbval_kernel.start_new_kernel = _start_kernel_over_ipc
