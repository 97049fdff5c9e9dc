"""What travels from the caller to a job's processes: the pickled job, and their environment.

Split from ``launcher.py`` (which starts and watches the job): this is the payload. The job
(``fn``, its arguments, the config) is pickled by value with cloudpickle, so functions and
classes defined in a notebook cell reach the ranks; the source of in-memory code (notebook
cells) travels with it, so a rank's traceback shows the cell's own lines. The environment is
the caller's, plus line-unbuffered output, a fair share of the cores per rank
(``OMP_NUM_THREADS = cores // world_size``), this labkit on the path, and the run id that
marks every process of the job.
"""

from __future__ import annotations

import linecache
import os
import types
from pathlib import Path
from typing import Any

import cloudpickle
import cloudpickle.cloudpickle as _cp

from labkit.launch.config import LaunchConfig
from labkit.launch.lifeline import RUN_ID_VAR
from labkit.safe_files import make_private_dir

__all__ = ["_dumps", "_worker_env"]


class _Pickler(cloudpickle.Pickler):
    """cloudpickle, but functions keep their real file name (cloudpickle writes "<dynamic-code>").

    With the file name, and the kernel's ``linecache`` entries shipped alongside, a rank's
    traceback shows the notebook cell's own lines instead of anonymous frames.
    """

    def __init__(self, file: Any):
        super().__init__(file)
        self.filenames: set[str] = set()

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, types.CodeType) and hasattr(_cp, "_code_reduce"):
            ctor, args = _cp._code_reduce(obj)
            self.filenames.add(obj.co_filename)
            return ctor, tuple(obj.co_filename if a == "<dynamic-code>" else a for a in args)
        return super().reducer_override(obj)


def _dumps(job: dict[str, Any]) -> bytes:
    import io

    buffer = io.BytesIO()
    pickler = _Pickler(buffer)
    pickler.dump(job)
    # Source of code that exists only in memory (notebook cells): tracebacks need it.
    sources = {
        name: (len("".join(entry[2])), None, entry[2], name)
        for name in pickler.filenames
        if (entry := linecache.cache.get(name)) is not None
        and len(entry) == 4
        and not os.path.exists(name)
    }
    return buffer.getvalue() + cloudpickle.dumps(sources)


def _worker_env(cfg: LaunchConfig, run_id: str, run_dir: Path | None = None) -> dict[str, str]:
    """The environment of a job's processes: the caller's, plus line-unbuffered output, a
    fair share of the cores per rank, this labkit on the path, the run id that marks every
    process of the job (the tree kill checks it before killing a pid), and ``TMPDIR`` inside
    ``run_dir``: the folders multiprocessing (``pymp-*``) and torch's elastic agent
    (``torchelastic_*``) create are removed by their owners only at a clean exit, so a job
    whose processes are killed would leave them in the shared temp folder; in the run's own
    (private) folder they go when old runs are pruned. ``cfg.env`` may set another."""
    cores = os.cpu_count() or 1
    threads = cfg.threads_per_rank or max(1, cores // cfg.world_size)
    env = {
        **os.environ,
        **cfg.env,
        RUN_ID_VAR: run_id,
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": str(threads),
        # The agent should never see the kernel's signal bookkeeping.
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
    }
    # Make sure the agent imports *this* labkit, even from a notebook's working directory.
    pkg_parent = str(Path(__file__).resolve().parents[2])  # the folder that holds labkit/
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_parent, env.get("PYTHONPATH", "")) if p)
    tmp = None if run_dir is None or "TMPDIR" in cfg.env else Path(run_dir) / "tmp"
    # the forkserver listens on TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX, a Unix socket path
    # limited to 107 bytes: a run folder too deep for that keeps the system's temp folder
    if tmp is not None and len(str(tmp)) + len("/pymp-12345678/listener-12345678") < 107:
        make_private_dir(tmp, 0o700, exist_ok=True)  # umask-independent, checked
        env["TMPDIR"] = str(tmp)
    return env
