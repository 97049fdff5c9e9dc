"""Run a function on N ranks, from a notebook cell or a script: all process plumbing lives here.

``launch(fn, *args, world_size=2)`` runs ``fn(*args)`` on ``world_size`` processes with
``torch.distributed`` initialised and returns the per-rank results, indexed by rank.

How a launch is built (the same engine as ``torchrun``)::

    kernel (your notebook)                 agent subprocess                  workers
    ----------------------                 ----------------                  -------
    cloudpickle fn+args -> run_dir/job.pkl
    Popen(python -c _AGENT_BOOTSTRAP)      elastic_launch(config, _worker) -> rank 0 .. N-1
    print each "[rankN]: ..." line   <---- tee of every worker's stdout/stderr
    watchdog: at the deadline SIGUSR1 ----------------------------------------> faulthandler stacks
    read result.N.pkl / error.N.json <----------------------------------------- written by _worker

Why an agent subprocess rather than ``elastic_launch`` inside the kernel: the elastic agent
installs signal handlers and writes ``os.environ`` in the process that calls it. In a
subprocess the kernel keeps its own handlers, an interrupt is a plain ``KeyboardInterrupt``,
and killing one process tree ends the whole job.

Invariants the tests hold this module to:

* a raising rank fails the job within seconds; the exception names that rank and carries its
  traceback, never a bystander that only saw "connection closed by peer";
* a hang ends at ``timeout`` with every rank's Python stack;
* no process outlives its job (success, failure, timeout, interrupt), nor a launcher that
  dies, SIGKILL included: every process of a job (agent, forkserver, resource tracker, ranks,
  whatever a rank starts) is one process group, killed within milliseconds by a watchdog that
  sees the launcher's end of a pipe close (``lifeline.py`` says why ``PR_SET_PDEATHSIG`` alone
  could not promise it);
* a job's files (pickles: unpickling runs code) live in a folder only its user can write,
  checked on every use (``runs.py``);
* every launch rendezvous on its own free port on 127.0.0.1.

Under ``torchrun`` the same worker functions run unchanged through :func:`run_from_env`.

Read in this order: ``config.py`` (what a launch is asked to do, its errors), ``launcher.py``
(the caller's side) and ``shipping.py`` (what it sends: the pickled job, the ranks'
environment), ``agent.py`` (the elastic agent), ``rank.py`` (what runs on a rank),
``report.py`` (who to blame when it fails, and where each rank was stuck), ``lifeline.py`` and
``runs.py`` (process life and the runs folder, shared by both). ``world.py`` and
``world_rank.py`` keep ranks alive across calls (:class:`World`, the ``%%ranks`` magic of
``magic.py``) with the same guarantees, reusing the pieces above.
"""

import sys
import types
from typing import Any

from labkit.launch.config import (
    JobTimeoutError,
    LaunchConfig,
    LaunchError,
    RankFailedError,
    choose_backend,
    describe_machine,
)
from labkit.launch.launcher import launch
from labkit.launch.magic import register_in_ipython
from labkit.launch.rank import local_device, run_from_env, seed_everything
from labkit.launch.world import World, WorldClosedError

__all__ = [
    "JobTimeoutError",
    "LaunchConfig",
    "LaunchError",
    "RankFailedError",
    "World",
    "WorldClosedError",
    "choose_backend",
    "describe_machine",
    "launch",
    "local_device",
    "run_from_env",
    "seed_everything",
]


class _CallableModule(types.ModuleType):
    """``labkit.launch(fn, ...)`` calls :func:`launch`, while ``labkit.launch.local_device``
    and ``import labkit.launch.rank`` still reach the package: a plain function in its place
    would shadow the package and break both."""

    def __call__(self, fn: Any, *args: Any, **kwargs: Any) -> list[Any]:
        return launch(fn, *args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
register_in_ipython()  # %%ranks, in a notebook (nothing in a script or a rank)
