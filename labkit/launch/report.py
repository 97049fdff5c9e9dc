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


def _dump_stacks(
    run: Path, world_size: int, wait: float = 1.5, entry: str = "_worker"
) -> dict[int, str]:
    """SIGUSR1 every rank (faulthandler writes its stack to ``stack.N.txt``), then read what
    they wrote. ``entry`` is the labkit function that calls the learner's code."""
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
        if all(
            entry in s or s.rstrip().endswith("(most recent call first):") for s in stacks.values()
        ):
            break
        time.sleep(0.05)
    return {rank: _trim_stack(text, entry) for rank, text in stacks.items()}


def _trim_stack(text: str, entry: str = "_worker") -> str:
    """Keep each thread's frames down to labkit's ``entry``: below it is only machinery."""
    kept: list[str] = []
    skipping = False
    for line in text.splitlines():
        if not line.startswith(" "):  # a "Thread 0x... (most recent call first):" header
            skipping = False
        elif skipping:
            continue
        elif "labkit" in line and line.rstrip().endswith(f"in {entry}"):
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


def _stderr_tail(text: str, entry: str = "_worker", max_lines: int = 30) -> str:
    """The last meaningful lines of a rank that died in native code.

    A native abort leaves, at the end of the rank's stderr, the library's own message (gloo's
    "Received data size doesn't match expected size...") and then faulthandler's report
    ("Fatal Python error: Aborted" and every thread's frames). Keep from a few lines before
    that report to its end, drop the machinery below ``entry`` and the list of extension
    modules; without such a report, keep the last non-blank lines.
    """
    lines = [line for line in text.splitlines() if line.strip()]
    cut = next((i for i, line in enumerate(lines) if line.startswith("Extension modules:")), None)
    lines = lines[:cut]
    fatal = [i for i, line in enumerate(lines) if line.startswith("Fatal Python error")]
    if fatal:
        start = fatal[-1]
        while start > 0 and fatal[-1] - start < 6 and not lines[start - 1].startswith("[rank"):
            start -= 1  # the native message printed just before the abort
        lines = lines[start:]
    kept = _trim_stack("\n".join(lines), entry).splitlines()
    return "\n".join(kept[-max_lines:])


def _died_error(died: dict[str, Any], log_dir: Path | None, others: list[int]) -> RankFailedError:
    """A rank that left no Python record: say how it died and what its stderr said last."""
    if died.get("signal"):
        how = f"was killed by {died['signal']}"
    elif died.get("exitcode") is not None:
        how = f"exited with code {died['exitcode']}"
    else:
        how = "exited without reporting an error"
    tail = died.get("stderr", "")
    detail = (
        f"(no Python exception; the last lines of its stderr:)\n{tail}"
        if tail
        else "(no Python traceback: the process was killed, ran out of memory, or crashed in "
        "native code)"
    )
    return RankFailedError(
        died["rank"], "ProcessDied", f"the process {how}", detail, log_dir, others
    )


def _blame(
    records: list[dict[str, Any]], died: list[dict[str, Any]], log_dir: Path | None
) -> RankFailedError | None:
    """The failing rank to blame, in order of evidence:

    1. a rank that raised a genuine exception (the earliest, if several), including one whose
       exception was still in flight when it was killed (a *pending* record);
    2. a rank that died without a Python record (SIGKILL, out of memory, a native crash),
       a known signal first; ``died`` entries carry rank, signal, exitcode and stderr tail;
    3. only then a rank that merely saw "connection closed by peer".
    """
    records = sorted(records, key=lambda r: (r["collateral"], r["time"]))
    reported = {r["rank"] for r in records}
    if records and not records[0]["collateral"]:
        root = records[0]
        others = sorted(r["rank"] for r in records[1:])
        return RankFailedError(
            root["rank"], root["type"], root["message"], root["traceback"], log_dir, others
        )
    unreported = sorted(
        (d for d in died if d["rank"] not in reported), key=lambda d: not d["signal"]
    )
    if unreported:
        others = sorted(reported | {d["rank"] for d in unreported[1:]})
        return _died_error(unreported[0], log_dir, others)
    if records:
        root = records[0]
        others = sorted(r["rank"] for r in records[1:])
        return RankFailedError(
            root["rank"], root["type"], root["message"], root["traceback"], log_dir, others
        )
    return None


def _root_cause(
    run: Path, log_dir: Path, silent_dead: set[int] | None = None
) -> RankFailedError | None:
    """Blame a rank of a launch from the files its ranks and agent left in ``run``: error
    records, the agent's exit codes (``agent_failures.json``), else ``silent_dead`` (ranks
    seen dead with no record), and each dead rank's stderr log."""
    records = _error_records(run)
    if records:
        last_restart = max(r["restart"] for r in records)
        records = [r for r in records if r["restart"] == last_restart]
    reported = {r["rank"] for r in records}
    path = run / "agent_failures.json"
    died = [f for f in json.loads(path.read_text())["failures"]] if path.exists() else []
    if not [f for f in died if f["rank"] not in reported]:
        died = [
            {"rank": r, "signal": "", "exitcode": None}
            for r in sorted((silent_dead or set()) - reported)
        ]
    attempts = sorted(log_dir.glob("*/attempt_*"))
    for f in died:
        log = attempts[-1] / str(f["rank"]) / "stderr.log" if attempts else None
        if log is not None and log.exists():
            f["stderr"] = _stderr_tail(log.read_text(errors="replace"))
    return _blame(records, died, log_dir)
