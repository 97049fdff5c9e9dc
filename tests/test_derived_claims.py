"""The models behind issue 35's corrected walkthrough lines, each with a negative control.

* a flat ring over nodes with one NIC per GPU spreads its crossing over the NICs (NCCL's
  channels), one NIC per node does not;
* S2's DDP overlap never hides the last bucket (the planner's rule), so 4 GPUs are not 1.00;
* the P3 ladder reaches 30B on 8 x 80 GB through recompute, where the old stage-only ladder
  said "model parallel";
* fp16 flushes at 2^-25, not 6e-8;
* S6's placement keeps dp on NVLink (only pp crosses); the wrong rank order would not;
* S6's asynchronous save stalls for its bytes over the host link, not a CPU ratio.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from labkit.collectives.cost_model import AlphaBeta, flat_ring_two_level_time
from labkit.hardware import value
from labkit.interview.estimates import (
    GPU_MEMORY,
    LINKS,
    first_fitting_stage,
    predict_ddp_step,
    resnet50_counts,
)
from labkit.interview.ladder import first_rung, memory_ladder
from labkit.interview.quiz import QUESTIONS
from labkit.interview.say import crossing_axes, fp16_flush_below, placement_words
from labkit.interview.scenarios import CKPT_100B, GPT_100B_3D
from labkit.models.gpt import GPTConfig
from labkit.planner.steptime import BUCKET_BYTES


def test_a_flat_ring_spreads_its_crossing_over_the_nodes_nics() -> None:
    intra, inter = AlphaBeta(0.0, 1 / 300e9), AlphaBeta(0.0, 1 / 25e9)
    d, n, k = 4e9, 8, 8
    one = flat_ring_two_level_time(d, n, k, intra, inter, 1)
    eight = flat_ring_two_level_time(d, n, k, intra, inter, 8)
    p = n * k
    assert one == pytest.approx(2 * (p - 1) * d / p / 25e9)  # one NIC paces every step
    assert eight == pytest.approx(2 * (p - 1) * d / p / 200e9)  # 8 channels, 8 NICs
    # more NICs than ranks per node cannot help: a node has k flows at most
    assert flat_ring_two_level_time(d, n, k, intra, inter, 16) == pytest.approx(eight)
    # a NIC faster than NVLink leaves NVLink pacing the ring
    assert flat_ring_two_level_time(d, n, k, intra, AlphaBeta(0.0, 1 / 1e12), 8) == \
        pytest.approx(2 * (p - 1) * d / p / 300e9)  # fmt: skip


def test_ddp_overlap_never_hides_the_last_bucket() -> None:
    params, flops = resnet50_counts()
    d = predict_ddp_step(params, flops, 64, 4, LINKS["NVLink"])
    buckets = math.ceil(params * 4 / BUCKET_BYTES)
    assert d.comm < 2 / 3 * d.compute  # it would all hide under the old model ...
    assert d.exposed_comm == pytest.approx(d.comm / buckets)  # ... the last bucket shows
    assert d.exposed_comm > 0
    off = predict_ddp_step(params, flops, 64, 4, LINKS["NVLink"], overlap=False)
    assert off.exposed_comm == off.comm > d.exposed_comm


def test_the_ladder_climbs_recompute_and_offload_before_model_parallelism() -> None:
    b30 = GPTConfig(vocab_size=51_200, block_size=2048, n_layer=60, n_head=52, n_embd=6656)
    rung = first_rung(b30, 8, GPU_MEMORY)
    assert rung is not None and rung.name == "ZeRO-3 + full recompute"
    assert rung.gpu_bytes <= GPU_MEMORY
    rungs = memory_ladder(b30, 8, GPU_MEMORY)
    assert [r.fits for r in rungs[:4]] == [False] * 4  # no ZeRO stage alone fits it
    # negative control: the stage-only ladder with a typed activation figure gave up
    assert first_fitting_stage(b30.num_params(), 8, 20e9) == "model parallel"
    # the quiz's ladder (A3.2) climbs the same rungs: recompute, then offload, then split
    full = next(r for r in rungs if r.name == "ZeRO-3 + full recompute").estimate.activations
    assert first_fitting_stage(b30.num_params(), 8, 20e9, recompute_bytes=full) == (
        "zero3 + recompute"
    )
    assert first_fitting_stage(70e9, 8, 20e9, recompute_bytes=4e9) == "zero3 + recompute + offload"
    assert first_fitting_stage(175e9, 8, 20e9, recompute_bytes=4e9) == "model parallel"
    a32 = QUESTIONS["A3.2"]
    for seed in range(60):
        d = a32.draw(seed)
        assert (d.expected == "model parallel") == (d.values["b"] == 175), d.values
    tiny = first_rung(b30, 8, 1e9)
    assert tiny is None  # a card nothing fits: then, and only then, split the model
    with pytest.raises(ValueError, match="gpus"):
        memory_ladder(b30, 0, GPU_MEMORY)


def test_fp16_flushes_below_two_to_the_minus_25() -> None:
    flush = fp16_flush_below()
    assert flush == 2.0**-25
    assert torch.tensor(flush * 1.01).half().item() > 0  # just above it survives
    assert flush < 6e-8 / 2  # the old line's 6e-8 is the smallest subnormal, not the cut


def test_s6_keeps_dp_on_nvlink_and_only_pp_crosses() -> None:
    c = GPT_100B_3D.choice().candidate
    cluster = GPT_100B_3D.cluster
    assert crossing_axes(cluster, c) == ["pp"]
    words = placement_words(cluster, c)
    assert f"dp={c.dp} inside a node" in words and f"pp={c.pp} across" in words
    # negative control: where dp x tp outgrows a node, the words say dp crosses
    wide = dataclasses.replace(c, dp=8, pp=2)
    assert "dp" in crossing_axes(cluster, wide) and "dp=8 across" in placement_words(cluster, wide)


def test_the_async_stall_is_the_snapshot_over_the_host_link() -> None:
    per_gpu = CKPT_100B.params * CKPT_100B.bytes_per_param / CKPT_100B.gpus
    shared = value("a100.host_link") / value("a100.gpus_per_host_uplink")  # 2 GPUs a switch
    assert CKPT_100B.async_save_seconds() == pytest.approx(per_gpu / shared)
    # negative control: a GPU alone on its uplink would snapshot in half the time
    alone = dataclasses.replace(CKPT_100B, host_sharing=1)
    assert alone.async_save_seconds() == pytest.approx(CKPT_100B.async_save_seconds() / 2)
    assert CKPT_100B.sync_save_seconds == pytest.approx(
        CKPT_100B.params * 12 / (8 * value("s6.ckpt_write_bandwidth")))
    fail = CKPT_100B.failures()  # notebook 08's budget reads the same run
    assert fail.save_seconds == CKPT_100B.sync_save_seconds
    assert fail.restart_seconds == value("s6.restart_seconds")
    assert fail.system_mtbf(CKPT_100B.gpus) == pytest.approx(CKPT_100B.mtbf_seconds)


def test_k8_reads_a_recorded_gpu_run_or_says_there_is_none(tmp_path) -> None:
    import json
    import os

    from labkit.measure.h2d import recorded_gpu_h2d

    assert recorded_gpu_h2d(tmp_path) is None  # nothing recorded: the cell predicts, labelled
    old, new = tmp_path / "gpu_h2d_h100.json", tmp_path / "gpu_h2d_h200.json"
    old.write_text(json.dumps({"device": "H100"}))
    new.write_text(json.dumps({"device": "H200"}))
    os.utime(old, (1, 1))  # the older file loses
    assert recorded_gpu_h2d(tmp_path) == {"device": "H200"}


def test_the_node_loss_fallback_drops_the_batch_it_cannot_keep() -> None:
    from labkit.interview.scenarios import GPT_100B_3D as s6
    from labkit.viz.planner import plan_3d

    assert s6.fallback_batch == s6.global_batch // s6.nodes * (s6.nodes - 1) < s6.global_batch
    # negative control: at the whole batch no layout of the nodes left exists
    assert plan_3d(s6.cfg, s6.cluster.with_nodes(s6.nodes - 1), s6.global_batch) == []
    assert s6.fallback().candidate.dp % (s6.nodes - 1) == 0
    # the quiz says the same as the scenario (13 §K11, 17 § 8): the batch drops
    answer = QUESTIONS["S6.6"].draw(0).expected
    assert f"keeps {s6.global_batch}" in answer and f"drops to {s6.fallback_batch}" in answer
    assert "by accumulation" not in answer


def test_k9_weak_and_strong_at_512_gpus_are_different_runs() -> None:
    import re
    from dataclasses import replace
    from pathlib import Path

    import nbformat

    from labkit.models.gpt import preset
    from labkit.planner import CLUSTERS, predict
    from labkit.planner.space import Candidate

    walk = Path(__file__).resolve().parent.parent / "notebooks" / "13_interview_walkthroughs.ipynb"
    k9 = next(c.source for c in nbformat.read(walk, as_version=4).cells
              if c.cell_type == "code" and "STRONG_BATCH = " in c.source)  # fmt: skip
    strong = int(re.search(r"STRONG_BATCH = (\d+)", k9).group(1))  # type: ignore[union-attr]
    weak = int(re.search(r"WEAK_PER_GPU = (\d+)", k9).group(1))  # type: ignore[union-attr]
    cl = replace(CLUSTERS["dgx-a100-80gb"], nodes=64, gpus_per_node=8)
    cand = Candidate(dp=512, tp=1, pp=1, micro_batch=1, zero=0, recompute="none")

    def step(batch: int) -> float:
        return predict(preset("gpt2-1.3b"), cl, batch, cand).step_seconds

    # negative control: at one sequence per GPU, weak at 512 GPUs IS strong's run
    assert step(512 * 1) == step(strong)
    assert 512 * weak != strong and step(512 * weak) != step(strong)


def test_the_ladder_drops_a_recompute_rung_that_stores_nothing_less() -> None:
    from labkit.interview.ladder import offload_seconds
    from labkit.memory.estimate import TrainSetup, estimate

    b30 = GPTConfig(vocab_size=51_200, block_size=2048, n_layer=60, n_head=52, n_embd=6656)
    names = [r.name for r in memory_ladder(b30, 8, GPU_MEMORY)]
    assert "ZeRO-3 + selective recompute" not in names and "ZeRO-3 + full recompute" in names
    # why: under SDPA the selective rung keeps no recompute's activations and adds workspace
    none, sel = (estimate(b30, TrainSetup(dp=8, zero="zero3", recompute=r))
                 for r in ("none", "selective"))  # fmt: skip
    assert sel.activations == none.activations and sel.total > none.total
    # offload's price in time: 16-bit gradients out and parameters back, over the host link
    link = value("a100.host_link")
    assert offload_seconds(64e9, 8, link) == pytest.approx(2 * 2 * 8e9 / link)
    assert offload_seconds(64e9, 16, link) == pytest.approx(offload_seconds(64e9, 8, link) / 2)
