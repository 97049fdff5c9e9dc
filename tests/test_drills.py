"""Diagnosis drills: each injected fault shows as its own category in the step breakdown.

One launch on 2 gloo ranks runs a clean run and every fault a CPU can show; every test reads
that one set of breakdowns.
"""

from __future__ import annotations

import json

import pytest
import torch

from labkit.checks.core import CheckFailed
from labkit.checks.drills import check_diagnosis, normalise_fault
from labkit.labs.drills import (
    CUDA_ONLY,
    FAULTS,
    SIGNATURE,
    UNEVEN_FACTOR,
    DrillConfig,
    Mystery,
    available_faults,
    evidence,
    run_drills,
)
from labkit.labs.drills_faults import FAULT_INFO, FAULTS_PATH, load_faults
from labkit.profiling.breakdown import CATEGORIES, departures, format_table, largest_departure
from tests.ranks import run_ranks

# Compares measured durations: ./run-tests runs it alone, after the concurrent phase.
pytestmark = pytest.mark.timing

CPU_FAULTS = available_faults("cpu")
TIMED = [f for f in CPU_FAULTS if f != "host_sync"]  # host_sync costs ~nothing on a CPU


@pytest.fixture(scope="module")
def runs():
    # clean runs first and last: the baseline is the best of them (load comes and goes)
    cfgs = [DrillConfig()] + [DrillConfig(fault=f) for f in CPU_FAULTS] + [DrillConfig()]
    out = run_drills(cfgs, 2, runner=run_ranks, timeout=300)
    return {None: out[0], "clean": out[0] + out[-1], **dict(zip(CPU_FAULTS, out[1:-1]))}


def test_cpu_faults_exclude_only_the_cuda_ones():
    assert set(FAULTS) - set(CPU_FAULTS) == CUDA_ONLY
    if torch.cuda.is_available():
        assert available_faults("cuda") == FAULTS


@pytest.mark.parametrize("fault", TIMED)
def test_each_fault_is_the_largest_departure_from_a_clean_run(runs, fault):
    faulty, clean = runs[fault], runs["clean"]
    d = {k: round(v * 1e3, 1) for k, v in departures(faulty, clean).items()}
    assert largest_departure(faulty, clean) == SIGNATURE[fault][0], (
        f"{fault}: departures (ms) {d}\n{format_table(faulty, fault)}\n"
        + format_table(clean, "clean")
    )


def test_counts_name_host_syncs_and_tiny_buckets(runs):
    clean = runs[None]
    for b, b0 in zip(runs["host_sync"], clean):
        assert b.counts["host syncs"] == b0.counts["host syncs"] + 1  # one .item() per step
    assert all(b.counts["all-reduces"] == 1 for b in clean)  # the whole gradient at once
    # 5.3 MB of gradients in 16 KB messages: hundreds of latency-bound all-reduces
    assert all(b.counts["all-reduces"] >= 300 for b in runs["tiny_buckets"])


def test_samples_tell_uneven_batches_from_a_straggler(runs):
    assert [b.samples for b in runs["uneven_batches"]] == [64, 384]
    assert [b.samples for b in runs["straggler"]] == [64, 64]
    assert "rank 1" in evidence("straggler", runs["straggler"], runs[None])
    assert "rank 1 computed" in evidence("uneven_batches", runs["uneven_batches"], runs[None])


def test_breakdown_adds_up_to_the_step(runs):
    for b in runs[None]:
        assert b.steps == DrillConfig().steps
        assert sum(b.seconds.values()) == pytest.approx(b.step_seconds, rel=0.25)


def test_check_accepts_the_right_fault_and_rejects_a_wrong_one(runs, capsys):
    m = Mystery(runs["tiny_buckets"], runs[None], "tiny_buckets", DrillConfig(fault="tiny_buckets"))
    assert "hidden" in repr(m)
    check_diagnosis(m, "Tiny buckets")
    assert "PASSED" in capsys.readouterr().out
    with pytest.raises(CheckFailed, match="all-reduces"):  # names the number that tells
        check_diagnosis(m, "starved_loader")
    with pytest.raises(ValueError, match="not one of the faults"):
        normalise_fault("slow network")


def test_bad_config_is_rejected_before_any_process_starts():
    with pytest.raises(ValueError, match="unknown fault"):
        DrillConfig(fault="cosmic_rays")
    with pytest.raises(ValueError, match="world_size >= 2"):
        run_drills([DrillConfig()], 1)
    with pytest.raises(ValueError, match="need CUDA"):
        run_drills([DrillConfig(fault="unpinned_copy")], 2, backend="gloo")


def test_the_fault_table_is_a_data_file_with_every_field(tmp_path):
    # the table moved out of drills.py into drills_faults.json; the code reads it
    assert FAULTS_PATH.suffix == ".json" and load_faults() == FAULT_INFO
    assert FAULTS[:2] == ("starved_loader", "host_sync") and CUDA_ONLY == {"unpinned_copy"}
    for name, f in FAULT_INFO.items():
        assert f.injected and f.fix and SIGNATURE[name] == (f.shows_up_in, f.fix), name
        assert f.shows_up_in in (*CATEGORIES, "host syncs"), (name, f.shows_up_in)
    assert f"{UNEVEN_FACTOR}x" in FAULT_INFO["uneven_batches"].injected  # one number, one place
    # negative control: a fault without its fix is refused, naming it
    raw = json.loads(FAULTS_PATH.read_text())
    del raw["faults"][2]["fix"]
    broken = tmp_path / "faults.json"
    broken.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="tiny_buckets.*fix"):
        load_faults(broken)
