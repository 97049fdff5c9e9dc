"""Pure arithmetic of long-context attention: memory, bytes on the wire, and when a ring hides.

Symbols: batch ``b``, heads ``h`` (per tensor-parallel rank: pass ``h / tp``), head dim ``d``,
sequence ``s``, context-parallel degree ``cp``, bytes per element ``elem`` (2 for bf16), and
``kv`` the key/value heads: grouped-query attention (GQA; Ainslie et al. 2023) shares one K/V
head among ``h / kv`` query heads (Llama 3 8B: 32 query heads, 8 K/V heads), so every K/V term
below shrinks by ``kv / h``; ``kv=None`` means ``kv = h`` (multi-head attention).

* Naive attention keeps the softmax output, ``b h s^2`` elements per layer (Korthikanti et
  al. 2022 count ``5 a s^2 b`` bytes in 16-bit with the scores and dropout): quadratic.
* A flash-style kernel (and ring attention, block by block) keeps only Q, K, V, O and a
  float32 log-sum-exp per row for the backward: ``(2 h + 2 kv) b s d elem + 4 b h s``: linear.
* Context parallelism divides that by ``cp`` (each rank holds ``s/cp`` positions).
* Ring bytes per step: K and V of one shard, ``2 b kv (s/cp) d elem``. Backward moves K/V
  again plus their float32 gradients (``2 b kv (s/cp) d 4``), one step behind.
* Ulysses: four all-to-alls per layer forward (Q, K, V in, O out), each sending ``(cp-1)/cp``
  of one shard; K and V carry ``max(kv, cp)`` heads, since with fewer K/V heads than ranks
  each rank still needs the one its query heads share (``cp`` must divide ``h``, and ``kv``
  and ``cp`` must divide one another).
* Overlap: a ring step computes ``4 b h d (s/cp)^2`` FLOPs (non-causal) while sending
  ``2 b h d (s/cp) elem`` bytes, so compute hides communication once
  ``s/cp >= flops_per_s * elem / (2 * bytes_per_s)`` (:func:`ring_overlap_min_chunk`).

Everything here is a function of integers: no processes (the planner can call it).
"""

from __future__ import annotations

__all__ = [
    "attention_flops",
    "flash_attention_bytes",
    "long_context_cost",
    "naive_attention_bytes",
    "ring_activation_bytes",
    "ring_bytes_per_step",
    "ring_overlap_min_chunk",
    "ring_sent_per_step",
    "ulysses_bytes_per_rank",
]


def naive_attention_bytes(b: int, h: int, s: int, elem: int = 2, dropout: bool = False) -> int:
    """The (s, s) tensors plain attention keeps for backward: the softmax output (its own
    backward and ``P V`` need it); with dropout also the mask (1 byte) and the dropped copy."""
    return b * h * s * s * (elem + (1 + elem if dropout else 0))


def _kv(h: int, kv: int | None) -> int:
    """The K/V heads: ``h`` unless given; GQA needs ``kv`` to divide ``h``."""
    if kv is None:
        return h
    if kv < 1 or h % kv:
        raise ValueError(f"kv={kv} K/V heads must divide the h={h} query heads")
    return kv


def flash_attention_bytes(
    b: int, h: int, s: int, d: int, elem: int = 2, kv: int | None = None
) -> int:
    """What a flash-style attention saves for its backward: Q, K, V, O and a float32 LSE."""
    return (2 * h + 2 * _kv(h, kv)) * b * s * d * elem + 4 * b * h * s


def ring_activation_bytes(
    b: int, h: int, s: int, d: int, cp: int, elem: int = 2, kv: int | None = None
) -> int:
    """Saved for the backward per ring-attention rank: flash's bytes for ``s / cp`` positions
    (exactly ``flash_attention_bytes(b, h, s, d) / cp``)."""
    return flash_attention_bytes(b, h, s // cp, d, elem, kv)


def ring_bytes_per_step(
    b: int, h: int, s: int, d: int, cp: int, elem: int = 2, kv: int | None = None
) -> int:
    """Bytes one rank sends in one forward ring step: K and V of its shard (``kv`` heads)."""
    return 2 * b * _kv(h, kv) * (s // cp) * d * elem


def ring_sent_per_step(
    b: int,
    h: int,
    s: int,
    d: int,
    cp: int,
    elem: int = 4,
    backward: bool = True,
    kv: int | None = None,
) -> list[int]:
    """The bytes one rank sends at each step, in the order ``RingStats.sent`` records them:
    ``cp - 1`` forward steps (K/V), then ``cp`` backward steps (K/V prefetch while one
    remains, the float32 K/V gradient from the second step on), then the gradient's last hop."""
    if cp == 1:
        return []
    k_v = ring_bytes_per_step(b, h, s, d, cp, elem, kv)
    grad = ring_bytes_per_step(b, h, s, d, cp, 4, kv)
    out = [k_v] * (cp - 1)
    if backward:
        out += [k_v] + [k_v + grad] * (cp - 2) + [grad] + [grad]
    return out


def ulysses_bytes_per_rank(
    b: int, h: int, s: int, d: int, cp: int, elem: int = 2, kv: int | None = None
) -> int:
    """Bytes one rank sends in Ulysses' forward: 4 all-to-alls (Q, K, V in, O out), each
    keeping ``1/cp`` of a ``b heads (s/cp) d`` shard at home; Q and O have ``h`` heads, K and V
    ``max(kv, cp)`` (fewer K/V heads than ranks: each is sent to every rank that needs it)."""
    k_v = _kv(h, kv)
    if h % cp or (k_v % cp and cp % k_v):
        raise ValueError(f"Ulysses needs cp={cp} to divide h={h}, and kv={k_v} and cp to divide "
                         "one another")  # fmt: skip
    per_head = b * (s // cp) * d * elem
    return (2 * h + 2 * max(k_v, cp)) * per_head * (cp - 1) // cp


def attention_flops(b: int, h: int, s: int, d: int, causal: bool = True) -> float:
    """Forward FLOPs of ``softmax(Q K^T) V`` for one layer: two ``s x s x d`` matmuls per head
    (``4 b h s^2 d``), half of it under a causal mask (a kernel that skips masked tiles)."""
    full = 4.0 * b * h * s * s * d
    return full / 2 if causal else full


def ring_overlap_min_chunk(flops_per_s: float, bytes_per_s: float, elem: int = 2) -> float:
    """The shard length ``s/cp`` from which a (non-causal) ring step's compute outlasts its
    transfer: ``4 b h d n^2 / F >= 2 b h d n elem / B``  <=>  ``n >= F elem / (2 B)``."""
    return flops_per_s * elem / (2 * bytes_per_s)


def long_context_cost(
    *,
    hidden: int,
    heads: int,
    layers: int,
    seq: int,
    cp: int = 1,
    tp: int = 1,
    batch: int = 1,
    elem: int = 2,
    kv_heads: int | None = None,
) -> dict[str, float | None]:
    """Per-GPU attention cost of one ``seq``-long sample through ``layers`` layers, heads split
    over ``tp`` and the sequence over ``cp``. Keys: ``naive_scores_bytes`` (per layer, what
    plain attention would hold), ``flash_bytes`` (all layers, what a flash/ring kernel holds),
    ``layer_activation_bytes`` (Korthikanti's ``s b H (34 + 5 a s / H)`` per layer with
    sequence parallelism, divided by tp and cp, flash drops the ``5 a s / H`` term: both
    given; with ``kv_heads`` < ``heads`` (GQA) K and V, ``2 sbH`` each of the 34, shrink by
    ``kv_heads / heads``), ``attention_flops`` (forward, all layers, causal),
    ``ring_step_bytes`` and ``ulysses_bytes`` (per layer forward; ``None`` where Ulysses
    cannot split these heads over cp)."""
    kv_all = heads if kv_heads is None else kv_heads
    if hidden % heads or heads % tp or heads % kv_all or kv_all % tp:
        raise ValueError(f"hidden={hidden}, heads={heads}, kv_heads={kv_heads}, tp={tp}: "
                         "heads must divide evenly")  # fmt: skip
    d, h, kv = hidden // heads, heads // tp, kv_all // tp
    s_loc = seq // cp
    coeff = 34 - 4 * (1 - kv_all / heads)  # Korthikanti's 34 sbH, K and V at kv/heads
    per_layer_linear = coeff * seq * batch * hidden * elem / 2 / (tp * cp)  # 16-bit
    per_layer_quadratic = 5 * heads * seq * seq * batch / (tp * cp)
    uly_ok = h % cp == 0 and (kv % cp == 0 or cp % kv == 0)
    uly = ulysses_bytes_per_rank(batch, h, seq, d, cp, elem, kv) if uly_ok else None
    return {
        "naive_scores_bytes": naive_attention_bytes(batch, h, seq, elem) / cp,
        "flash_bytes": layers * ring_activation_bytes(batch, h, seq, d, cp, elem, kv),
        "layer_activation_bytes_naive": per_layer_linear + per_layer_quadratic,
        "layer_activation_bytes_flash": per_layer_linear,
        "attention_flops": layers * attention_flops(batch, h, seq, d) / cp,
        "ring_step_bytes": ring_bytes_per_step(batch, h, seq, d, cp, elem, kv),
        "ulysses_bytes": uly,
        "shard_tokens": s_loc,
    }
