"""What the node-loss drill measured, read from its events, and the arithmetic of checkpoints.

:func:`analyse` turns the events every rank (and the drill, for the kill) appended to
``events.jsonl`` into a :class:`DrillReport`. Times are ``time.monotonic()``: one clock for
every process of the machine, namespaces included. Definitions:

* **detection** = first survivor's error - the kill (the collective timeout, counted from when
  that survivor entered the collective, which was before the kill: so at most the timeout);
* **restart** = first step started by the new workers - that error: agent notices the failed
  worker, rendezvous (dead heartbeat expiry + last call), fresh workers import torch, init,
  load and reshard the checkpoint;
* **lost steps** = the step in progress at the kill - the step resumed from (steps redone;
  the step in progress was partly done too);
* **goodput** = time in steps that count / time from the first step's start to the last's end
  (saves, redone steps, detection and restart are the rest).

How often to checkpoint (Young 1974, Daly 2006) is the planner's arithmetic:
:func:`labkit.planner.budget.young_daly_interval` and ``failure_overhead``.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from labkit.labs.node_loss_train import NodeLossConfig

__all__ = ["DrillReport", "analyse"]


@dataclass
class DrillReport:
    mode: str
    nodes: int
    detection_s: float
    restart_s: float
    kill_step: int
    resume_step: int
    lost_steps: int
    goodput: float
    step_s: float  # median step time, rank 0
    save_s: float  # median stall of the loop per save (async: the snapshot; sync: all of it)
    write_s: float  # median background write of an async save (0 for sync saves)
    losses: list[float]  # the run's curve, one per step, after the failure from the new layout
    before: list[float]  # attempt 0's losses (up to the kill)
    schedules: list[str]
    errors: list[str]  # what each survivor saw, first line
    agent_lines: list[str]  # what the surviving torchrun agents logged about it
    checksum: float
    timeline: list[tuple[float, str]] = field(default_factory=list)
    tag: str = ""  # the netns run's tag ("" in software mode): what must be gone afterwards

    @property
    def lost_s(self) -> float:
        return self.detection_s + self.restart_s + self.lost_steps * self.step_s


# what torchrun's agent (LOGLEVEL=INFO) says about the failure and the new round
_AGENT_MARKS = ("failed (exitcode", "Worker group FAILED", "Rendezvous'ing", "group_world_size=")


def analyse(cfg: NodeLossConfig, events: list[dict[str, Any]], nodes: int, mode: str,
            agent_logs: dict[int, str] | None = None) -> DrillReport:  # fmt: skip
    """The report of one drill from its events (pure: tested on a handmade list too)."""

    def of(kind: str, **match: Any) -> list[dict[str, Any]]:
        return [e for e in events
                if e["event"] == kind and all(e.get(k) == v for k, v in match.items())]  # fmt: skip

    (kill,) = of("kill")
    errors = sorted(of("error", attempt=0), key=lambda e: e["t"])
    if not errors:
        raise ValueError("no survivor reported an error after the kill: nothing detected it")
    final_attempt = max(e["attempt"] for e in of("step_start"))
    if final_attempt == 0:
        raise ValueError("training never restarted after the kill")
    first_new = min(e["t"] for e in of("step_start", attempt=final_attempt))
    (resumed, *_) = of("resumed", attempt=final_attempt, rank=0)
    resume_step = int(resumed["step"])
    kill_step = max(e["step"] for e in of("step_start", attempt=0))
    before = {e["step"]: e["loss"] for e in of("step_end", attempt=0, rank=0)}
    after = {e["step"]: e["loss"] for e in of("step_end", attempt=final_attempt, rank=0)}
    curve = {**before, **after}
    losses = [curve[s] for s in range(1, cfg.steps + 1)]
    starts = {(e["attempt"], e["step"]): e["t"] for e in of("step_start", rank=0)}
    ends = {(e["attempt"], e["step"] - 1): e["t"] for e in of("step_end", rank=0)}
    durations = {k: ends[k] - starts[k] for k in ends if k in starts}
    useful = sum(
        d
        for (a, s), d in durations.items()
        if (a == final_attempt and s >= resume_step) or (a == 0 and s < resume_step)
    )
    wall = max(ends.values()) - min(starts.values())
    saves = [e["save_s"] for e in of("saved", rank=0)]
    writes = [e["previous_write_s"] for e in of("saved", rank=0) if e["previous_write_s"] > 0]
    schedules = [f"attempt {e['attempt']}: dp {e['dp']} x micro-batch {e['micro_batch']} x "
                 f"accumulation {e['accumulation']} = global batch {e['global_batch']}"
                 for e in of("schedule", rank=0)]  # fmt: skip
    survivors_said = [f"node {e['node']} rank {e['rank']}: {e['error'].splitlines()[0][:160]}"
                      for e in errors]  # fmt: skip
    lines = [f"node {n}: {ln.rsplit('] ', 1)[-1].strip()[:120]}"
             for n, text in sorted((agent_logs or {}).items()) if n != cfg.kill_node
             for ln in text.splitlines() if any(m in ln for m in _AGENT_MARKS)]  # fmt: skip
    started = min(e["t"] for e in of("started", attempt=final_attempt))
    timeline = [
        (kill["t"], "kill"),
        (errors[0]["t"], "a survivor's collective fails"),
        (started, "new workers up (rendezvous, start)"),
        (first_new, "first new step (checkpoint loaded)"),
    ]
    (done,) = of("done")
    return DrillReport(
        mode=mode, nodes=nodes, detection_s=errors[0]["t"] - kill["t"],
        restart_s=first_new - errors[0]["t"], kill_step=kill_step, resume_step=resume_step,
        lost_steps=kill_step - resume_step, goodput=useful / wall,
        step_s=statistics.median(durations.values()),
        save_s=statistics.median(saves) if saves else float("nan"),
        write_s=statistics.median(writes) if writes else 0.0,
        losses=losses, before=[before[s] for s in sorted(before)], schedules=schedules,
        errors=survivors_said, agent_lines=lines, checksum=done["checksum"],
        timeline=[(t - kill["t"], what) for t, what in timeline],
    )  # fmt: skip
