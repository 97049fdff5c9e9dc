"""The node-loss drill (labkit/labs/node_loss*.py): torchrun's elastic restart after a lost node.

The end-to-end test starts real torchrun agents, one per emulated node (network namespaces as
root: CI requires them), kills a node mid-step and checks what the survivors did: detected
it, re-ran the rendezvous on fewer nodes, resharded the ZeRO-1 checkpoint, kept the global
batch by raising the accumulation, and trained on to the same losses as one process running
the new layout from the same checkpoint. It tests process life itself, so it cannot use
run_ranks' warm worlds; it is bounded, and every process it starts carries the test's tag.
"""

from __future__ import annotations

import os

import pytest

from labkit.checkpoint import load_checkpoint
from labkit.cluster import netns
from labkit.cluster import spec as cluster_spec
from labkit.labs.node_loss import NodeLossConfig, run_node_loss
from labkit.labs.node_loss_train import reference, schedule

# ------------------------------------------------------------------ no processes


def test_schedule_keeps_the_global_batch_or_refuses():
    assert [schedule(12, 2, dp) for dp in (1, 2, 3, 6)] == [6, 3, 2, 1]
    with pytest.raises(ValueError, match="global_batch=12 is not dp=4 x micro_batch=2"):
        schedule(12, 2, 4)


@pytest.mark.parametrize(
    ("changes", "nodes", "message"),
    [
        ({"kill_node": 0}, 3, "kill_node=0 must be in"),
        ({}, 1, "nodes >= 2"),
        ({"kill_step": 10}, 3, "kill_step=10 is not a step"),
        ({}, 5, "dp=5 x micro_batch=2"),  # 5 ranks cannot hold a global batch of 12
    ],
)
def test_bad_drill_fails_before_any_process(tmp_path, changes, nodes, message):
    with pytest.raises(ValueError, match=message):
        run_node_loss(NodeLossConfig(**changes), tmp_path, nodes=nodes)
    assert list(tmp_path.iterdir()) == []


def test_the_reference_sees_the_batch_it_is_given():
    # one process emulating dp 3 and dp 2: the same global batch, the same losses (up to the
    # order of the gradient sum); a smaller global batch is another run (the negative control)
    cfg = NodeLossConfig(steps=3)
    three, two = reference(cfg, dp=3), reference(cfg, dp=2)
    assert three == pytest.approx(two, abs=1e-5)
    assert max(abs(a - b) for a, b in zip(two, reference(cfg, dp=2, global_batch=8))) > 1e-3


def test_the_report_reads_a_handmade_timeline():
    from labkit.labs.node_loss_report import analyse

    cfg = NodeLossConfig(steps=4, ckpt_every=2, kill_step=3)
    ev = [{"event": "kill", "t": 10.0, "node": 2}]
    for a, dp, steps, t0 in ((0, 3, range(0, 4), 0.0), (1, 2, range(2, 4), 20.0)):
        ev.append({"event": "started", "t": t0, "attempt": a, "rank": 0, "dp": dp, "node": 0})
        ev.append({"event": "schedule", "t": t0, "attempt": a, "rank": 0, "dp": dp,
                   "micro_batch": 2, "accumulation": 6 // dp, "global_batch": 12})  # fmt: skip
        for s in steps:  # each step takes 1 s
            t = t0 + s - steps[0]
            ev.append({"event": "step_start", "t": t, "attempt": a, "rank": 0, "step": s})
            if not (a == 0 and s == 3):  # the step in progress at the kill never ends
                ev.append({"event": "step_end", "t": t + 1, "attempt": a, "rank": 0,
                           "step": s + 1, "loss": 10.0 * a + s})  # fmt: skip
    ev.append({"event": "resumed", "t": 20.0, "attempt": 1, "rank": 0, "step": 2})
    ev.append({"event": "error", "t": 12.5, "attempt": 0, "rank": 1, "node": 1,
               "error": "RuntimeError: Timed out\nmore"})  # fmt: skip
    ev.append({"event": "done", "t": 30.0, "checksum": 1.5})
    r = analyse(cfg, ev, nodes=3, mode="netns")
    assert (r.detection_s, r.restart_s) == (2.5, 7.5)  # 10 -> 12.5 -> 20 (first new step)
    assert (r.kill_step, r.resume_step, r.lost_steps) == (3, 2, 1)  # step 2 is redone
    assert r.losses == [0.0, 1.0, 12.0, 13.0]  # steps 2 and 3 from the new attempt
    assert r.goodput == pytest.approx(4 / 22)  # 4 useful 1-s steps from t=0 to t=22
    assert r.errors == ["node 1 rank 1: RuntimeError: Timed out"]
    assert r.schedules[1].endswith("dp 2 x micro-batch 2 x accumulation 3 = global batch 12")


# ------------------------------------------------------------------ the drill


@pytest.mark.timeout(150)
def test_a_node_dies_and_training_goes_on_on_the_others(tmp_path, job_tag):
    why = cluster_spec.netns_unavailable()
    if why and os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI requires the netns drill, but {why}")
    cfg = NodeLossConfig()  # 3 nodes x 1 rank, 10 steps, save every 3, node 2 dies in step 5
    # the job's own temp folder: what its processes leave in "the system temp" lands here, and
    # the suite's other lane (its own torchrun jobs) cannot add to it while this one runs
    job_tmp = tmp_path / "tmp"
    job_tmp.mkdir(mode=0o700)
    env = {"LABKIT_TEST_TAG": job_tag, "TMPDIR": str(job_tmp)}
    r = run_node_loss(cfg, tmp_path / "run", env=env, timeout=120)
    assert r.mode == ("software" if why else "netns")
    # the agents kept their workers' logs in the run's folder, not in new torchelastic_* folders
    # of the system temp that nobody removes (what torchrun does without --log-dir)
    assert list(job_tmp.glob("torchelastic_*")) == []
    assert len(list((tmp_path / "run").glob("agent*"))) == 3
    # detected by the survivors' collective: a timeout when the link is down (no FIN), else
    # a closed connection at once
    if r.mode == "netns":
        assert all("Timed out waiting 3000ms" in e for e in r.errors), r.errors
        assert 0 < r.detection_s <= cfg.collective_timeout + 1.0, r.detection_s
    # the survivors saw it (a survivor whose agent restarts it first may not get to say so)
    assert 1 <= len(r.errors) <= 2, r.errors
    assert r.schedules == [
        "attempt 0: dp 3 x micro-batch 2 x accumulation 2 = global batch 12",
        "attempt 1: dp 2 x micro-batch 2 x accumulation 3 = global batch 12",
    ]
    assert (r.kill_step, r.resume_step, r.lost_steps) == (5, 3, 2)
    assert 0 < r.restart_s < 30 and 0 < r.goodput < 1
    assert r.write_s > 0  # the saves were written in the background (AsyncSaver)
    # the curve: before the kill, one process at dp 3 from the start; after it, one process at
    # dp 2 from the same (resharded) checkpoint, bit for bit
    assert len(r.losses) == cfg.steps
    assert r.before == pytest.approx(reference(cfg, dp=3)[: r.kill_step], abs=1e-5)
    ckpt = load_checkpoint(tmp_path / "run" / "ckpt", r.resume_step)
    assert ckpt.world_size == 3  # written by the old layout
    after = r.losses[r.resume_step :]
    assert after == reference(cfg, dp=2, ckpt=ckpt)
    # negative control: a restart that lets the global batch shrink to 8 is another curve
    shrunk = reference(cfg, dp=2, ckpt=ckpt, global_batch=8)
    assert max(abs(a - b) for a, b in zip(after, shrunk)) > 1e-3
    # nothing left: the run's namespaces (netns) and, by the job_tag fixture, its processes
    if r.tag:
        assert netns.leftovers(r.tag) == []
