"""The whole-run budget: tokens, training FLOPs, days, GPU-hours, cost, and what failures take.

Pure arithmetic a reader redoes by hand:

* **tokens** ``D``: given, or compute-optimal by Chinchilla (Hoffmann et al. 2022, "Training
  Compute-Optimal Large Language Models": about 20 tokens per parameter);
* **training FLOPs**: ``6 N D`` for the model (forward 2ND, backward 4ND; Kaplan et al. 2020),
  plus what recompute adds: full recompute one more forward of every layer (``2 N D`` and the
  attention scores' ``4 s h L`` per token), selective recompute the scores alone;
* **time**: ``D / tokens_per_step`` steps at the planner's predicted step time, in days;
  **GPU-hours** = days x 24 x GPUs; **cost** = GPU-hours x a stated price per GPU-hour;
* **failures** (Young 1974, Daly 2006): with a system mean time between failures ``M`` (a
  GPU's or a node's MTBF divided by their count: failures of independent parts add their
  rates), checkpoints every ``tau`` seconds that each cost ``delta`` to save, and a restart
  that costs ``R``, each failure loses on average half an interval of work plus the restart,
  so the run's time grows by the fraction::

      overhead(tau) = delta / tau + (tau / 2 + R) / M

  (first order, valid for ``tau + delta << M``). Its minimum is at Young's interval
  ``tau* = sqrt(2 delta M)`` (d/dtau: ``-delta/tau^2 + 1/(2M) = 0``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "CHINCHILLA_TOKENS_PER_PARAM", "Failures", "RunBudget", "chinchilla_tokens",
    "failure_overhead", "run_budget", "training_flops", "young_daly_interval",
]  # fmt: skip

CHINCHILLA_TOKENS_PER_PARAM = 20.0
DAY, HOUR = 86_400.0, 3_600.0


def chinchilla_tokens(params: float, per_param: float = CHINCHILLA_TOKENS_PER_PARAM) -> float:
    """Compute-optimal training tokens, about 20 per parameter (Hoffmann et al. 2022)."""
    if params <= 0 or per_param <= 0:
        raise ValueError(f"need params > 0 and per_param > 0, got {params}, {per_param}")
    return params * per_param


def training_flops(
    params: float, tokens: float, recompute: str = "none", *,
    layers: int = 0, hidden: int = 0, seq: int = 0,
) -> dict[str, float]:  # fmt: skip
    """``{"model": 6ND, "recompute": extra, "total": sum}``. Full recompute: ``2ND`` plus the
    scores' ``4 s h L D`` when the shape is given; selective: the scores alone (needs it)."""
    if params <= 0 or tokens <= 0:
        raise ValueError(f"need params > 0 and tokens > 0, got {params}, {tokens}")
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute={recompute!r}: expected 'none', 'selective' or 'full'")
    scores = 4 * seq * hidden * layers * tokens  # QK^T and AV forward: 2 x 2 s h per layer
    if recompute == "selective" and not scores:
        raise ValueError(
            "selective recompute reruns the attention scores: give layers, hidden and seq "
            f"(got layers={layers}, hidden={hidden}, seq={seq})"
        )
    model = 6 * params * tokens
    extra = {"none": 0.0, "selective": scores, "full": 2 * params * tokens + scores}[recompute]
    return {"model": model, "recompute": extra, "total": model + extra}


def young_daly_interval(save_seconds: float, mtbf_seconds: float) -> float:
    """The checkpoint interval that minimises :func:`failure_overhead`: ``sqrt(2 delta M)``."""
    if save_seconds <= 0 or mtbf_seconds <= 0:
        raise ValueError(f"need save and MTBF > 0 s, got {save_seconds}, {mtbf_seconds}")
    return math.sqrt(2 * save_seconds * mtbf_seconds)


def failure_overhead(
    interval: float, save_seconds: float, mtbf_seconds: float, restart_seconds: float = 0.0
) -> float:
    """Extra run time per unit of work: ``delta/tau + (tau/2 + R)/M`` (module docstring).
    Refuses intervals the first-order model cannot price (``tau + delta >= M``)."""
    if interval <= 0 or save_seconds < 0 or mtbf_seconds <= 0 or restart_seconds < 0:
        raise ValueError(
            f"need interval > 0, save >= 0, MTBF > 0, restart >= 0; got {interval}, "
            f"{save_seconds}, {mtbf_seconds}, {restart_seconds}"
        )
    if interval + save_seconds >= mtbf_seconds:
        raise ValueError(
            f"checkpoint interval {interval:.0f} s + save {save_seconds:.0f} s is not below the "
            f"MTBF {mtbf_seconds:.0f} s: the run would rarely reach a checkpoint"
        )
    return save_seconds / interval + (interval / 2 + restart_seconds) / mtbf_seconds


@dataclass(frozen=True)
class Failures:
    """A failure rate and a checkpoint policy: ``mtbf_hours`` of one GPU (``per="gpu"``) or one
    node of ``gpus_per_node``; ``save_seconds`` a checkpoint costs, ``restart_seconds`` a
    restart; ``interval_seconds`` between checkpoints (None: Young/Daly's optimum)."""

    mtbf_hours: float
    per: str = "gpu"
    gpus_per_node: int = 8
    save_seconds: float = 60.0
    restart_seconds: float = 600.0
    interval_seconds: float | None = None

    def system_mtbf(self, gpus: int) -> float:
        """Seconds between failures of the whole job: the part's MTBF over the part count."""
        if self.per not in ("gpu", "node"):
            raise ValueError(f"per={self.per!r}: expected 'gpu' or 'node'")
        parts = gpus if self.per == "gpu" else math.ceil(gpus / self.gpus_per_node)
        return self.mtbf_hours * HOUR / parts


@dataclass(frozen=True)
class RunBudget:
    """One run's budget (module docstring); times in seconds unless named in days/hours."""

    params: float
    tokens: float
    flops: dict[str, float]
    steps: float
    step_seconds: float
    gpus: int
    compute_days: float  # steps x step time, no failures
    failure_overhead: float  # fraction of extra time (0: no failure model)
    checkpoint_interval: float  # seconds (0: no failure model)
    system_mtbf: float  # seconds (inf: no failure model)
    price_per_gpu_hour: float

    @property
    def days(self) -> float:
        return self.compute_days * (1 + self.failure_overhead)

    @property
    def gpu_hours(self) -> float:
        return self.days * 24 * self.gpus

    @property
    def cost(self) -> float:
        return self.gpu_hours * self.price_per_gpu_hour

    @property
    def achieved_flops_per_gpu(self) -> float:
        """Model FLOPs (6ND) over the failure-free run time and GPUs: MFU x peak."""
        return self.flops["model"] / (self.compute_days * DAY * self.gpus)


def run_budget(
    *, params: float, gpus: int, step_seconds: float, tokens_per_step: float,
    price_per_gpu_hour: float, tokens: float | None = None, recompute: str = "none",
    layers: int = 0, hidden: int = 0, seq: int = 0, failures: Failures | None = None,
) -> RunBudget:  # fmt: skip
    """The budget of training ``params`` on ``gpus`` for ``tokens`` (None: Chinchilla's),
    ``tokens_per_step`` a step at the predicted ``step_seconds``."""
    if gpus < 1 or step_seconds <= 0 or tokens_per_step <= 0 or price_per_gpu_hour < 0:
        raise ValueError(
            f"need gpus >= 1, step_seconds > 0, tokens_per_step > 0, price >= 0; got {gpus}, "
            f"{step_seconds}, {tokens_per_step}, {price_per_gpu_hour}"
        )
    d = chinchilla_tokens(params) if tokens is None else tokens
    flops = training_flops(params, d, recompute, layers=layers, hidden=hidden, seq=seq)
    steps = d / tokens_per_step
    overhead, interval, mtbf = 0.0, 0.0, math.inf
    if failures is not None:
        mtbf = failures.system_mtbf(gpus)
        interval = failures.interval_seconds or young_daly_interval(failures.save_seconds, mtbf)
        overhead = failure_overhead(interval, failures.save_seconds, mtbf, failures.restart_seconds)
    return RunBudget(
        params=params, tokens=d, flops=flops, steps=steps, step_seconds=step_seconds,
        gpus=gpus, compute_days=steps * step_seconds / DAY, failure_overhead=overhead,
        checkpoint_interval=interval, system_mtbf=mtbf, price_per_gpu_hour=price_per_gpu_hour,
    )  # fmt: skip
