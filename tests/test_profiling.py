"""The step breakdown reads what the profiler recorded; derived numbers follow their formulas."""

from __future__ import annotations

import json
import time

import pytest
import torch

from labkit.profiling.breakdown import (
    CATEGORIES,
    Breakdown,
    breakdown_from_events,
    departures,
    export_trace,
    format_table,
    largest_departure,
    region,
    step_profiler,
)
from labkit.profiling.derived import (
    cost_per_million,
    count_step_flops,
    flop_efficiency,
    gpu_hours_per_million,
    samples_per_second,
    time_to_accuracy,
)

# Compares measured durations: ./run-tests runs it alone, after the concurrent phase.
pytestmark = pytest.mark.timing


def _profiled(steps: int, data_s: float, comm_s: float, syncs: int):
    model = torch.nn.Linear(8, 4)
    with step_profiler() as prof:
        for _ in range(steps):
            with region("step"):
                with region("data"):
                    time.sleep(data_s)
                with region("forward"):
                    loss = model(torch.randn(2, 8)).sum()
                    with region("comm"):  # nested: charged to forward, never twice
                        time.sleep(comm_s)
                    for _ in range(syncs):
                        loss.item()
                with region("backward"):
                    loss.backward()
                time.sleep(data_s / 2)  # unclaimed: lands in "other"
    return prof


def test_regions_fold_into_categories_and_counts(tmp_path):
    prof = _profiled(steps=3, data_s=0.03, comm_s=0.02, syncs=2)
    b = breakdown_from_events(prof.events(), rank=0, samples=2)
    assert b.steps == 3 and set(b.seconds) == set(CATEGORIES)
    assert b.seconds["data"] == pytest.approx(0.03, abs=0.02)
    assert b.seconds["data"] >= 0.03  # a sleep never ends early
    assert b.seconds["forward"] >= 0.02 and b.seconds["comm"] == 0.0  # nested region: outer wins
    assert b.seconds["other"] >= 0.015
    assert b.counts["host syncs"] == 2 and b.counts["all-reduces"] == 0
    assert sum(b.seconds.values()) == pytest.approx(b.step_seconds, rel=0.2)
    assert Breakdown.from_dict(b.as_dict()) == b
    assert "host syncs" in format_table([b], "t")
    trace = json.loads(export_trace(prof, tmp_path / "t" / "rank0.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"labkit::step", "labkit::data", "labkit::forward"} <= names


def test_largest_departure_finds_the_grown_category():
    fast = breakdown_from_events(_profiled(2, 0.0, 0.0, 0).events(), rank=0, samples=2)
    slow = breakdown_from_events(_profiled(2, 0.05, 0.0, 0).events(), rank=0, samples=2)
    assert largest_departure([slow], [fast]) == "data"
    assert (
        departures([fast], [slow])["data"] < 0
    )  # the negative control: the clean run is not "faulty"


def test_region_names_and_missing_steps_are_errors():
    with pytest.raises(ValueError, match="region must be"), region("fwd"):
        pass
    with step_profiler() as prof, region("forward"):
        torch.ones(1) + 1
    with pytest.raises(ValueError, match="no 'labkit::step'"):
        breakdown_from_events(prof.events(), rank=0, samples=1)


def test_flop_counter_counts_a_linear_layer_forward_and_backward():
    layer = torch.nn.Linear(64, 32, bias=False)
    x = torch.randn(16, 64, requires_grad=True)

    def step():
        layer(x).sum().backward()

    # forward 2*B*in*out; backward twice that (grad of input and of weight)
    assert count_step_flops(step) == 3 * 2 * 16 * 64 * 32
    assert flop_efficiency(1e12, 2.0, 1e12) == 0.5


def test_cost_metrics_follow_their_formulas():
    sps = samples_per_second(256, 0.5)
    assert sps == 512
    assert gpu_hours_per_million(sps, 4) == pytest.approx(4 * 1e6 / 512 / 3600)
    assert cost_per_million(sps, 4, 2.0) == pytest.approx(2 * gpu_hours_per_million(sps, 4))
    history = [(1.0, 0.5), (2.0, 0.91), (3.0, 0.95)]
    assert time_to_accuracy(history, 0.9) == 2.0 and time_to_accuracy(history, 0.99) is None
    with pytest.raises(ValueError):
        samples_per_second(0, 1.0)
