"""FP8 in the planner and the memory model: GEMMs at the catalog's FP8 peak, ZeRO-3's
all-gather at one byte, the linears' saved inputs at one byte; A100 (no FP8 tensor cores)
refused."""

from __future__ import annotations

import pytest
import torch

from labkit.hardware import value
from labkit.memory.fp8 import fp8_activation_saving, fp8_gather_bytes, fp8_weight_copy_bytes
from labkit.memory.model import activation_bytes_per_layer
from labkit.models.gpt import preset
from labkit.planner.cluster import CLUSTERS
from labkit.planner.fp8 import fp8_chip, fp8_gain
from labkit.planner.plan import plan
from labkit.precision.fp8 import E4M3, Tensorwise


def test_fp8_peak_is_twice_bf16_on_hopper_and_a100_is_refused() -> None:
    for name in ("dgx-h100-80gb", "dgx-h200"):
        chip, chip8, peak = fp8_chip(CLUSTERS[name])
        # the data sheets: 1,979 against 989 TFLOP/s dense (2x, up to their rounding)
        assert peak == chip8.peak_flops == pytest.approx(2 * chip.peak_flops, rel=1e-3)
    assert value("h100.peak_fp8") == pytest.approx(2 * value("h100.peak_bf16"), rel=1e-3)
    with pytest.raises(ValueError, match="no FP8 tensor-core peak"):  # negative control
        fp8_chip(CLUSTERS["dgx-a100-80gb"])


def test_activation_saving_is_half_the_linears_inputs() -> None:
    s, b, h = 2048, 1, 4096
    sbh = s * b * h
    assert fp8_activation_saving(s, b, h) == 7 * sbh  # (2 + 2 + 2 + 8) sbh / 2
    assert fp8_activation_saving(s, b, h, tp=8) == (2 + 5 / 8) * sbh
    assert fp8_activation_saving(s, b, h, tp=8, sp=True) == 7 * sbh / 8
    assert fp8_activation_saving(s, b, h, recompute="full") == 0.0
    for tp, sp in ((1, False), (8, False), (8, True)):  # a part of what the layer keeps
        kept = activation_bytes_per_layer(s, b, h, 32, tp=tp, sp=sp)
        assert 0 < fp8_activation_saving(s, b, h, tp=tp, sp=sp) < kept / 4
    assert fp8_gather_bytes(1e9, fp8=True) * 2 == fp8_gather_bytes(1e9, fp8=False)
    assert fp8_weight_copy_bytes(h, 24, tp=8) == 24 * 12 * h * h / 8  # one byte a weight
    # the FP8 linear really keeps x in one byte a value (plus one fp32 scale)
    x = torch.randn(256, 512)
    q = Tensorwise().quantize(x, E4M3, 1, "activation")
    assert q.nbytes == x.numel() + 4


def test_fp8_gain_on_the_planners_choices() -> None:
    cfg, cluster = preset("gpt2-1.3b"), CLUSTERS["dgx-h100-80gb"]
    preds = plan(cfg, cluster, 64, dp_overlap=True, zero_stages=(0, 3))
    for pred in (preds[0], next(p for p in preds if p.candidate.zero == 3)):
        g = fp8_gain(cfg, cluster, 64, pred.candidate)
        bf16, fp8 = g["bf16"], g["fp8"]
        assert 0.5 <= g["gemm_ratio"] < 0.6  # twice the rate, launch and memory terms aside
        assert fp8["compute"] < bf16["compute"] and g["speedup"] > 1.1
        assert fp8["tp_comm"] == bf16["tp_comm"] and fp8["optimizer"] == bf16["optimizer"]
        assert g["mfu_bf16_peak"][1] > g["mfu_bf16_peak"][0] > g["mfu_fp8_peak"] / 2
        copies = fp8_weight_copy_bytes(cfg.n_embd, cfg.n_layer, pred.candidate.tp)
        assert g["weight_copies"] == (0.0 if pred.candidate.recompute == "full" else copies)
        if pred.candidate.zero == 3:  # FSDP's FP8 all-gather: half the parameter bytes
            assert fp8["dp_comm"] < bf16["dp_comm"]
            assert g["gather_bytes"][1] * 2 == g["gather_bytes"][0]
        else:
            assert fp8["dp_comm"] == bf16["dp_comm"]


def test_the_memory_estimate_counts_fp8_linears() -> None:
    from labkit.memory.estimate import TrainSetup, estimate

    cfg = preset("gpt2-1.3b")
    s, h, L = cfg.block_size, cfg.n_embd, cfg.n_layer
    bf16 = estimate(cfg, TrainSetup(micro_batch=2, tp=2))
    fp8 = estimate(cfg, TrainSetup(micro_batch=2, tp=2, fp8=True))
    want = -fp8_activation_saving(s, 2, h, tp=2) * L + fp8_weight_copy_bytes(h, L, 2)
    assert fp8.activations - bf16.activations == pytest.approx(want)
    assert fp8.activations < bf16.activations  # at this shape the savings outweigh the copies
    assert (fp8.parameters, fp8.gradients, fp8.optimizer_state, fp8.workspace) == (
        bf16.parameters, bf16.gradients, bf16.optimizer_state, bf16.workspace)  # fmt: skip
    full = TrainSetup(micro_batch=2, recompute="full")  # only block inputs kept: no change
    assert estimate(cfg, full.with_(fp8=True)).total == estimate(cfg, full).total
