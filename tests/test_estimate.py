"""labkit.memory.estimate: the one per-GPU memory estimate, checked against the ZeRO paper's
Table 1, Korthikanti's Table 2 and a ledger measured on 2 gloo ranks."""

from __future__ import annotations

import math

import pytest

from labkit.memory.estimate import (
    TrainSetup,
    block_params,
    estimate,
    gpu_params,
    measured_vs_predicted,
)
from labkit.memory.model import STAGES, activation_bytes_per_layer, paper_round, zero_table1
from labkit.models import count_params_meta, preset
from tests.ranks import run_ranks

GPT13 = preset("gpt2-1.3b")
# The CPU proxy of the capstone: the 1.3B recipe at reduced width, depth and vocabulary.
PROXY = GPT13.with_(n_layer=2, n_embd=128, n_head=4, block_size=64, vocab_size=1024)
PROXY_BATCH = 4
TOLERANCE = 0.10  # activations and the step's peak total; model states must match exactly


def _states(e):
    return e.parameters + e.gradients + e.optimizer_state


def test_params_per_gpu_is_the_exact_count_without_model_parallelism():
    assert gpu_params(GPT13) == count_params_meta(GPT13) == 1_315_723_264
    assert estimate(GPT13).params_per_gpu == count_params_meta(GPT13)


def test_tensor_parallel_split_adds_up_to_the_whole_model():
    # tp ranks together hold every split parameter once and every replicated one tp times.
    cfg = GPT13
    for tp in (2, 4, 8):
        replicated = cfg.n_layer * 6 * cfg.n_embd + 2 * cfg.n_embd  # LNs, 2 biases, final LN
        padded = -(-cfg.vocab_size // tp) * tp - cfg.vocab_size
        whole = count_params_meta(cfg) + padded * cfg.n_embd
        assert (
            tp * gpu_params(cfg, tp=tp) - (tp - 1) * replicated
            == whole + (tp - 1) * cfg.block_size * cfg.n_embd
        )
        assert block_params(cfg, tp) < block_params(cfg) / tp + 7 * cfg.n_embd


def test_model_states_reproduce_zero_table1():
    # Table 1 (Psi = 7.5B, K = 12): per-GPU GB is 16 Psi / 1e9 scaled by what each stage shards.
    # Our model states per parameter, scaled to the paper's 7.5B, give the same printed values.
    table = zero_table1()
    psi = count_params_meta(GPT13)
    for n, row in table.items():
        for stage, paper in zip(STAGES, row):
            e = estimate(GPT13, TrainSetup(dp=n, zero=stage, precision="bf16"))
            assert e.params_per_gpu == psi
            assert paper_round(_states(e) / psi * 7.5e9 / 1e9) == paper
    # and the 1.3B itself: 16 bytes a parameter under DDP, 21.05 GB
    assert _states(estimate(GPT13, precision="bf16")) == 16 * psi


def test_activations_follow_korthikanti_table2():
    cfg = GPT13.with_(attention="explicit")  # stores the 5as^2b attention core
    s, b, h, a, L, V = 2048, 2, cfg.n_embd, cfg.n_head, cfg.n_layer, cfg.vocab_size
    for tp, sp, rc in [
        (1, False, "none"),
        (2, False, "selective"),
        (4, True, "none"),
        (8, True, "full"),
    ]:
        e = estimate(cfg, micro_batch=b, tp=tp, sp=sp, recompute=rc)
        head = 2 * s * b * -(-V // tp) * 2  # logits and log-probabilities, 16-bit
        assert (
            e.activations
            == L * activation_bytes_per_layer(s, b, h, a, tp=tp, sp=sp, recompute=rc) + head
        )
    # the formula by hand: t=8 with sequence parallelism and selective recompute is 34 sbh / t
    one = estimate(cfg, micro_batch=1, tp=8, sp=True, recompute="selective")
    assert one.activations - 2 * 2048 * math.ceil(V / 8) * 2 == L * 2048 * 2048 * 34 / 8
    # SDPA (FlashAttention) never stores the attention core: its "none" is Table 2's selective
    sdpa = estimate(GPT13, micro_batch=b)
    assert sdpa.activations == estimate(cfg, micro_batch=b, recompute="selective").activations
    # fp32 stores every tensor at twice the bytes
    assert estimate(GPT13, precision="fp32").activations == 2 * estimate(GPT13).activations


def test_pipeline_first_stage_holds_all_layers_worth_and_offload_moves_the_optimizer():
    base = estimate(GPT13, micro_batch=4)
    piped = estimate(GPT13, micro_batch=4, pp=4)
    head = 2 * 2048 * 4 * GPT13.vocab_size * 2
    assert piped.activations == base.activations - head  # 1F1B: pp in flight x L/pp layers
    # with full recompute the stash is small and the last stage (with the logits) is larger
    full = estimate(GPT13, micro_batch=4, recompute="full", pp=4)
    assert full.activations == 6 * 2 * 2048 * 4 * 2048 + head
    assert piped.params_per_gpu < base.params_per_gpu / 3
    off = estimate(GPT13, zero="zero2", dp=8, offload_optimizer=True)
    on = estimate(GPT13, zero="zero2", dp=8)
    assert off.optimizer_state == 0 and off.host_bytes == on.optimizer_state > 0
    assert off.total < on.total


def test_fits_and_bad_input():
    e = estimate(GPT13, micro_batch=8, recompute="full", zero="zero3", dp=8)
    assert e.fits(80e9) and not estimate(GPT13, micro_batch=8).fits(24e9)
    assert e.headroom(80e9) == 80e9 - e.total
    with pytest.raises(ValueError, match="zero4"):
        TrainSetup(zero="zero4")
    with pytest.raises(ValueError, match="tp=3"):
        estimate(GPT13, tp=3)
    with pytest.raises(ValueError, match="block_size"):
        estimate(GPT13, seq=4096)


def _measure(cfg, batch):
    from labkit.zero import measure_gpt

    return measure_gpt(STAGES, cfg, batch=batch, steps=1)


def test_estimate_matches_a_measured_ledger_on_two_ranks():
    records = run_ranks(_measure, PROXY, PROXY_BATCH, world_size=2, timeout=300)
    for rank_records in records:
        for rec in rank_records:
            e = estimate(
                PROXY,
                micro_batch=PROXY_BATCH,
                dp=2,
                zero=rec["stage"],
                precision="fp32",
                allowance=0,
            )
            rows = measured_vs_predicted(rec, e)
            for cat in ("parameters", "gradients", "optimizer_state"):
                assert rows[cat][0] == rows[cat][1], (rec["stage"], cat, rows[cat])
            for cat in ("activations", "total"):
                measured, predicted = rows[cat]
                assert abs(predicted - measured) <= TOLERANCE * measured, (
                    rec["stage"],
                    cat,
                    rows[cat],
                )
            # negative control: the wrong stage's prediction is rejected by the same check
            wrong = "zero3" if rec["stage"] == "ddp" else "ddp"
            bad = measured_vs_predicted(
                rec, estimate(PROXY, micro_batch=PROXY_BATCH, dp=2, zero=wrong, precision="fp32")
            )
            assert any(
                bad[c][0] != bad[c][1] for c in ("parameters", "gradients", "optimizer_state")
            )
            # and 16-bit activations would be off by far more than the tolerance
            half = estimate(
                PROXY, micro_batch=PROXY_BATCH, dp=2, zero=rec["stage"], precision="bf16"
            ).activations
            assert abs(half - rows["activations"][0]) > TOLERANCE * rows["activations"][0]
