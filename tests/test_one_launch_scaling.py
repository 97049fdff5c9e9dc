"""Measurements merged into ONE launch (notebooks 02, 09 and 11). Scaling: for each rank
count n, the first n ranks form a group and step while the others wait. What must hold:
every count is measured by exactly its own ranks (rank 0 in all of them), the one-rank group
sends nothing, the n-rank group sends a ring all-reduce's 2(n-1)/n of the gradient, and bad
input is refused before any process starts."""

from __future__ import annotations

import pytest

from labkit.cluster import EmulatedCluster
from labkit.labs.bert4nodes import gradient_bytes
from labkit.measure.cluster import Variant, measure_strong_scaling
from labkit.measure.cluster_section import measure_section
from labkit.measure.floor import bench_and_floor
from labkit.measure.scaling import measure_scaling
from labkit.models import GPTConfig
from labkit.models.bert import bert_preset
from tests.ranks import run_ranks

TINY_GPT = GPTConfig(n_layer=1, n_embd=16, n_head=2, block_size=8, vocab_size=32)


def _both_workers() -> tuple[dict, dict]:
    from labkit.measure.cluster import scaling_worker
    from labkit.measure.scaling import _scaling_ranks

    bert = scaling_worker(bert_preset("lab"), [1, 2], 8, 1, "ring", 1, 1)
    gpt = _scaling_ranks(TINY_GPT, {1: 2, 2: 2}, 1, 1)
    return bert, gpt


def test_each_count_is_measured_by_its_own_ranks():
    (bert0, gpt0), (bert1, gpt1) = run_ranks(_both_workers, world_size=2)
    assert sorted(bert0) == [1, 2] and sorted(bert1) == [2]  # rank 1 sat the 1-rank turn out
    assert sorted(gpt0) == [1, 2] and sorted(gpt1) == [2]
    grad = gradient_bytes(bert_preset("lab"))
    assert bert0[1]["sent"] == 0.0  # a group of one communicates nothing
    # the 2-rank group all-reduces the whole gradient: 2 (n-1)/n of it per rank and step
    # (plus a few bytes of DDP's "used" flags)
    assert grad <= bert0[2]["sent"] <= grad * 1.01 and bert1[2]["sent"] == bert0[2]["sent"]
    assert all(row["step"] > 0 for row in (*bert0.values(), *bert1.values()))
    assert all(t > 0 for t in (*gpt0.values(), *gpt1.values()))


def test_bad_input_is_refused_before_any_process():
    cluster = EmulatedCluster(nodes=2, inter_bandwidth=1e6, mode="software")
    with pytest.raises(ValueError, match="global_batch=30 is not divisible by world_size=4"):
        measure_section(cluster, 4, global_batch=30)
    with pytest.raises(ValueError, match="world_size=3 is not divisible by nodes=2"):
        measure_section(cluster, 3, global_batch=33)
    with pytest.raises(ValueError, match="must be one of the variants"):
        measure_section(cluster, 4, variants=[Variant("torch")], profile=Variant("ring"))
    with pytest.raises(ValueError, match="impl='hierarchical' with ranks_per_node=2"):
        measure_strong_scaling(lambda n: None, (1, 2), ranks_per_node=2, impl="hierarchical")
    with pytest.raises(ValueError, match=r"ranks \[0\]"):
        measure_scaling(TINY_GPT, ranks=(0, 1))
    with pytest.raises(ValueError, match=r"ranks \[2\]"):
        measure_scaling(TINY_GPT, ranks=(1, 2), mode="strong", batch=5)
    with pytest.raises(ValueError, match="sizes non-empty"):
        bench_and_floor([])
    with pytest.raises(ValueError, match="floor_repeats >= 1"):
        bench_and_floor([4096], floor_repeats=0)
