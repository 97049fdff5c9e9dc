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
    """Final records (``error.N.json``) first, then pending ones of ranks with no final record."""
    final: list[dict[str, Any]] = []
    pending: list[dict[str, Any]] = []
    for path in run.glob("error.*.json"):
        with contextlib.suppress(OSError, ValueError):
            record = json.loads(path.read_text())
            (pending if record.get("pending") else final).append(record)
    reported = {r["rank"] for r in final}
    return final + [r for r in pending if r["rank"] not in reported]


def _final_failure(records: list[dict[str, Any]], max_restarts: int) -> bool:
    """True once a rank has failed in the last attempt elastic is allowed to make."""
    return any(r["restart"] >= max_restarts and not r.get("pending") for r in records)


def _root_cause(run: Path, log_dir: Path, silent_dead: set[int] | None = None) -> RankFailedError | None:
    """The failing rank to blame, in order of evidence:

    1. a rank that raised a genuine exception (the earliest, if several), including one whose
       exception was still in flight when it was killed (a *pending* record);
    2. a rank that died without a Python record (SIGKILL, out of memory, a native crash):
       the agent's exit codes (``agent_failures.json``) name it and its signal, else
       ``silent_dead`` (ranks seen dead with no record) does;
    3. only then a rank that merely saw "connection closed by peer".
    """
    records = _error_records(run)
    if records:
        last_restart = max(r["restart"] for r in records)
        records = [r for r in records if r["restart"] == last_restart]
    records.sort(key=lambda r: (r["collateral"], r["time"]))
    reported = {r["rank"] for r in records}
    if records and not records[0]["collateral"]:
        root = records[0]
        others = sorted(r["rank"] for r in records[1:])
        return RankFailedError(root["rank"], root["type"], root["message"], root["traceback"], log_dir, others)

    died = run / "agent_failures.json"
    unreported = [f for f in json.loads(died.read_text())["failures"] if f["rank"] not in reported] if died.exists() else []
    unreported.sort(key=lambda f: not f["signal"])  # a signal is the strongest evidence
    if not unreported:
        unreported = [{"rank": r, "signal": "", "exitcode": None} for r in sorted((silent_dead or set()) - reported)]
    if unreported:
        f = unreported[0]
        if f["signal"]:
            how = f"was killed by {f['signal']}"
        elif f["exitcode"] is not None:
            how = f"exited with code {f['exitcode']}"
        else:
            how = "exited without reporting an error"
        return RankFailedError(
            f["rank"],
            "ProcessDied",
            f"the process {how}",
            "(no Python traceback: the process was killed, ran out of memory, or crashed in native code)",
            log_dir,
            sorted(reported | {g["rank"] for g in unreported[1:]}),
        )
    if records:
        root = records[0]
        others = sorted(r["rank"] for r in records[1:])
        return RankFailedError(root["rank"], root["type"], root["message"], root["traceback"], log_dir, others)
    return None
