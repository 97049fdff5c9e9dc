"""How a failed job is explained: which rank to blame, and where every rank was stuck.

The rank side writes ``error.N.json`` (with a ``collateral`` flag for "connection closed by
peer" and friends) and answers SIGUSR1 with a faulthandler stack; this module reads them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from labkit.launch.config import RankFailedError


def _dump_stacks(run: Path, world_size: int, wait: float = 1.5) -> dict[int, str]:
    """SIGUSR1 every rank (faulthandler writes its stack), then read what they wrote."""
    for rank in range(world_size):
        with contextlib.suppress(ValueError, OSError, ProcessLookupError):
            os.kill(int((run / f"pid.{rank}").read_text()), signal.SIGUSR1)
    deadline = time.monotonic() + wait
    stacks: dict[int, str] = {}
    while time.monotonic() < deadline:
        stacks = {}
        for rank in range(world_size):
            path = run / f"stack.{rank}.txt"
            stacks[rank] = path.read_text() if path.exists() else ""
        if all(s.rstrip().endswith(("in _worker", "(most recent call first):")) or "_worker" in s for s in stacks.values()):
            break
        time.sleep(0.05)
    return {rank: _trim_stack(text) for rank, text in stacks.items()}


def _trim_stack(text: str) -> str:
    """Keep each thread's frames down to labkit's ``_worker``: below it is only machinery."""
    kept: list[str] = []
    skipping = False
    for line in text.splitlines():
        if not line.startswith(" "):  # a "Thread 0x... (most recent call first):" header
            skipping = False
        elif skipping:
            continue
        elif "labkit" in line and line.rstrip().endswith("in _worker"):
            skipping = True
            continue
        kept.append(line)
    return "\n".join(kept)


def _error_records(run: Path) -> list[dict[str, Any]]:
    records = []
    for path in run.glob("error.*.json"):
        with contextlib.suppress(OSError, ValueError):
            records.append(json.loads(path.read_text()))
    return records


def _final_failure(records: list[dict[str, Any]], max_restarts: int) -> bool:
    """True once a rank has failed in the last attempt elastic is allowed to make."""
    return any(r["restart"] >= max_restarts for r in records)


def _root_cause(run: Path, log_dir: Path) -> RankFailedError | None:
    """The failing rank to blame: a genuine exception beats 'connection closed by peer'.

    A rank killed by a signal or a native crash leaves no Python record; the agent's view of
    exit codes (``agent_failures.json``) names it instead.
    """
    records = _error_records(run)
    if records:
        last_restart = max(r["restart"] for r in records)
        records = [r for r in records if r["restart"] == last_restart]
        records.sort(key=lambda r: (r["collateral"], r["time"]))
        root = records[0]
        others = sorted(r["rank"] for r in records[1:])
        if not root["collateral"] or not (run / "agent_failures.json").exists():
            return RankFailedError(root["rank"], root["type"], root["message"], root["traceback"], log_dir, others)
    died = run / "agent_failures.json"
    if died.exists():
        every = json.loads(died.read_text())["failures"]
        failures = [f for f in every if f["signal"]] or every
        if failures:
            f = failures[0]
            how = f"was killed by {f['signal']}" if f["signal"] else f"exited with code {f['exitcode']}"
            return RankFailedError(
                f["rank"],
                "ProcessDied",
                f"the process {how}",
                "(no Python traceback: the process was killed, ran out of memory, or crashed in native code)",
                log_dir,
                [g["rank"] for g in failures[1:]],
            )
    return None
