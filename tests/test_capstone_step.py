"""The capstone's measured step (``labkit.measure.capstone``) runs its padded-vocabulary path
on a CPU at a tiny shape: the FLOPs stay the real vocabulary's, and bad settings are refused."""

from __future__ import annotations

import math

import pytest

from labkit.measure.capstone import capstone_step, model_flops_per_token, padded_vocab
from labkit.models import preset


def test_padded_vocab_rounds_up_to_the_multiple() -> None:
    assert padded_vocab(50257, 64) == 50304  # nanoGPT's GPT-2 vocabulary
    assert padded_vocab(50304, 64) == 50304 and padded_vocab(65, 1) == 65
    assert padded_vocab(250680, 128) == 250752
    with pytest.raises(ValueError, match="multiple must be >= 1, got 0"):
        padded_vocab(65, 0)


def test_capstone_step_pads_the_head_but_counts_the_real_vocabulary() -> None:
    plain = capstone_step("none", steps=1, warmup=1, preset_name="tiny", micro_batch=2,
                          device="cpu")  # fmt: skip
    padded = capstone_step("none", steps=1, warmup=1, preset_name="tiny", micro_batch=2,
                           pad_vocab_to=64, device="cpu")  # fmt: skip
    cfg = preset("tiny")
    assert (plain["vocab_size"], padded["vocab_size"]) == (65, 128)
    assert padded["params"] == plain["params"] + (128 - 65) * cfg.n_embd
    # model FLOPs are the unpadded model's: padding can only lower the MFU it reports
    n, fpt = model_flops_per_token(cfg, cfg.block_size)
    assert padded["N_for_flops"] == plain["N_for_flops"] == n
    assert padded["flops_per_token"] == fpt
    assert all(math.isfinite(x) for x in padded["loss_first_last"])
    assert padded["mfu"] is None  # no peak FLOP/s for a CPU


def test_capstone_step_refuses_a_recompute_it_does_not_run() -> None:
    with pytest.raises(ValueError, match="'none' or 'full'.*'selective'.*SDPA"):
        capstone_step("selective", steps=1, warmup=1, preset_name="tiny", micro_batch=1,
                      device="cpu")  # fmt: skip
