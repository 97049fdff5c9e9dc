"""A training step's time, per rank, read from ``torch.profiler``: the first thing to look at
when "training is slow" (interview topics A1, S8, K8).

The training loop marks the parts of a step with :func:`region`, a ``record_function`` range
named ``labkit::<category>``; the profiler records those ranges next to every operator it sees
(``aten::addmm``, ``gloo:all_reduce``, ``aten::_local_scalar_dense`` ...). Reading the ranges
back gives, for each step::

    step = data + h2d + forward + backward + comm + optimizer + other

    data       waiting for the next batch from the loader (the input pipeline)
    h2d        the host-to-device copy of the batch
    forward    the model and the loss
    backward   autograd
    comm       EXPOSED communication: the gradient all-reduces still running after backward
               (with overlap, notebook 03, part of the traffic hides inside backward and
               only the tail shows here)
    optimizer  the parameter update
    other      step time no region claims: logging, checkpoint saves, Python overhead

Besides seconds, the same events give counts per step that no timer shows: how many
all-reduces ran (tiny buckets -> hundreds), torch's and labkit's own (``Comm(impl="ring")``)
alike, and how many host syncs (``.item()`` -> ``aten::_local_scalar_dense``).

On CUDA the host returns from a kernel launch before the kernel ends, so a region's CPU
range is not its device time. ``region(..., sync=torch.cuda.synchronize)`` makes the two
agree at the price of removing overlap; the trace (``export_chrome_trace``) keeps the true
device timeline either way. On a CPU every operator is synchronous and the ranges are exact.

Numbers per category are medians over the profiled steps (robust to a burst of load on a
shared machine); ``other`` is the median of each step's unclaimed remainder.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, _ExperimentalConfig, profile, record_function

from labkit.safe_files import make_private_dir

__all__ = [
    "CATEGORIES",
    "COUNTED",
    "Breakdown",
    "region",
    "step_profiler",
    "breakdown_from_events",
    "departures",
    "largest_departure",
    "format_table",
    "export_trace",
]

PREFIX = "labkit::"
CATEGORIES = ("data", "h2d", "forward", "backward", "comm", "optimizer", "other")
STEP = "step"
# Operator names counted per step: (what, predicate on the event name). All-reduces are
# torch's (``gloo:``/``nccl:all_reduce``, one range per call) and labkit's own: those travel as
# point-to-point messages, so each public collective opens one ``labkit:all_reduce`` range
# (``labkit.collectives.common.profiled``, the outermost call of a thread only). Single colon:
# ``labkit::`` names the regions of a step, never counted.
ALL_REDUCES = ("gloo:all_reduce", "nccl:all_reduce", "labkit:all_reduce")
COUNTED: dict[str, Callable[[str], bool]] = {
    "all-reduces": lambda name: name in ALL_REDUCES,
    "host syncs": lambda name: name == "aten::_local_scalar_dense",
}


@contextmanager
def region(name: str, sync: Callable[[], Any] | None = None) -> Iterator[None]:
    """Mark one part of a step (``name`` in :data:`CATEGORIES` less ``other``, or ``"step"``).

    ``sync`` (e.g. ``torch.cuda.synchronize``) runs before the range closes, so that queued
    device work is charged to this region rather than to whichever waits for it next.
    """
    if name != STEP and (name not in CATEGORIES or name == "other"):
        raise ValueError(f"region must be 'step' or one of {CATEGORIES[:-1]}, got {name!r}")
    with record_function(PREFIX + name):
        yield
        if sync is not None:
            sync()


def step_profiler(device: torch.device | str = "cpu", **kwargs: Any) -> profile:
    """A ``torch.profiler.profile`` recording the CPU, plus CUDA kernels and memory on a GPU.

    It records *every* thread (``profile_all_threads``), threads started before it included: a
    plain profile sees only the thread that entered it (and autograd's), so the all-reduces
    that DDP's communication thread runs with labkit's collectives would go uncounted."""
    # a torch older than the option (TypeError) records the profiling thread only
    with suppress(TypeError):
        kwargs.setdefault("experimental_config", _ExperimentalConfig(profile_all_threads=True))
    activities = [ProfilerActivity.CPU]
    if torch.device(device).type == "cuda":
        activities.append(ProfilerActivity.CUDA)
        kwargs.setdefault("profile_memory", True)
    return profile(activities=activities, **kwargs)


@dataclass(frozen=True)
class Breakdown:
    """One rank's step, in median seconds per category, and counts per step."""

    rank: int
    steps: int
    seconds: dict[str, float]  # category -> median seconds per step, every CATEGORIES key
    step_seconds: float  # median step time
    samples: int  # samples this rank processes per step
    counts: dict[str, float] = field(default_factory=dict)  # COUNTED key -> per step

    @property
    def compute_seconds(self) -> float:
        """Forward + backward + optimizer: the time the device has work."""
        return sum(self.seconds[c] for c in ("forward", "backward", "optimizer"))

    @property
    def utilisation(self) -> float:
        """Compute's share of the step. Not nvidia-smi's utilisation: that counts any running
        kernel, NCCL's all-reduces included (pitfall P1)."""
        return self.compute_seconds / self.step_seconds if self.step_seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "steps": self.steps,
            "seconds": dict(self.seconds),
            "step_seconds": self.step_seconds,
            "samples": self.samples,
            "counts": dict(self.counts),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Breakdown:
        return cls(
            d["rank"],
            d["steps"],
            dict(d["seconds"]),
            d["step_seconds"],
            d["samples"],
            dict(d["counts"]),
        )


def _labkit_parent(event: Any) -> Any:
    parent = event.cpu_parent
    while parent is not None and not parent.name.startswith(PREFIX):
        parent = parent.cpu_parent
    return parent


def breakdown_from_events(events: Sequence[Any], *, rank: int, samples: int) -> Breakdown:
    """Fold a profiler's ``events()`` into a :class:`Breakdown` (times in the events are µs).

    A region counts for the step that contains it directly (nested labkit regions are charged
    to their outer region, so no time is counted twice).
    """
    steps = sorted((e for e in events if e.name == PREFIX + STEP), key=lambda e: e.time_range.start)
    if not steps:
        raise ValueError(
            "no 'labkit::step' region in the profile: wrap each step in region('step')"
        )
    per_step: list[dict[str, float]] = [dict.fromkeys(CATEGORIES, 0.0) for _ in steps]
    counts: list[dict[str, float]] = [dict.fromkeys(COUNTED, 0.0) for _ in steps]
    starts = [s.time_range.start for s in steps]
    ends = [s.time_range.end for s in steps]

    def which(t: float) -> int | None:
        for k, (s, e) in enumerate(zip(starts, ends)):
            if s <= t <= e:
                return k
        return None

    for e in events:
        k = which(e.time_range.start)
        if k is None:
            continue
        name = e.name
        if name.startswith(PREFIX) and name != PREFIX + STEP:
            parent = _labkit_parent(e)
            if parent is None or parent.name == PREFIX + STEP:
                per_step[k][name[len(PREFIX) :]] += (e.time_range.end - e.time_range.start) * 1e-6
        for what, match in COUNTED.items():
            if match(name):
                counts[k][what] += 1
    for k, s in enumerate(steps):
        claimed = sum(v for c, v in per_step[k].items() if c != "other")
        per_step[k]["other"] = max(0.0, (s.time_range.end - s.time_range.start) * 1e-6 - claimed)
    seconds = {c: statistics.median(p[c] for p in per_step) for c in CATEGORIES}
    step_s = statistics.median((e - s) * 1e-6 for s, e in zip(starts, ends))
    med_counts = {w: statistics.median(c[w] for c in counts) for w in COUNTED}
    return Breakdown(rank, len(steps), seconds, step_s, samples, med_counts)


def departures(faulty: Sequence[Breakdown], clean: Sequence[Breakdown]) -> dict[str, float]:
    """Seconds per step each category grew against a clean run: the worst rank of the faulty run
    against the best rank of the clean one(s): ``clean`` may hold the ranks of several clean
    runs.

    The worst rank, because a fault often hits one rank (a straggler) and shows on the others
    as waiting (their exposed communication grows while they wait for it). The best clean
    rank, because on a shared machine any rank's category can be inflated by a descheduled
    peer; the best is what the hardware can do.
    """
    if not faulty or not clean:
        raise ValueError("departures() needs breakdowns of both runs")
    return {
        c: max(f.seconds[c] for f in faulty) - min(b.seconds[c] for b in clean) for c in CATEGORIES
    }


def largest_departure(faulty: Sequence[Breakdown], clean: Sequence[Breakdown]) -> str:
    """The category that grew the most against the clean run."""
    d = departures(faulty, clean)
    return max(d, key=lambda c: d[c])


def format_table(breakdowns: Sequence[Breakdown], title: str = "") -> str:
    """One row per rank: milliseconds per category, the step, samples, counts, utilisation."""
    head = ["rank", *CATEGORIES, "step", "samples", *COUNTED, "util"]
    rows = [head]
    for b in breakdowns:
        rows.append(
            [str(b.rank)]
            + [f"{b.seconds[c] * 1e3:.1f}" for c in CATEGORIES]
            + [f"{b.step_seconds * 1e3:.1f}", str(b.samples)]
            + [f"{b.counts.get(w, 0):g}" for w in COUNTED]
            + [f"{b.utilisation:.0%}"]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [("  ".join(c.rjust(w) for c, w in zip(r, widths))) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    out = "\n".join(lines)
    return f"{title} (ms per step, medians)\n{out}" if title else out


def export_trace(prof: profile, path: str | Path) -> Path:
    """Write the Chrome/Perfetto trace: open it at ui.perfetto.dev or chrome://tracing."""
    path = Path(path)
    folder = make_private_dir(path.parent, 0o755, parents=True, exist_ok=True, what="trace folder")
    scratch = Path(tempfile.mkdtemp(dir=folder))  # new and 0700: torch opens its file in there
    try:
        prof.export_chrome_trace(str(scratch / path.name))
        os.replace(scratch / path.name, folder / path.name)  # replaces a link, never follows it
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return path
