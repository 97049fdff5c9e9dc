"""Grouped-query attention in the context-parallel cost (issue 35, item 12): notebook 15's
"Llama-3-8B-shaped" traffic used 32 K/V heads where Llama 3 8B has 8. The formulas are checked
against bytes counted from tensors and from which heads each rank needs, not against
themselves; the multi-head formula (K/V at every query head) is the negative control."""

from __future__ import annotations

import pytest
import torch

from labkit.context_parallel import cost


def _shard(b: int, heads: int, s: int, cp: int, d: int, elem: int) -> torch.Tensor:
    dtype = {2: torch.bfloat16, 4: torch.float32}[elem]
    return torch.empty(b, heads, s // cp, d, dtype=dtype)  # (b, heads, s/cp, d)


def _ulysses_sent(b: int, h: int, kv: int, s: int, d: int, cp: int, elem: int) -> int:
    """Bytes one rank sends in Ulysses' forward, counted head by head: rank j gets the query
    heads of chunk j (and sends O back for them), and the K/V heads those query heads read."""
    q_of = [list(range(j * h // cp, (j + 1) * h // cp)) for j in range(cp)]
    group = h // kv  # query heads per K/V head
    one_head = _shard(b, 1, s, cp, d, elem).nbytes
    sent = 0
    for j in range(1, cp):  # from rank 0 to every other rank
        kv_heads = {q // group for q in q_of[j]}
        sent += (2 * len(q_of[j]) + 2 * len(kv_heads)) * one_head  # Q and O; K and V
    return sent


@pytest.mark.parametrize("h,kv,cp", [(4, 4, 2), (4, 1, 2), (4, 1, 4), (8, 2, 2), (8, 2, 4)])
def test_gqa_ring_and_ulysses_bytes_are_the_counted_bytes(h: int, kv: int, cp: int) -> None:
    b, s, d, elem = 1, 64, 8, 2
    k, v = _shard(b, kv, s, cp, d, elem), _shard(b, kv, s, cp, d, elem)
    assert cost.ring_bytes_per_step(b, h, s, d, cp, elem, kv=kv) == k.nbytes + v.nbytes
    want = _ulysses_sent(b, h, kv, s, d, cp, elem)
    assert cost.ulysses_bytes_per_rank(b, h, s, d, cp, elem, kv=kv) == want
    flash = 2 * _shard(b, h, s, 1, d, elem).nbytes + 2 * _shard(b, kv, s, 1, d, elem).nbytes
    assert cost.flash_attention_bytes(b, h, s, d, elem, kv=kv) == flash + 4 * b * h * s
    if kv < h:  # negative control: K/V counted at every query head is too much
        assert cost.ring_bytes_per_step(b, h, s, d, cp, elem) == h // kv * k.nbytes * 2
        # Ulysses: each rank needs at least one whole K/V head, so K and V carry max(kv, cp)
        # heads; at cp = h that is what multi-head attention sends
        mha = cost.ulysses_bytes_per_rank(b, h, s, d, cp, elem)
        assert mha > want if max(kv, cp) < h else mha == want


def test_llama3_8b_shape_sends_a_quarter_of_the_kv_and_keeps_31_sbh() -> None:
    shape = dict(hidden=4096, heads=32, layers=32, seq=131072, tp=8, cp=8)
    mha = cost.long_context_cost(**shape)
    gqa = cost.long_context_cost(**shape, kv_heads=8)
    assert mha["ring_step_bytes"] == 4 * gqa["ring_step_bytes"]
    sbh = 131072 * 4096 / (8 * 8)  # s b H over tp and cp, 16-bit: 2 bytes each, halved
    assert mha["layer_activation_bytes_flash"] == 34 * sbh
    assert gqa["layer_activation_bytes_flash"] == 31 * sbh  # K and V: 4 sbH at 8/32
    assert gqa["ulysses_bytes"] is None  # 1 K/V head per tp rank, 4 query heads: cp=8 > 4
    with pytest.raises(ValueError, match="kv_heads=6"):
        cost.long_context_cost(**shape, kv_heads=6)
    with pytest.raises(ValueError, match="divide"):
        cost.ulysses_bytes_per_rank(1, 4, 64, 8, 8, kv=1)
