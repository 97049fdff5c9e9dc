"""A BERT-style encoder for sequence classification, from scratch (Devlin et al. 2019).

What makes it BERT rather than GPT (:mod:`labkit.models.gpt`):

* three embeddings summed: token, learned position and **segment** (token type: sentence A
  or B of a pair), then a LayerNorm;
* **bidirectional** self-attention: no causal mask, only a padding mask;
* **post-LN** blocks as in the paper (and in the original Transformer): ``x = LN(x + f(x))``;
* a **pooler** (``tanh(W h_[CLS] + b)``) and a classification head on the ``[CLS]`` token:
  fine-tuning for classification trains every parameter plus this small head.

The model never knows it is distributed: ``labkit.ddp`` wraps it unchanged. For data
parallelism what matters is that *every* parameter gets a gradient every step, so each step
all-reduces the whole model: ~110M values for BERT-base, ~335M for BERT-large.

Parameter count (:func:`count_params`, tested against the module and against the published
BERT-base 110M / BERT-large 340M)::

    embeddings   (vocab + positions + segments) * H + 2H          (the LayerNorm)
    per layer    attention  4H^2 + 4H   (q, k, v, output, with biases)
                 FFN        2 H I + I + H  (H -> I -> H, with biases; I = 4H)
                 2 LayerNorms  4H
    pooler       H^2 + H
    classifier   H * labels + labels

BERT-base (L=12, H=768, I=3072, vocab 30,522, 512 positions, 2 segments):
(30522 + 512 + 2) * 768 + 1536 + 12 * 7,087,872 + 590,592 = 109,482,240 without the head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.nn import functional as F

__all__ = [
    "BERT_PRESETS",
    "Bert",
    "BertConfig",
    "bert_loss",
    "bert_preset",
    "count_params",
]


@dataclass(frozen=True)
class BertConfig:
    """The shape of a BERT encoder with a classification head."""

    vocab_size: int = 30522
    max_position: int = 512
    type_vocab_size: int = 2  # segments A and B
    n_layer: int = 12
    n_head: int = 12
    hidden: int = 768
    intermediate: int = 3072  # the FFN's inner width, 4 * hidden in every published BERT
    num_labels: int = 2
    dropout: float = 0.1
    ln_eps: float = 1e-12
    init_std: float = 0.02  # BERT's initializer range; larger for a from-scratch lab model

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "max_position",
            "type_vocab_size",
            "n_layer",
            "n_head",
            "hidden",
            "intermediate",
            "num_labels",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.hidden % self.n_head != 0:
            raise ValueError(f"hidden={self.hidden} must be divisible by n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout} must be in [0, 1)")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_head

    def with_(self, **changes: object) -> BertConfig:
        """A copy with some fields changed (the config is frozen)."""
        return replace(self, **changes)  # type: ignore[arg-type]


# Devlin et al. 2019, section 3: BERT-base (L=12, H=768, A=12) and BERT-large (L=24, H=1024,
# A=16), uncased WordPiece vocabulary of 30,522, 512 positions. "lab": a shape that trains in
# seconds on a CPU core (vocabulary of :mod:`labkit.labs.bert4nodes`: bytes plus 4 specials).
BERT_PRESETS: dict[str, BertConfig] = {
    "bert-base": BertConfig(),
    "bert-large": BertConfig(n_layer=24, n_head=16, hidden=1024, intermediate=4096),
    "lab": BertConfig(
        vocab_size=260,
        max_position=64,
        n_layer=2,
        n_head=4,
        hidden=64,
        intermediate=256,
        num_labels=3,
        dropout=0.0,
        ln_eps=1e-5,
        init_std=0.3,
    ),
}


def bert_preset(name: str, **changes: object) -> BertConfig:
    """The named config, optionally with some fields changed:
    ``bert_preset("bert-base", num_labels=3)``."""
    if name not in BERT_PRESETS:
        raise ValueError(f"unknown BERT preset {name!r}; expected one of {sorted(BERT_PRESETS)}")
    return BERT_PRESETS[name].with_(**changes) if changes else BERT_PRESETS[name]


def count_params(cfg: BertConfig, *, head: bool = True) -> int:
    """Parameters of ``Bert(cfg)`` by arithmetic (module docstring); ``head=False`` leaves out
    the classifier, the count papers quote."""
    h, i = cfg.hidden, cfg.intermediate
    embeddings = (cfg.vocab_size + cfg.max_position + cfg.type_vocab_size) * h + 2 * h
    attention = 4 * h * h + 4 * h
    ffn = 2 * h * i + i + h
    per_layer = attention + ffn + 4 * h  # two LayerNorms
    pooler = h * h + h
    classifier = h * cfg.num_labels + cfg.num_labels if head else 0
    return embeddings + cfg.n_layer * per_layer + pooler + classifier


class SelfAttention(nn.Module):
    """Bidirectional multi-head attention; padded keys are masked out."""

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.head_dim
        self.q = nn.Linear(cfg.hidden, cfg.hidden)
        self.k = nn.Linear(cfg.hidden, cfg.hidden)
        self.v = nn.Linear(cfg.hidden, cfg.hidden)
        self.out = nn.Linear(cfg.hidden, cfg.hidden)
        self.attn_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        """x: (B, T, H); key_mask: (B, T) bool, True where a token may be attended to."""
        B, T, H = x.shape
        # (B, T, H) -> (B, T, heads, hd) -> (B, heads, T, hd)
        q, k, v = (
            lin(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
            for lin in (self.q, self.k, self.v)
        )
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)  # (B, heads, T, T)
        if key_mask is not None:
            # (B, T) -> (B, 1, 1, T): every head and every query sees the same padding
            att = att.masked_fill(~key_mask[:, None, None, :], float("-inf"))
        y = self.attn_drop(F.softmax(att, dim=-1)) @ v  # (B, heads, T, hd)
        y = y.transpose(1, 2).reshape(B, T, H)  # (B, heads, T, hd) -> (B, T, H)
        return self.out(y)


class EncoderLayer(nn.Module):
    """Post-LN: ``x = LN(x + attn(x)); x = LN(x + ffn(x))`` (BERT's order, not GPT-2's)."""

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.attn = SelfAttention(cfg)
        self.ln1 = nn.LayerNorm(cfg.hidden, eps=cfg.ln_eps)
        self.fc = nn.Linear(cfg.hidden, cfg.intermediate)
        self.proj = nn.Linear(cfg.intermediate, cfg.hidden)
        self.ln2 = nn.LayerNorm(cfg.hidden, eps=cfg.ln_eps)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        x = self.ln1(x + self.drop(self.attn(x, key_mask)))
        return self.ln2(x + self.drop(self.proj(F.gelu(self.fc(x)))))


class Bert(nn.Module):
    """Encoder plus pooler plus classifier: ``forward(ids, segments, mask) -> (B, labels)``."""

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.pos = nn.Embedding(cfg.max_position, cfg.hidden)
        self.seg = nn.Embedding(cfg.type_vocab_size, cfg.hidden)
        self.ln_emb = nn.LayerNorm(cfg.hidden, eps=cfg.ln_eps)
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.n_layer))
        self.pooler = nn.Linear(cfg.hidden, cfg.hidden)
        self.classifier = nn.Linear(cfg.hidden, cfg.num_labels)
        for module in self.modules():
            # BERT's truncated-normal(init_std) initialisation, as a plain normal. 0.02 suits
            # fine-tuning from pre-trained weights; trained from scratch for a few dozen steps,
            # the tiny model's [CLS] barely sees the other tokens at that scale.
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=cfg.init_std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def encode(
        self,
        ids: torch.Tensor,
        segments: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(B, T) token ids [, (B, T) segment ids, (B, T) bool mask] -> (B, T, H) states."""
        T = ids.shape[1]
        if T > self.cfg.max_position:
            raise ValueError(f"sequence length {T} exceeds max_position {self.cfg.max_position}")
        pos = torch.arange(T, device=ids.device)  # (T,), broadcast over the batch
        seg = torch.zeros_like(ids) if segments is None else segments
        x = self.drop(self.ln_emb(self.tok(ids) + self.pos(pos) + self.seg(seg)))  # (B, T, H)
        for layer in self.layers:
            x = layer(x, mask)
        return x

    def forward(
        self,
        ids: torch.Tensor,
        segments: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Class logits (B, num_labels) from the pooled first ([CLS]) position."""
        h = self.encode(ids, segments, mask)  # (B, T, H)
        pooled = torch.tanh(self.pooler(h[:, 0]))  # (B, H): the [CLS] position
        return self.classifier(self.drop(pooled))


def bert_loss(
    model: nn.Module,
    ids: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of the classifier: the loss callable the training loops take."""
    return F.cross_entropy(model(ids, None, mask), labels)
