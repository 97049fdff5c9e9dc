"""Context and expert parallelism in the one memory model and the planner, by hand arithmetic.

Issue 24: activations divided by cp (plus the ring's K/V in flight), expert parameters,
gradients and optimizer state divided by ep, the capacity factor's padding, the all-to-all on
the ep group's link, ring K/V beyond what attention hides; and the tp ring across nodes
charged like dp's (``GroupLink.ring_bandwidth``). Pure arithmetic: no processes.
"""

from __future__ import annotations

import math

import pytest

from labkit.memory.estimate import TrainSetup, estimate
from labkit.memory.moe_cp import MoESpec, moe_activation_bytes
from labkit.models.gpt import GPTConfig
from labkit.planner.cluster import Cluster
from labkit.planner.cp_ep import moe_model_flops
from labkit.planner.plan import predict
from labkit.planner.space import Candidate, enumerate_candidates

CFG = GPTConfig(vocab_size=100, block_size=32, n_layer=2, n_head=4, n_embd=64)
SPEC = MoESpec(n_experts=4, top_k=2, expert_d_ff=128, capacity_factor=1.25)


def _cluster(nodes: int, g: int, inter: float = 25e9, latency: float = 0.0) -> Cluster:
    return Cluster(nodes=nodes, gpus_per_node=g, memory_bytes=80e9, peak_flops=312e12,
                   intra_bandwidth=300e9, inter_bandwidth=inter, intra_latency=latency,
                   inter_latency=latency, name="A100")  # fmt: skip


def test_expert_states_divide_by_ep_dense_ones_do_not() -> None:
    # h = 64, L = 2, tied: a dense block 12h^2 + 13h = 49984; its MLP 8h^2 + 5h = 33088; the
    # router h E = 256. Stage: 2 blocks + wte 6400 + wpe 2048 + final LN 128 = 108544, so the
    # dense part is 108544 - 2 x 33088 + 2 x 256 = 42880; experts 2 x (4/2) x 3 h f = 98304.
    est = estimate(CFG, TrainSetup(dp=4, ep=2, zero="zero1"), moe=SPEC)
    dense, experts = 42880, 98304
    assert est.params_per_gpu == dense + experts
    assert est.expert_params_per_gpu == experts
    assert est.parameters == 2 * (dense + experts)  # bf16 weights, nothing sharded at ZeRO-1
    assert est.gradients == 2 * (dense + experts)
    # Adam's 12 bytes: dense over dp x cp = 4 ranks, experts over dp cp / ep = 2 ranks
    assert est.optimizer_state == 12 * dense / 4 + 12 * experts / 2
    # negative control: ep ignored (every rank holding all 4 experts) is a different answer
    flat = estimate(CFG, TrainSetup(dp=4, ep=1, zero="zero1"), moe=SPEC)
    assert flat.parameters == 2 * (dense + 2 * experts) != est.parameters
    with pytest.raises(ValueError, match="ep=2"):
        estimate(CFG, TrainSetup(dp=4, ep=2))  # ep without a MoE model
    with pytest.raises(ValueError, match="ep=3"):
        TrainSetup(dp=4, ep=3)  # ep must divide dp x cp


def test_moe_activations_count_the_capacity_padding() -> None:
    # T = 16 tokens, k = 2: 32 routed rows; C = ceil(1.25 x 32 / 4) = 10, so E C = 40 slots,
    # 8 of them empty. A row keeps h (dispatched) + h (expert out) + 3f (SwiGLU) = 512 elements.
    parts = moe_activation_bytes(SPEC, 16, 64)
    assert parts == {"routed": 32 * 512 * 2, "padding": 8 * 512 * 2, "router": 4 * 16 * 4,
                     "shared": 0.0, "replaces": 8 * 64 * 16 * 2}  # fmt: skip
    assert moe_activation_bytes(SPEC.__class__(4, 2, 128, None), 16, 64)["padding"] == 0
    # in the memory model: every MoE layer of the stash holds its padding (b = 1, s = 32)
    est = estimate(CFG, TrainSetup(micro_batch=1, dp=1), moe=SPEC)
    pad = moe_activation_bytes(SPEC, 32, 64)
    assert est.moe_padding == 2 * pad["padding"]
    dense = estimate(CFG, TrainSetup(micro_batch=1, dp=1))
    extra = pad["routed"] + pad["padding"] + pad["router"] - pad["replaces"]
    assert est.activations - dense.activations == pytest.approx(2 * extra)
    # full recompute keeps only each layer's input: MoE or not, the same activations
    full = TrainSetup(micro_batch=1, dp=1, recompute="full")
    assert estimate(CFG, full, moe=SPEC).activations == estimate(CFG, full).activations


def test_context_parallel_activations_divide_by_cp_plus_the_ring_in_flight() -> None:
    # bf16-autocast: fp32 Adam, so no fp32 gradient chunk competes in the workspace
    one = estimate(CFG, TrainSetup(dp=2, seq=16, precision="bf16-autocast"))
    two = estimate(CFG, TrainSetup(dp=1, cp=2, precision="bf16-autocast"))
    # each cp rank keeps the activations of its 16 positions of the 32: exactly seq 16's
    assert two.activations == one.activations
    # the ring's K/V in flight, backward: 2 blocks x K, V (2 T h elements) x (2 + 4 bytes)
    assert two.workspace - two.allowance == 2 * (2 * 16 * 64) * (2 + 4) == 24576
    # negative controls: no ring without a flash-style kernel; zigzag needs 2 cp | seq
    with pytest.raises(ValueError, match="sdpa"):
        estimate(CFG.__class__(**{**CFG.__dict__, "attention": "explicit"}),
                 TrainSetup(dp=1, cp=2))  # fmt: skip
    with pytest.raises(ValueError, match="2 x cp"):
        estimate(CFG, TrainSetup(dp=1, cp=4, seq=20))


def test_candidates_validate_and_enumerate_cp_and_ep() -> None:
    with pytest.raises(ValueError, match="ep=4"):
        Candidate(dp=3, tp=1, pp=1, micro_batch=1, cp=2, ep=4)  # 4 does not divide 6
    with pytest.raises(ValueError, match="HSDP"):
        Candidate(dp=4, tp=1, pp=1, micro_batch=1, zero=1, shard_group="node", cp=2)
    cl = _cluster(2, 4)
    cands = enumerate_candidates(CFG, cl, 8, micro_batches=(1,), cp=(1, 2), ep=(1, 2, 4),
                                 n_experts=4)  # fmt: skip
    assert all(c.dp * c.tp * c.pp * c.cp == 8 and (c.dp * c.cp) % c.ep == 0 for c in cands)
    assert {(c.cp, c.ep) for c in cands} >= {(1, 1), (2, 1), (1, 2), (2, 4)}
    assert max(c.ep for c in enumerate_candidates(CFG, cl, 8, ep=(1, 2))) == 1  # dense model


def test_all_to_all_rides_the_ep_groups_link() -> None:
    cl, h = _cluster(2, 4, latency=1e-6), 64
    spec = MoESpec(n_experts=8, top_k=2, expert_d_ff=128, capacity_factor=1.25)
    # T = 32 tokens: 64 routed rows, C = ceil(1.25 x 64 / 8) = 10, E C = 80 slots of h bf16
    nbytes, m, L = 80 * h * 2, 4, 2
    # pairwise exchange: ep - 1 steps of one nbytes / ep piece each; 4 ranks a node
    across = 3 * (1e-6 + nbytes / 8 / 300e9) + 4 * (1e-6 + nbytes / 8 / 25e9)
    inside = 3 * (1e-6 + nbytes / 4 / 300e9)
    for ep, one in ((8, across), (4, inside)):
        cand = Candidate(dp=8, tp=1, pp=1, micro_batch=1, zero=1, recompute="none", ep=ep)
        pred = predict(CFG, cl, 8 * m, cand, moe=spec)
        assert pred.time["ep_comm"] == pytest.approx(m * L * 4 * one)  # 2 fwd + 2 bwd
    assert "ep_comm" not in predict(CFG, cl, 8 * m, Candidate(8, 1, 1, 1, 1, "none"),
                                    moe=spec).time  # ep = 1: no all-to-all  # fmt: skip


def test_moe_flops_count_top_k_experts_not_all() -> None:
    B, h, s, f = 4, 64, 32, 128
    k2 = moe_model_flops(CFG, SPEC, B)
    assert k2 == 2 * B * s * 6 * (2 * 3 * h * f + h * 4 - 8 * h * h)  # 2 MoE layers
    eight = MoESpec(n_experts=8, top_k=2, expert_d_ff=128)  # twice the experts, same k
    assert moe_model_flops(CFG, eight, B) - k2 == 2 * B * s * 6 * h * 4  # only the router
    assert moe_model_flops(CFG, MoESpec(4, 1, 128), B) < k2  # fewer active experts


def test_ring_kv_hides_behind_attention_but_its_last_hop() -> None:
    # no latency, a fast link, chunks of T = 4096 positions (of 8192, cp = 2): every K/V step
    # hides behind its block of attention except the gradients' last hop, 2 T h float32
    cfg = CFG.__class__(**{**CFG.__dict__, "block_size": 8192})
    cl = _cluster(1, 4, latency=0.0)
    cand = Candidate(dp=2, tp=1, pp=1, micro_batch=1, recompute="none", cp=2)
    pred = predict(cfg, cl, 4, cand)
    m, L, T, h = 2, 2, 4096, 64
    assert pred.time["cp_comm"] == pytest.approx(m * L * 2 * T * h * 4 / 300e9)
    # forward K/V (2 T h bf16); backward K/V, then dK/dV (2 T h fp32) twice: 4 transfers
    sent = [2 * T * h * 2, 2 * T * h * 2, 2 * T * h * 4, 2 * T * h * 4]
    # negative control: on a slow link the transfers outlast the blocks and show
    slow = Cluster(nodes=1, gpus_per_node=4, memory_bytes=80e9, peak_flops=312e12,
                   intra_bandwidth=1e8, inter_bandwidth=1e8, name="A100")  # fmt: skip
    exposed = predict(cfg, slow, 4, cand).time["cp_comm"]
    assert m * L * 0.9 * sum(sent) / 1e8 < exposed < m * L * sum(sent) / 1e8


def test_tp_ring_across_nodes_shares_the_uplink_only_with_crossing_rings() -> None:
    # tp = 16 on 2 nodes of 8: one ring crosses each node edge, so the crossing hop gets the
    # whole uplink, 8 x 25 GB/s, not the 25 GB/s per-GPU share (notebook 07 section 21)
    cl = _cluster(2, 8, latency=0.0)
    cfg = GPTConfig(vocab_size=128, block_size=64, n_layer=2, n_head=16, n_embd=256)
    pred = predict(cfg, cl, 4, Candidate(dp=1, tp=16, pp=1, micro_batch=1, recompute="none"))
    act, m, L = 2 * 64 * 256, 4, 2
    ring = 2 * 15 / 16 * act / (8 * 25e9)
    assert pred.time["tp_comm"] == pytest.approx(m * L * 4 * ring)
    old = 2 * 15 / 16 * act / 25e9  # the per-GPU share: 8x too slow
    assert pred.time["tp_comm"] == pytest.approx(m * L * 4 * old / 8)
    assert not math.isclose(pred.time["tp_comm"], m * L * 4 * old)


def test_labkit_moe_preset_counts_match_the_models_own() -> None:
    from labkit.models.moe import moe_preset

    moe = moe_preset("tiny-moe")
    spec = MoESpec.from_config(moe)
    est = estimate(moe.gpt, TrainSetup(dp=2, ep=2), moe=spec)
    # the memory model's split (dense + E/ep experts a rank) against MoEConfig.num_params
    experts = len(moe.moe_layers()) * moe.n_experts * (2 * moe.gpt.n_embd * moe.expert_d_ff
                                                       + moe.expert_d_ff + moe.gpt.n_embd)
    assert est.params_per_gpu == moe.num_params() - experts // 2
    assert est.expert_params_per_gpu == experts // 2
