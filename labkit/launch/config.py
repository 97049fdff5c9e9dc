"""What a launch is asked to do, validated before any process starts, and how it can fail."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from labkit.cluster.spec import EmulatedCluster

_JOB_FILE = "job.pkl"


class LaunchError(RuntimeError):
    """A distributed job did not complete. ``log_dir`` holds every rank's stdout/stderr."""

    def __init__(self, message: str, log_dir: Path | None = None):
        super().__init__(message)
        self.log_dir = log_dir


class RankFailedError(LaunchError):
    """A rank raised. ``rank``, ``exc_type`` and ``rank_traceback`` describe the root cause."""

    def __init__(
        self,
        rank: int,
        exc_type: str,
        exc_message: str,
        rank_traceback: str,
        log_dir: Path | None,
        others: Sequence[int] = (),
    ):
        self.rank = rank
        self.exc_type = exc_type
        self.exc_message = exc_message
        self.rank_traceback = rank_traceback
        self.other_failed_ranks = list(others)
        also = (
            f"\n(ranks {self.other_failed_ranks} failed too, as a consequence)"
            if self.other_failed_ranks
            else ""
        )
        super().__init__(
            f"rank {rank} raised {exc_type}: {exc_message}{also}\n\n"
            f"--- traceback on rank {rank} ---\n{rank_traceback.rstrip()}\n\nlogs: {log_dir}",
            log_dir,
        )


class JobTimeoutError(LaunchError):
    """The job ran past its timeout. ``stacks[rank]`` is where each rank was stuck."""

    def __init__(self, timeout: float, stacks: dict[int, str], log_dir: Path | None):
        self.timeout = timeout
        self.stacks = stacks
        parts = [
            f"job still running after timeout={timeout:g}s; every rank's stack at that moment:"
        ]
        for rank in sorted(stacks):
            parts.append(f"\n--- rank {rank} ---\n{stacks[rank].rstrip() or '(no stack captured)'}")
        parts.append(f"\nlogs: {log_dir}")
        super().__init__("\n".join(parts), log_dir)


# --------------------------------------------------------------------------------------
# Configuration, validated before any process starts
# --------------------------------------------------------------------------------------


@dataclass
class LaunchConfig:
    """Everything a launch needs besides the function. Validated in ``__post_init__``."""

    world_size: int = 2
    backend: str | None = None  # None: nccl when there is a GPU per rank, else gloo
    timeout: float = 300.0  # wall clock for the whole job
    collective_timeout: float | None = None  # bound on each collective; None: same as timeout
    max_restarts: int = 0  # elastic restarts of the whole worker group after a failure
    # forkserver: ranks fork from a single-threaded server holding torch, itself forked from
    # the agent before the agent starts any thread, so torch is imported once (zygote.py).
    # Plain fork copies the elastic agent's threads and can deadlock a rank (seen here: a
    # rank stuck creating its store client); spawn is safe but re-imports torch per rank.
    start_method: str = "forkserver"
    threads_per_rank: int | None = None  # None: cores // world_size on CPU, at least 1
    host: str = "127.0.0.1"  # rendezvous address; "0.0.0.0" to accept other nodes
    log_dir: Path | None = None  # None: a fresh folder under tempdir/labkit-runs-<uid>
    env: dict[str, str] = field(default_factory=dict)  # extra environment for the workers
    quiet: bool = False  # True: do not echo worker output (it is still logged)
    cluster: EmulatedCluster | None = None  # None: one machine; else ranks live on its nodes

    def __post_init__(self) -> None:
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int):
            raise TypeError(f"world_size must be an int, got {self.world_size!r}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not (isinstance(self.timeout, int | float) and self.timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {self.timeout!r}")
        if self.collective_timeout is None:
            self.collective_timeout = float(self.timeout)
        elif not self.collective_timeout > 0:
            raise ValueError(
                f"collective_timeout must be positive, got {self.collective_timeout!r}"
            )
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.start_method not in ("spawn", "fork", "forkserver"):
            raise ValueError(
                f"start_method must be spawn, fork or forkserver, got {self.start_method!r}"
            )
        if self.threads_per_rank is not None and self.threads_per_rank < 1:
            raise ValueError(f"threads_per_rank must be >= 1, got {self.threads_per_rank}")
        self.backend = choose_backend(self.world_size, self.backend)
        if self.cluster is not None:
            from labkit.cluster.spec import EmulatedCluster

            if not isinstance(self.cluster, EmulatedCluster):
                raise TypeError(f"cluster must be an EmulatedCluster, got {self.cluster!r}")
            self.cluster.check(self.world_size, self.backend)


def describe_machine() -> dict[str, Any]:
    """What this machine offers a distributed job: the facts notebook 00 opens with."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return {
        "torch": torch.__version__,
        "cpu cores": os.cpu_count(),
        "GPUs": [torch.cuda.get_device_name(i) for i in range(gpus)],
        "gloo available": dist.is_gloo_available(),
        "nccl available": dist.is_nccl_available(),
        "backend for 2 ranks": choose_backend(2),
    }


def choose_backend(world_size: int, backend: str | None = None) -> str:
    """NCCL with one GPU per rank when enough GPUs exist, gloo otherwise.

    A forced choice is checked."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend is None:
        return "nccl" if gpus >= world_size and dist.is_nccl_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo', 'nccl' or None, got {backend!r}")
    if backend == "nccl" and gpus < world_size:
        raise ValueError(
            f"backend='nccl' needs one GPU per rank: world_size={world_size} "
            f"but {gpus} GPU(s) visible"
        )
    return backend
