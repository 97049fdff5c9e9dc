"""Scenario S4, BERT fine-tuned on 4 nodes: the task, the arithmetic, the single-process baseline.

The interview question: fine-tune a pre-trained BERT for text classification across 4 cloud
nodes, optimising communication. Data parallelism is the obvious choice (BERT fits a GPU), so
the question is entirely about the gradient all-reduce: how many bytes per step, over which
links, how much of it hides behind backward. This module holds the parts that need no
processes:

* **the task** (:func:`sentence_task`): is a line of Shakespeare a statement, a question or
  an exclamation, once its final mark is removed (tiny-shakespeare, shipped with labkit)?
  Byte-level tokens plus BERT's ``[CLS]``/``[SEP]``/``[PAD]``; balanced classes and a
  deterministic split (every fifth sentence of a type is validation);
* **the arithmetic**: gradient bytes per step (fp32, fp16, PowerSGD rank ``r``;
  :func:`gradient_bytes`), the alpha-beta all-reduce time on ``n`` nodes of ``k`` ranks, flat
  ring against hierarchical (:func:`allreduce_times`), and the strong-scaling prediction
  ``step(N) = compute / N + exposed communication`` (:func:`strong_scaling_prediction`);
* **the single-process baseline** (:func:`train_baseline`): the tiny config learns the task.

The measurements on the emulated cluster live in :mod:`labkit.measure.cluster`.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from labkit.collectives.cost_model import (
    AlphaBeta,
    flat_ring_two_level_time,
    hierarchical_all_reduce_time,
)
from labkit.data.shakespeare import load_text
from labkit.ddp.compression import PowerSGD, matrix_shape, powersgd_numel
from labkit.models.bert import Bert, BertConfig, bert_loss, bert_preset

__all__ = [
    "CLS",
    "PAD",
    "SEP",
    "LABELS",
    "SentenceTask",
    "allreduce_times",
    "gradient_bytes",
    "sentence_task",
    "strong_scaling_prediction",
    "train_baseline",
]

# Byte-level vocabulary: ids 0..255 are bytes, then BERT's special tokens (vocab 260, the
# "lab" preset's). [MASK] is reserved for masked-LM pre-training, unused by fine-tuning.
PAD, CLS, SEP, MASK = 256, 257, 258, 259

# Sentence types, told apart by their words once the final mark is removed: "what", "why",
# "how", "wilt thou" ask; "O", "alas", "fie" exclaim. Chance is 1/3 (the classes are balanced).
LABELS = ("statement", "question", "exclamation")
_MARKS = ".?!"


@dataclass(frozen=True)
class SentenceTask:
    """Classification tensors: ``ids`` (N, T) token ids, ``mask`` (N, T) True on real tokens,
    ``labels`` (N,) index into ``names``."""

    ids: torch.Tensor
    mask: torch.Tensor
    labels: torch.Tensor
    names: tuple[str, ...]

    def __len__(self) -> int:
        return int(self.labels.numel())

    def batch(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(ids, labels, mask)`` of the rows ``index``: the argument order of ``bert_loss``."""
        return self.ids[index], self.labels[index], self.mask[index]


@functools.lru_cache(maxsize=2)  # both splits scan the same text (0.4 s a scan)
def _sentences(text: str, longest: int) -> list[str]:
    """Every sentence of 12 to ``longest`` characters of the speeches (speaker lines dropped),
    whitespace collapsed, ending in its mark."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.endswith(":")]
    body = " ".join(lines)
    return [s.strip() for s in re.findall(rf"[^.?!]{{12,{longest}}}[.?!]", body)]


@functools.lru_cache(maxsize=8)
def sentence_task(split: str = "train", seq: int = 64, per_class: int = 1200) -> SentenceTask:
    """``[CLS] sentence [SEP]`` padded to ``seq``, the sentence's final mark removed.

    The first ``per_class`` distinct sentences of each type (in text order; a repeat of an
    earlier sentence is dropped), sentence ``i`` of a type in validation when ``i % 5 == 4``:
    deterministic, balanced, and no sentence appears in both splits.
    """
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    if seq < 16:
        raise ValueError(f"seq={seq} leaves no room for a sentence of 12 bytes plus [CLS] [SEP]")
    by_mark: dict[str, list[bytes]] = {m: [] for m in _MARKS}
    seen: set[bytes] = set()
    for s in _sentences(load_text(), seq - 1):
        data = s[:-1].strip().encode("utf-8")[: seq - 2]  # the mark removed
        if data not in seen:  # a repeated sentence ("My lord,") would leak across the split
            seen.add(data)
            by_mark[s[-1]].append(data)
    n = min(per_class, *(len(v) for v in by_mark.values()))
    rows: list[list[int]] = []
    labels: list[int] = []
    for label, mark in enumerate(_MARKS):
        for i, data in enumerate(by_mark[mark][:n]):
            if (i % 5 == 4) == (split == "val"):
                rows.append([CLS, *data, SEP] + [PAD] * (seq - 2 - len(data)))
                labels.append(label)
    ids = torch.tensor(rows, dtype=torch.long)  # (N, seq)
    return SentenceTask(ids, ids != PAD, torch.tensor(labels), LABELS)


def accuracy(model: nn.Module, task: SentenceTask) -> float:
    """Fraction of ``task``'s rows the model classifies right (eval mode, no gradients)."""
    was_training = model.training
    model.eval()
    with torch.no_grad():
        pred = model(task.ids, None, task.mask).argmax(-1)  # (N,)
    model.train(was_training)
    return float((pred == task.labels).float().mean())


def train_baseline(
    cfg: BertConfig | None = None,
    *,
    steps: int = 60,
    batch: int = 32,
    lr: float = 3e-3,
    seed: int = 0,
) -> dict[str, Any]:
    """One process, AdamW, ``steps`` steps of ``batch`` passages: the losses and the accuracy on
    the held-out split (the training split, four times its rows, is not evaluated)."""
    cfg = cfg or bert_preset("lab")
    train, val = sentence_task("train", cfg.max_position), sentence_task("val", cfg.max_position)
    torch.manual_seed(seed)
    model = Bert(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, len(train), (batch,), generator=g)
        loss = bert_loss(model, *train.batch(idx))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {
        "losses": losses,
        "val_accuracy": accuracy(model, val),
        "chance": 1 / len(LABELS),
    }


# ------------------------------------------------------------------------------ arithmetic
def gradient_bytes(cfg: BertConfig, scheme: str = "fp32") -> int:
    """Gradient bytes one rank sends into the all-reduce per optimizer step (flags left out).

    ``"fp32"``: 4 bytes per parameter; ``"fp16"``/``"bf16"``: 2 (torch's fp16 comm hook);
    ``"powersgd<r>"`` (e.g. ``"powersgd4"``): PowerSGD (Vogels et al. 2019) as
    :class:`labkit.ddp.compression.PowerSGD` sends it: each matrix ``n x m`` on which
    compression pays (``r (n + m) * 2 < n m``) as the factors ``P`` (n x r) and ``Q`` (m x r)
    in fp32, everything else (biases, LayerNorms, small matrices) whole:
    ``4 * (sum r (n + m) + the rest)``.
    """
    with torch.device("meta"):
        params = list(Bert(cfg).parameters())  # shapes only, no memory
    numel = sum(p.numel() for p in params)
    if scheme == "fp32":
        return 4 * numel
    if scheme in ("fp16", "bf16"):
        return 2 * numel
    found = re.fullmatch(r"powersgd([1-9][0-9]*)", scheme)
    if found is None:
        raise ValueError(f"unknown scheme {scheme!r}: expected fp32, fp16, bf16 or powersgd<r>")
    psgd = PowerSGD(rank=int(found.group(1)))
    values = 0
    for p in params:
        shape = matrix_shape(p)
        values += powersgd_numel(shape, psgd.rank) if shape and psgd.compresses(p) else p.numel()
    return 4 * values


def allreduce_times(
    nbytes: float,
    nodes: int,
    ranks_per_node: int,
    intra: AlphaBeta,
    inter: AlphaBeta,
) -> dict[str, float]:
    """Predicted seconds of one all-reduce of ``nbytes`` per rank on ``nodes`` x ``ranks_per_node``.

    ``"flat ring"``: one ring over all ranks, each of its ``2(p-1)`` steps bounded by the
    slow link when the ring crosses nodes; ``"hierarchical"``: reduce-scatter in the node,
    all-reduce across nodes, all-gather in the node (formulas in
    :mod:`labkit.collectives.cost_model`, one NIC per node).
    """
    if nodes * ranks_per_node == 1:
        return {"flat ring": 0.0, "hierarchical": 0.0}
    return {
        "flat ring": flat_ring_two_level_time(nbytes, nodes, ranks_per_node, intra, inter),
        "hierarchical": hierarchical_all_reduce_time(nbytes, nodes, ranks_per_node, intra, inter),
    }


def strong_scaling_prediction(
    compute_1node: float,
    nbytes: float,
    nodes: list[int] | tuple[int, ...],
    ranks_per_node: int,
    intra: AlphaBeta,
    inter: AlphaBeta,
    *,
    algorithm: str = "hierarchical",
    hidden: float = 0.0,
    parallel: int | None = None,
) -> dict[int, dict[str, float]]:
    """``{N: {"compute", "comm", "step", "speedup", "efficiency"}}`` at a fixed global batch.

    ``step(N) = compute_1node / N + max(0, comm(N) - hidden)``: the compute splits over the
    nodes, the all-reduce of ``nbytes`` does not shrink, and at most ``hidden`` seconds of it
    overlap backward (0: none, an upper bound on the step). Speed-up ``step(1) / step(N)``,
    efficiency speed-up / N. ``parallel``: at most this many nodes compute at once (emulated
    nodes sharing a machine's cores): the compute term becomes ``compute_1node / min(N,
    parallel)``.
    """
    if compute_1node <= 0 or hidden < 0 or (parallel is not None and parallel < 1):
        raise ValueError(
            f"need compute_1node > 0, hidden >= 0, parallel >= 1; got {compute_1node}, "
            f"{hidden}, {parallel}"
        )
    out: dict[int, dict[str, float]] = {}
    for n in nodes:
        comm = allreduce_times(nbytes, n, ranks_per_node, intra, inter)[algorithm]
        compute = compute_1node / min(n, parallel or n)
        out[n] = {"compute": compute, "comm": comm, "step": compute + max(0.0, comm - hidden)}
    comm1 = allreduce_times(nbytes, 1, ranks_per_node, intra, inter)[algorithm]
    base = compute_1node + max(0.0, comm1 - hidden)  # one node: its ranks still all-reduce
    for n, row in out.items():
        row["speedup"] = base / row["step"]
        row["efficiency"] = row["speedup"] / n
    return out
