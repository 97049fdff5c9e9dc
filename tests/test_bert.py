"""Scenario S4 (BERT on 4 nodes): the model's size arithmetic, the task, the predictions, and
one DDP run of the tiny BERT equal to a single process step by step."""

from __future__ import annotations

import pytest
import torch

from labkit.collectives.cost_model import AlphaBeta
from labkit.labs import bert4nodes as lab
from labkit.models.bert import Bert, bert_loss, bert_preset, count_params
from tests.ranks import run_ranks


# ------------------------------------------------------------------------------ the model
@pytest.mark.parametrize("name", ["bert-base", "bert-large", "lab"])
def test_count_params_matches_the_module(name):
    cfg = bert_preset(name)
    with torch.device("meta"):
        model = Bert(cfg)
    assert count_params(cfg) == sum(p.numel() for p in model.parameters())
    assert count_params(cfg, head=False) == count_params(cfg) - (cfg.hidden + 1) * cfg.num_labels


def test_published_sizes():
    # Devlin et al. 2019 quote 110M and 340M; the reference implementation's encoder with its
    # pooler has exactly these counts.
    assert count_params(bert_preset("bert-base"), head=False) == 109_482_240
    assert count_params(bert_preset("bert-large"), head=False) == 335_141_888


def test_padding_is_invisible_and_bad_config_is_refused():
    torch.manual_seed(0)
    model = Bert(bert_preset("lab")).eval()
    ids = torch.randint(0, 256, (2, 10))
    padded = torch.cat([ids, torch.full((2, 6), lab.PAD)], 1)  # (2, 16)
    mask = padded != lab.PAD
    torch.testing.assert_close(model(padded, None, mask), model(ids), atol=1e-5, rtol=1e-5)
    # negative control: without the mask the padding changes the answer
    assert not torch.allclose(model(padded), model(ids), atol=1e-4)
    with pytest.raises(ValueError, match="hidden=100 must be divisible by n_head=12"):
        bert_preset("bert-base", hidden=100)


# ------------------------------------------------------------------------------ the task
def test_task_is_deterministic_balanced_and_split_cleanly():
    train, val = lab.sentence_task("train"), lab.sentence_task("val")
    lab.sentence_task.cache_clear()
    again = lab.sentence_task("train")
    assert torch.equal(train.ids, again.ids) and torch.equal(train.labels, again.labels)
    for task in (train, val):
        counts = task.labels.bincount(minlength=3)
        assert counts.min() == counts.max() > 100
        assert (task.ids[:, 0] == lab.CLS).all()
        last = task.ids.gather(1, task.mask.sum(1, keepdim=True) - 1)  # (N, 1): last real token
        assert (last == lab.SEP).all()
        marks = torch.tensor([ord(c) for c in ".?!"])
        before = task.ids.gather(1, task.mask.sum(1, keepdim=True) - 2)  # the mark is removed
        assert not torch.isin(before, marks).any()
    rows = {tuple(r.tolist()) for r in train.ids}
    assert not any(tuple(r.tolist()) in rows for r in val.ids)


def test_task_is_learnable_above_chance():
    result = lab.train_baseline(steps=60)
    assert result["losses"][-1] < result["losses"][0]
    # 720 balanced validation sentences: chance is 1/3 with a standard deviation of 1.8%
    assert result["val_accuracy"] > result["chance"] + 0.03, result


# ------------------------------------------------------------------------------ arithmetic
def test_gradient_bytes_by_hand():
    cfg = bert_preset("lab")
    n = count_params(cfg)
    assert lab.gradient_bytes(cfg, "fp32") == 4 * n
    assert lab.gradient_bytes(cfg, "fp16") == 2 * n
    # PowerSGD rank 2 by hand: a matrix n x m goes as r (n + m) values when that is less than
    # half of n m (labkit.ddp.compression's rule); vectors and the rest go whole.
    h, i, v, t, c = cfg.hidden, cfg.intermediate, cfg.vocab_size, cfg.max_position, 3
    matrices = [(v, h), (t, h), (2, h)] + [(h, h)] * 4 * cfg.n_layer
    matrices += [(i, h), (h, i)] * cfg.n_layer + [(h, h), (c, h)]
    vectors = 2 * h + cfg.n_layer * (4 * h + i + h + 4 * h) + h + c
    sent = [2 * (a + b) if 2 * (a + b) * 2 < a * b else a * b for a, b in matrices]
    assert sent[0] == 2 * (v + h) and sent[2] == 2 * h  # embeddings compressed, segments not
    assert lab.gradient_bytes(cfg, "powersgd2") == 4 * (sum(sent) + vectors)
    base = bert_preset("bert-base")
    assert lab.gradient_bytes(base, "powersgd4") < lab.gradient_bytes(base, "fp16") / 20
    with pytest.raises(ValueError, match="powersgd0"):
        lab.gradient_bytes(cfg, "powersgd0")


def test_allreduce_times_by_hand():
    intra, inter = AlphaBeta(1e-5, 1 / 10e9), AlphaBeta(1e-4, 1 / 1e9)
    d, n, k = 400e6, 4, 2
    p = n * k
    t = lab.allreduce_times(d, n, k, intra, inter)
    flat = 2 * (p - 1) * (inter.alpha + d / p * inter.beta)
    hier = (
        2 * (k - 1) * intra.alpha
        + 2 * (k - 1) / k * d * intra.beta
        + 2 * (n - 1) * inter.alpha
        + 2 * (n - 1) / n * d * inter.beta
    )
    assert t["flat ring"] == pytest.approx(flat, rel=1e-9)
    assert t["hierarchical"] == pytest.approx(hier, rel=1e-9)
    assert lab.allreduce_times(d, 1, 1, intra, inter) == {"flat ring": 0.0, "hierarchical": 0.0}


def test_strong_scaling_prediction_by_hand():
    link = AlphaBeta(0.0, 1e-9)  # 1 GB/s, no latency: one node of one rank sends nothing
    pred = lab.strong_scaling_prediction(1.0, 1e8, [1, 2, 4], 1, link, link, algorithm="flat ring")
    # 4 nodes: compute 0.25 s, ring 2 * 3/4 * 0.1 s = 0.15 s
    assert pred[4]["step"] == pytest.approx(0.25 + 0.15)
    assert pred[4]["efficiency"] == pytest.approx(1.0 / 0.4 / 4)
    assert pred[1]["efficiency"] == pytest.approx(1.0)
    hidden = lab.strong_scaling_prediction(1.0, 1e8, [4], 1, link, link, hidden=0.1)
    assert hidden[4]["step"] == pytest.approx(0.25 + 0.05)
    two_cores = lab.strong_scaling_prediction(1.0, 1e8, [4], 1, link, link, parallel=2)
    assert two_cores[4]["step"] == pytest.approx(0.5 + pred[4]["comm"])


# ------------------------------------------------------------------------------ DDP proof
STEPS, ACCUM, WORLD, MICRO = 3, 2, 2, 6  # 6 sequences per micro-batch, 3 per rank


def _batches():
    task = lab.sentence_task("train", 32)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, len(task), (STEPS, ACCUM, MICRO), generator=g)
    return [[task.batch(idx[s, a]) for a in range(ACCUM)] for s in range(STEPS)]


def _tiny():
    return bert_preset("lab", max_position=32, n_layer=1)


def _ddp_rank(bucket_mb):
    import contextlib

    import torch.distributed as dist

    from labkit.ddp import OverlappedDDP
    from labkit.reference import snapshot

    rank = dist.get_rank()
    rows = slice(rank * MICRO // WORLD, (rank + 1) * MICRO // WORLD)
    runs = {}
    for kind in ("ddp", "local"):  # local: the negative control, no gradient average
        torch.manual_seed(rank)  # different starts on purpose: DDP broadcasts rank 0's
        net = Bert(_tiny())
        if kind == "local":
            torch.manual_seed(0)
            net = Bert(_tiny())  # rank 0's start, without the broadcast
        model = OverlappedDDP(net, bucket_cap_mb=bucket_mb) if kind == "ddp" else net
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        runs[kind] = []
        for micro in _batches():
            for a, (ids, labels, mask) in enumerate(micro):
                last = a == ACCUM - 1
                hold = contextlib.nullcontext() if last or kind == "local" else model.no_sync()
                with hold:
                    (bert_loss(model, ids[rows], labels[rows], mask[rows]) / ACCUM).backward()
            if kind == "ddp":
                model.finish_gradient_sync()
            opt.step()
            opt.zero_grad(set_to_none=True)
            runs[kind].append(snapshot(net.named_parameters()))
    return runs


def test_ddp_tiny_bert_equals_single_process_every_step():
    from labkit.reference import first_divergence, train_reference

    torch.manual_seed(0)
    ref_model = Bert(_tiny())
    # SGD, not Adam: the key bias's gradient is zero up to rounding (softmax ignores a shift
    # shared by all keys), and Adam would blow that rounding noise up to full-size steps.
    opt = torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9)
    ref = train_reference(ref_model, opt, _batches(), bert_loss)
    # 0.01 MB buckets: several buckets per step, launched from the gradient hooks
    results = run_ranks(_ddp_rank, 0.01, world_size=WORLD, timeout=120)
    for rank, runs in enumerate(results):
        assert first_divergence(ref.params, runs["ddp"]) is None, f"rank {rank}"
        # negative control: each rank stepping on its own half of the batch drifts away
        assert first_divergence(ref.params, runs["local"]) is not None, f"rank {rank}"


def test_cluster_measurements_refuse_bad_input_before_any_process():
    from labkit.cluster import EmulatedCluster
    from labkit.measure.cluster import Variant, measure_ddp, measure_strong_scaling

    with pytest.raises(ValueError, match="impl='nccl'"):
        Variant("nccl")
    with pytest.raises(ValueError, match="powersgd0"):
        Variant("torch", "powersgd0")
    cluster = EmulatedCluster(nodes=2, inter_bandwidth=1e6, mode="software")
    with pytest.raises(ValueError, match="global_batch=32 is not divisible by world_size=6"):
        measure_ddp(cluster, 6)
    with pytest.raises(ValueError, match="world_size=3 is not divisible by nodes=2"):
        measure_ddp(cluster, 3, global_batch=33)
    with pytest.raises(ValueError, match="nodes=\\(2, 4\\)"):
        measure_strong_scaling(lambda n: None, (2, 4))
