"""The planner's memory is labkit.memory.estimate's (one model, checked against the H200), and
its search space: ZeRO-1/2/3, HSDP, offload, the precision of the bytes on the wire, risky
fits, and why nothing fits. Pure arithmetic, no processes."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from labkit.memory.estimate import GIB, estimate
from labkit.memory.model import MIXED_ADAM, Precision
from labkit.models import preset
from labkit.planner import CLUSTERS, Candidate, Cluster, enumerate_candidates, plan, predict
from labkit.planner.links import group_links
from labkit.planner.memory import MEGATRON_MIXED, shard_size
from labkit.planner.offload import offload_traffic
from labkit.planner.space import RISKY_MARGIN, wire_bytes

GPT13 = preset("gpt2-1.3b")
H200 = Cluster(nodes=1, gpus_per_node=1, memory_bytes=141e9, peak_flops=989e12,
               intra_bandwidth=450e9, inter_bandwidth=50e9, name="H200")  # fmt: skip
MEASURED = json.loads((Path(__file__).parent.parent / "docs/gpu_check_h200.json").read_text())


@pytest.mark.parametrize(("run", "mb", "rc"), [("a_none", 24, "none"), ("a_full", 32, "full")])
def test_planner_and_estimate_are_one_model_and_match_the_h200(run, mb, rc) -> None:
    # docs/gpu_check_h200.json: the 1.3B step on an H200, SDPA, bf16 (2 + 2 + 12 B/param)
    assert MEASURED[run]["micro_batch"] == mb and MEASURED[run]["recompute"] == rc
    cand = Candidate(dp=1, tp=1, pp=1, micro_batch=mb, zero=0, recompute=rc)
    pred = predict(GPT13, H200, mb, cand, precision=MIXED_ADAM)
    est = estimate(GPT13, micro_batch=mb, recompute=rc)
    parts = est.by_category()
    for ours, theirs in [
        ("parameters", "parameters"),
        ("gradients", "gradients"),
        ("optimizer", "optimizer_state"),
        ("activations", "activations"),
    ]:
        assert pred.memory[ours] == parts[theirs], ours  # fmt: skip
    assert pred.peak_allocated == pytest.approx(est.peak_allocated, rel=1e-12)  # allowance apart
    measured = MEASURED[run]["max_memory_allocated_GiB"] * GIB
    assert abs(pred.peak_allocated / measured - 1) < 0.07, pred.peak_allocated / GIB
    assert pred.fits and not pred.risky
    # negative control: an eager (explicit softmax) kernel adds exactly the 5as^2b score term
    # per layer (16-bit scores, their dropout mask and the dropped-out copy) and, without
    # recompute, does not fit on the card that ran this step: the old planner's mistake
    eager = predict(GPT13, H200, mb, cand, precision=MIXED_ADAM, attention="explicit")
    s, a, L = GPT13.block_size, GPT13.n_head, GPT13.n_layer
    extra = eager.memory["activations"] - pred.memory["activations"]
    assert extra == (L * 5 * a * s * s * mb if rc == "none" else 0)
    assert eager.fits == (rc == "full")
    with pytest.raises(ValueError, match="attention='flash'"):
        predict(GPT13, H200, mb, cand, attention="flash")


def _tight(memory_gb: float) -> Cluster:
    return replace(CLUSTERS["dgx-h100-80gb"], memory_bytes=memory_gb * 1e9)


def test_zero3_fits_where_zero1_does_not_and_each_stage_shards_what_it_says() -> None:
    cl = _tight(6)  # 8 GPUs of 6 GB: 1.3B at 18 B/param is 23.7 GB of model states
    preds = {c.zero: predict(GPT13, cl, 8, c)
             for c in (Candidate(8, 1, 1, 1, z, "full") for z in (0, 1, 2, 3))}  # fmt: skip
    assert [preds[z].fits for z in range(4)] == [False, False, False, True]
    psi = preds[0].memory["parameters"] / 2
    assert preds[1].memory["optimizer"] == 12 * psi / 8 and preds[1].memory["gradients"] == 4 * psi
    assert preds[2].memory["gradients"] == 4 * psi / 8
    assert preds[3].memory["parameters"] == 2 * psi / 8
    ranked = plan(GPT13, cl, 8, micro_batches=(1,), zero_stages=(1, 3))
    pure_dp = [r for r in ranked if r.candidate.tp == r.candidate.pp == 1]
    assert [(r.candidate.zero, r.fits) for r in pure_dp] == [(3, True), (1, False)]


def test_hsdp_shards_in_the_node_and_crosses_nodes_with_the_replicas_only() -> None:
    cl = CLUSTERS["dgx-a100-80gb"].with_nodes(4)  # 32 GPUs, dp=32: 8 dp ranks a node
    fsdp = Candidate(32, 1, 1, 1, 3, "full")
    hsdp = replace(fsdp, shard_group="node")
    assert shard_size(fsdp, cl) == 32 and shard_size(hsdp, cl) == 8
    pf, ph = predict(GPT13, cl, 64, fsdp), predict(GPT13, cl, 64, hsdp)
    assert ph.memory["optimizer"] == pytest.approx(pf.memory["optimizer"] * 4)  # 8-way, not 32
    psi, m = pf.memory["parameters"] * 32 / 2, 2
    wf = wire_bytes(fsdp, psi, MEGATRON_MIXED, 32, m)
    wh = wire_bytes(hsdp, psi, MEGATRON_MIXED, 8, m)
    assert set(wf) == {"grad_reduce_scatter", "param_all_gather"}
    assert wh["grad_all_reduce_replicas"] == (psi * 4 / 8, 4, m)  # fp32 shard, 4 replicas
    assert wh["param_all_gather"] == (2 * psi, 8, 2 * m)  # forward + backward, every micro-batch
    # where the groups sit: the shard group (8 consecutive ranks) inside a node, the replicas
    # one per node; so the bytes leaving a GPU for other nodes are the replicas' ring only
    assert group_links(cl, 8, 1, 1)["dp"].nodes == 1
    crossing = 2 * (4 - 1) / 4 * psi * 4 / 8
    flat = 2 * (32 - 1) / 32 * psi * 4  # flat ZeRO-3: its reduce-scatter alone crosses
    assert crossing < flat / 7
    # enumeration: HSDP only where it differs (ZeRO >= 1, dp spanning whole nodes)
    cands = enumerate_candidates(GPT13, cl, 64, micro_batches=(1,), zero_stages=(0, 3),
                                 shard_groups=("dp", "node"))  # fmt: skip
    nodes = [c for c in cands if c.shard_group == "node"]
    assert nodes and all(c.zero == 3 and c.dp * c.tp > 8 for c in nodes)
    # ZeRO over one rank shards nothing: at dp = 1 only DDP's layout is listed, once
    assert {c.zero for c in cands if c.dp == 1} == {0}
    alone = enumerate_candidates(GPT13, cl, 64, micro_batches=(1,), zero_stages=(3,))
    assert any(c.dp == 1 for c in alone)  # unless ZeRO-0 is not searched at all
    with pytest.raises(ValueError, match="HSDP.*zero=0"):
        Candidate(32, 1, 1, 1, 0, shard_group="node")


def test_precision_policy_sets_the_bytes_on_the_wire() -> None:
    psi = 1e9
    ddp = Candidate(8, 1, 1, 1, 0)
    assert MEGATRON_MIXED.wire_bytes == 4  # Megatron reduces its fp32 main_grad in fp32
    assert wire_bytes(ddp, psi, MEGATRON_MIXED, 8)["grad_all_reduce"] == (4e9, 8, 1)
    half = Precision(2, 4, 12, reduce_bytes=2)
    assert wire_bytes(ddp, psi, half, 8)["grad_all_reduce"] == (2e9, 8, 1)
    assert MIXED_ADAM.wire_bytes == 2
    z2 = wire_bytes(Candidate(8, 1, 1, 1, 2), psi, MEGATRON_MIXED, 8, micro_batches=4)
    assert z2["grad_reduce_scatter"] == (4e9, 8, 4) and z2["param_all_gather"] == (2e9, 8, 1)
    with pytest.raises(ValueError, match="reduce_bytes must be 2, 4 or None, got 3"):
        Precision(2, 4, 12, reduce_bytes=3)


def test_offload_moves_states_to_the_host_and_names_the_pcie_bytes() -> None:
    cl = _tight(80)
    base = Candidate(8, 1, 1, 4, 2, "full")
    on = predict(GPT13, cl, 32, base)
    opt = predict(GPT13, cl, 32, replace(base, offload="optimizer"))
    both = predict(GPT13, cl, 32, replace(base, offload="optimizer+grads"))
    assert opt.memory["optimizer"] == 0 and opt.host_bytes == on.memory["optimizer"] > 0
    assert both.memory["gradients"] == 0
    assert both.host_bytes == on.memory["optimizer"] + on.memory["gradients"]
    assert both.memory_total < opt.memory_total < on.memory_total
    psi = 1e9
    got = offload_traffic(replace(base, offload="optimizer"), psi, MEGATRON_MIXED, 8)
    assert got == {"pcie_bytes": psi / 8 * (4 + 2), "cpu_step_params": psi / 8}
    assert offload_traffic(base, psi, MEGATRON_MIXED, 8)["pcie_bytes"] == 0


def test_a_fit_within_five_percent_is_risky() -> None:
    cand = Candidate(8, 1, 1, 2, 1, "selective")
    total = predict(GPT13, CLUSTERS["dgx-h100-80gb"], 16, cand).memory_total
    for slack, fits, risky in [(1.03, True, True), (1.10, True, False), (0.99, False, False)]:
        pred = predict(GPT13, _tight(total * slack / 1e9), 16, cand)
        assert (pred.fits, pred.risky) == (fits, risky), slack
        assert pred.row()["risky"] == risky
    assert RISKY_MARGIN == 0.05


def test_the_search_space_has_every_axis() -> None:
    cl = CLUSTERS["dgx-a100-80gb"].with_nodes(2)
    space: dict[str, Any] = dict(
        micro_batches=(1, 2), zero_stages=(0, 1, 2, 3), recompute=("none", "selective", "full"),
        virtual=(1, 2), sp=(False, True), shard_groups=("dp", "node"),
        offload=("none", "optimizer+grads"),
    )  # fmt: skip
    cands = enumerate_candidates(GPT13.with_(attention="explicit"), cl, 64, **space)
    assert {c.zero for c in cands} == {0, 1, 2, 3}
    assert {c.recompute for c in cands} == {"none", "selective", "full"}
    # with SDPA, selective recompute is "none" (no scores stored, rebuilt in the kernel's
    # backward anyway): one layout, enumerated once
    sdpa = enumerate_candidates(GPT13, cl, 64, **space)
    assert {c.recompute for c in sdpa} == {"none", "full"} and len(sdpa) == 2 * len(cands) / 3
    assert {c.virtual for c in cands} == {1, 2} and {c.shard_group for c in cands} == {"dp", "node"}
    assert {c.offload for c in cands} == {"none", "optimizer+grads"}
    assert all(c.tp > 1 for c in cands if c.sp)  # SP only beside tp


def test_an_empty_result_says_why() -> None:
    from labkit.viz.planner import why_nothing_fits

    cl = _tight(2)  # 8 GPUs of 2 GB: 1.3B's states are 23.7 GB, 3 GB even at tp=8
    preds = plan(GPT13, cl, 8, micro_batches=(1,), zero_stages=(0, 1))
    assert preds and not any(r.fits for r in preds)
    text = why_nothing_fits(preds, cl.memory_bytes)
    smallest = min(preds, key=lambda r: r.memory_total)
    assert f"needs {smallest.memory_total / 1e9:.1f} GB of 2" in text
    assert "model states alone" in text and "ZeRO-3" in text and "more GPUs" in text
    with_z3 = plan(GPT13, cl, 8, micro_batches=(1,), zero_stages=(3,), recompute=("full",))
    assert "ZeRO-3" not in why_nothing_fits(with_z3, cl.memory_bytes).split("try")[-1]
    # negative control: a result with a fitting layout has nothing to explain
    assert why_nothing_fits(plan(GPT13, _tight(80), 8, micro_batches=(1,)), 80e9) == ""


def test_hfu_counts_the_recompute_and_mfu_does_not() -> None:
    from labkit.planner.flops import megatron_flops_per_iteration

    cl = CLUSTERS["dgx-a100-80gb"]
    s, L, h, V = GPT13.block_size, GPT13.n_layer, GPT13.n_embd, GPT13.vocab_size
    model = megatron_flops_per_iteration(16, s, L, h, V, recompute=False)
    for rc, extra in [
        ("none", 0.0),
        # Korthikanti's count: the attention core's 12 B s^2 h a layer once more (the
        # count their HFU uses; test_planner_timing checks it against the README)
        ("selective", 12 * 16 * s * s * h * L),
        ("full", megatron_flops_per_iteration(16, s, L, h, V) - model),
    ]:
        r = predict(GPT13.with_(attention="explicit"), cl, 16, Candidate(8, 1, 1, 2, 1, rc))
        assert r.hfu / r.mfu == pytest.approx((model + extra) / model), rc  # fmt: skip


def test_each_pipeline_rank_is_priced_with_its_own_blocks_and_stash() -> None:
    from labkit.memory.per_gpu import stored_layer_bytes
    from labkit.models.gpt import GPTConfig

    cfg = GPTConfig(vocab_size=64, block_size=32, n_layer=8, n_head=4, n_embd=64)
    cl = replace(CLUSTERS["dgx-a100-80gb"], gpus_per_node=4)
    layer = stored_layer_bytes(cfg, 32, 1)  # SDPA, no recompute
    even = predict(cfg, cl, 8, Candidate(1, 1, 4, 1, 0, "none"))
    # 1F1B: rank r stashes min(p - r, m) micro-batches; the even cut's rank 0: 2 blocks x 4
    assert even.memory["activations"] == 8 * layer
    # a lighter first stage (1, 2, 3, 2): rank 2 is the fullest, 3 blocks x 2 in flight; the
    # old bound (most blocks x the first stage's stash, 3 x 4) is the negative control
    light = predict(cfg, cl, 8, Candidate(1, 1, 4, 1, 0, "none", stage_layers=(1, 2, 3, 2)))
    assert light.memory["activations"] == 6 * layer < 12 * layer
    assert light.memory["parameters"] == 2 * 3 * (12 * 64 * 64 + 13 * 64)  # 3 blocks, no embedding
    # Megatron's lighter first and last stages, enumerated on request and priced per rank
    cands = enumerate_candidates(cfg, cl, 8, micro_batches=(1,), recompute=("none",),
                                 lighter_ends=True)  # fmt: skip
    assert {c.stage_layers for c in cands if c.pp == 4} == {None, (1, 3, 3, 1)}
    assert all(c.stage_layers is None for c in cands if c.pp < 3)
    ends = predict(cfg, cl, 8, Candidate(1, 1, 4, 1, 0, "none", stage_layers=(1, 3, 3, 1)))
    assert ends.memory["activations"] == 9 * layer  # rank 1: 3 blocks x 3 in flight
    with pytest.raises(ValueError, match="stage='head'"):
        from labkit.memory.per_gpu import gpu_memory

        gpu_memory(cfg, micro_batch=1, seq=32, shard=1, tp=1, pp=2, zero="ddp",
                   precision=MIXED_ADAM, act_bytes=2, recompute="none", sp=False,
                   attention="sdpa", stage="head")  # fmt: skip
