"""The test suite's notebook kernels, forked from one process that imported torch and ipykernel
once, instead of each kernel importing them again (about 2.5 s of CPU a kernel; the suite
starts some 50 kernels on a 2-core machine).

Each kernel is still a fresh process: the zygote ran no notebook code, only imports, and
forks on request. The kernel manager (``ZygoteKernelManager``) asks for a fork instead of
``Popen`` when the command is ``python -m ipykernel_launcher`` of this interpreter and the
startup environment (PYTHONPATH and the like) is the zygote's; otherwise, as in
``tests/test_notebook_kernel.py``'s crashing sitecustomize, it starts the kernel as usual.

Protocol, over a Unix socket in a private 0700 folder: the client sends one JSON request
``{argv, env, cwd}`` with the kernel's stdin, stdout and stderr as passed file descriptors;
the zygote forks (the child: a new session, those fds as 0-2, the env and cwd, then
ipykernel's ``launch_new_instance``), replies with the pid, and when the kernel exits sends
its exit code (``subprocess``'s convention: -9 for SIGKILL) and closes the connection. The
zygote dies with the process that started it (PR_SET_PDEATHSIG), and its kernels, whose
parent poller watches the zygote (``--IPKernelApp.parent_handle``), follow.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from jupyter_client.manager import KernelManager

# What changes how an interpreter starts: a kernel asked for with another value is not forked.
_STARTUP_VARS = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONSAFEPATH",
                 "PYTHONNOUSERSITE", "PYTHONUSERBASE", "LD_PRELOAD", "LD_LIBRARY_PATH")  # fmt: skip
_SERVE = "import sys; from tests.kernel_zygote import serve; serve(*sys.argv[1:])"


def serve(path: str, root: str) -> None:
    """The zygote: import what every kernel imports, then fork one kernel per request."""
    sys.path.remove(root)  # on the path only to import this module: kernels do not see it
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the process that started us
    import ipykernel.kernelapp  # noqa: F401 - the imports every kernel shares
    import torch  # noqa: F401

    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen()
    kernels: dict[int, socket.socket] = {}
    while True:
        ready, _, _ = select.select([server], [], [], 0.1)
        while kernels:  # report every kernel that exited
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = kernels.pop(pid)
            with contextlib.suppress(OSError):  # a client gone: nobody to tell
                conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            conn.close()
        if not ready:
            continue
        conn, _ = server.accept()
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        request = json.loads(message)
        pid = os.fork()
        if pid == 0:
            server.close()
            for other in kernels.values():
                other.close()
            conn.close()
            _become_kernel(request, fds)
        for fd in fds:
            os.close(fd)
        conn.sendall(f"{pid}\n".encode())
        kernels[pid] = conn


def _become_kernel(request: dict[str, Any], fds: list[int]) -> None:
    code = 1
    try:
        os.setsid()  # as jupyter_client starts kernels: its own group, for interrupts
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"], JPY_PARENT_PID=str(os.getppid()))  # for its children
        # ipykernel reads JPY_PARENT_PID when imported (in the zygote): name the parent to
        # watch on the command line, so that the kernel exits when the zygote does
        sys.argv = ["ipykernel_launcher", *request["argv"],
                    f"--IPKernelApp.parent_handle={os.getppid()}"]  # fmt: skip
        sys.path[0] = request["cwd"]  # what ``python -m`` puts first
        for name in [m for m in sys.modules if m == "tests" or m.startswith("tests.")]:
            del sys.modules[name]  # imported to serve; a kernel never imported them
        from ipykernel.kernelapp import launch_new_instance

        launch_new_instance()
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:  # noqa: BLE001 - the kernel's stderr is the manager's to read
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(code)


class ForkedKernel:
    """A forked kernel with the ``subprocess.Popen`` names jupyter_client's provisioner uses."""

    stdin = stdout = stderr = None

    def __init__(self, conn: socket.socket) -> None:
        self._conn = conn
        self._file = conn.makefile("rb")
        self.pid = int(self._file.readline())
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None and select.select([self._conn], [], [], 0)[0]:
                line = self._file.readline()
                self.returncode = int(line) if line else -signal.SIGKILL  # zygote gone
                self._file.close()
                self._conn.close()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and not select.select([self._conn], [], [], timeout)[0]:
            raise subprocess.TimeoutExpired(f"kernel {self.pid}", timeout or 0.0)
        code = self.poll()
        assert code is not None
        return code

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


_ZYGOTES: dict[tuple[str, ...], dict[str, Any]] = {}  # interpreter flags -> path, process


def _zygote(flags: tuple[str, ...]) -> dict[str, Any]:
    """This process's zygote for interpreters started with ``flags`` (started on first use, and
    again if it died)."""
    if flags not in _ZYGOTES or _ZYGOTES[flags]["proc"].poll() is not None:
        folder = tempfile.mkdtemp(prefix="labkit-kernel-zygote-")  # mode 0700, ours alone
        path = os.path.join(folder, "zygote")
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (root, os.environ.get("PYTHONPATH")) if p))  # fmt: skip
        proc = subprocess.Popen([sys.executable, *flags, "-c", _SERVE, path, root], env=env,
                                stdin=subprocess.DEVNULL)  # fmt: skip
        atexit.register(shutil.rmtree, folder, True)
        atexit.register(proc.kill)
        _ZYGOTES[flags] = {"path": path, "proc": proc}
    return _ZYGOTES[flags]


def fork_kernel(
    flags: tuple[str, ...], argv: list[str], env: dict[str, str], cwd: str, stdio: list[int]
) -> ForkedKernel:
    """Ask the zygote for a kernel ``python *flags -m ipykernel_launcher *argv`` with ``stdio``
    as its fds 0-2."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    zygote = _zygote(flags)
    path = zygote["path"]
    for _ in range(1200):  # the zygote binds its socket once its imports are done
        try:
            conn.connect(path)
            break
        except (FileNotFoundError, ConnectionRefusedError):
            if zygote["proc"].poll() is not None:
                raise RuntimeError("the kernel zygote exited before serving") from None
            time.sleep(0.05)
    else:
        raise RuntimeError(f"the kernel zygote never listened on {path}")
    socket.send_fds(conn, [json.dumps({"argv": argv, "env": env, "cwd": cwd}).encode()], stdio)
    return ForkedKernel(conn)


class ZygoteKernelManager(KernelManager):
    """jupyter_client's KernelManager, forking its kernel from the zygote when it can."""

    async def _async_launch_kernel(self, kernel_cmd: list[str], **kw: Any) -> None:
        env = kw.get("env") or dict(os.environ)
        same_start = all(env.get(k) == os.environ.get(k) for k in _STARTUP_VARS)
        at = kernel_cmd.index("-m") if "-m" in kernel_cmd else 0
        flags = tuple(kernel_cmd[1:at])
        module = kernel_cmd[at + 1 : at + 2]
        ours = kernel_cmd[0] == sys.executable and module == ["ipykernel_launcher"]
        if not (same_start and at and ours and all(f.startswith("-X") for f in flags)):
            return await super()._async_launch_kernel(kernel_cmd, **kw)
        with contextlib.ExitStack() as stack:  # Popen's None (and PIPE) is /dev/null here
            stdio = [
                stack.enter_context(open(os.devnull, "r+b")).fileno()
                if stream is None or stream == subprocess.PIPE
                else stream if isinstance(stream, int) else stream.fileno()
                for stream in (kw.get("stdin"), kw.get("stdout"), kw.get("stderr"))
            ]  # fmt: skip
            cwd = str(kw.get("cwd") or os.getcwd())
            proc = fork_kernel(flags, kernel_cmd[at + 2 :], env, cwd, stdio)
        provisioner: Any = self.provisioner
        provisioner.process, provisioner.pid, provisioner.pgid = proc, proc.pid, proc.pid
        provisioner.cwd = cwd
        self._reconcile_connection_info(provisioner.connection_info)
