"""A GPT-2 style decoder in the spirit of nanoGPT: pre-LayerNorm blocks, tied embeddings.

The model never knows it is distributed: tensor, pipeline and data parallelism are built by
*transforming* it (``labkit.tensor_parallel``, ``labkit.pipeline``, ``labkit.ddp``/``zero``),
never by flags inside it. Three choices make those transforms natural:

* separate ``q``/``k``/``v`` projections, so sharding attention by heads is a column split of
  each one (Megatron-LM, Shoeybi et al. 2019, section 3);
* the loss lives outside ``forward`` (:func:`lm_loss`): ``forward`` returns logits, so a
  pipeline's last stage or a vocab-parallel cross-entropy can replace the loss;
* the embedding (``wte``, ``wpe``, ``drop``), the ``blocks`` and the head (``ln_f``, ``head``)
  are attributes a pipeline can cut into stages (see :meth:`GPT.embed` and :meth:`GPT.logits`).

Parameter count (:meth:`GPTConfig.num_params`, tested against the module built on the meta
device and against the published GPT-2 counts)::

    per block   attention 4d^2 + 4d   (q, k, v, proj with biases)
                MLP       8d^2 + 5d   (fc d->4d with bias 4d, proj 4d->d with bias d)
                2 LayerNorms    4d
                = 12d^2 + 13d
    embeddings  (vocab + block_size) * d   (the head is tied to wte unless tie_weights=False)
    final LN    2d

GPT-2 small: 12 * (12 * 768^2 + 13 * 768) + (50257 + 1024) * 768 + 2 * 768 = 124,439,808.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 65  # tiny-shakespeare characters
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256
    dropout: float = 0.0
    tie_weights: bool = True
    # "sdpa": F.scaled_dot_product_attention (fused kernels where the device has them);
    # "explicit": softmax(q k^T / sqrt(hd)) v written out, for teaching. Same numbers.
    attention: str = "sdpa"

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.attention not in ("sdpa", "explicit"):
            raise ValueError(f"attention={self.attention!r}: expected 'sdpa' or 'explicit'")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def num_params(self) -> int:
        d, L = self.n_embd, self.n_layer
        per_block = 12 * d * d + 13 * d  # q,k,v,proj 4d^2+4d, mlp 8d^2+5d, two LayerNorms 4d
        embeddings = self.vocab_size * d + self.block_size * d
        head = 0 if self.tie_weights else self.vocab_size * d
        return L * per_block + embeddings + 2 * d + head

    def with_(self, **changes: object) -> GPTConfig:
        """A copy with some fields changed (the config is frozen)."""
        return replace(self, **changes)  # type: ignore[arg-type]


GPT2_VOCAB = 50257

# Named shapes. GPT-2's four (Radford et al. 2019; 1,024 positions) and the "GPT-2 1.3B" of
# the interview scenario, which is GPT-3 XL's shape (Brown et al. 2020, Table 2.1: 24 layers,
# d_model 2048, 2,048 positions). The GPT-3 paper lists 24 heads of 128, but 24 * 128 = 3072
# != 2048 and 2048 / 24 is not an integer, so we use 16 heads of 128 (d_model / d_head).
PRESETS: dict[str, GPTConfig] = {
    "gpt2": GPTConfig(vocab_size=GPT2_VOCAB, block_size=1024, n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": GPTConfig(
        vocab_size=GPT2_VOCAB, block_size=1024, n_layer=24, n_head=16, n_embd=1024
    ),
    "gpt2-large": GPTConfig(
        vocab_size=GPT2_VOCAB, block_size=1024, n_layer=36, n_head=20, n_embd=1280
    ),
    "gpt2-xl": GPTConfig(
        vocab_size=GPT2_VOCAB, block_size=1024, n_layer=48, n_head=25, n_embd=1600
    ),
    "gpt2-1.3b": GPTConfig(
        vocab_size=GPT2_VOCAB, block_size=2048, n_layer=24, n_head=16, n_embd=2048
    ),
    # Tiny shapes the labs run on a laptop CPU (character vocabulary of tiny-shakespeare).
    "tiny": GPTConfig(vocab_size=65, block_size=64, n_layer=2, n_head=4, n_embd=64),
    "small-lab": GPTConfig(vocab_size=65, block_size=128, n_layer=4, n_head=4, n_embd=256),
}


def preset(name: str, **changes: object) -> GPTConfig:
    """The named config, optionally with fields changed: ``preset("gpt2", dropout=0.1)``."""
    if name not in PRESETS:
        raise ValueError(f"unknown GPT preset {name!r}; expected one of {sorted(PRESETS)}")
    return PRESETS[name].with_(**changes) if changes else PRESETS[name]


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.head_dim
        self.attention = cfg.attention
        self.q = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.k = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.v = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.p_drop = cfg.dropout
        self.attn_drop = nn.Dropout(cfg.dropout)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # n_head is read from the projection's width, not the config: a tensor-parallel
        # transform that keeps n_head / tp heads per rank shrinks q/k/v and nothing else.
        heads = self.q.out_features // self.head_dim
        # (B, T, heads * hd) -> (B, heads, T, hd)
        q, k, v = (
            lin(x).view(B, T, heads, self.head_dim).transpose(1, 2)
            for lin in (self.q, self.k, self.v)
        )
        if self.attention == "sdpa":
            p = self.p_drop if self.training else 0.0
            # (B, h, T, hd)
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)  # (B, h, T, T)
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            att = self.attn_drop(F.softmax(att.masked_fill(~mask, float("-inf")), dim=-1))
            y = att @ v  # (B, h, T, hd)
        y = y.transpose(1, 2).reshape(B, T, heads * self.head_dim)  # (B, h, T, hd) -> (B, T, h*hd)
        return self.dropout(self.proj(y))


class MLPBlock(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLPBlock(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.head.weight = self.wte.weight  # one Parameter, two uses
        self.apply(self._init_weights)
        # GPT-2: scale the residual projections by 1/sqrt(2 * n_layer), so the residual
        # stream's variance does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # N(0, 0.02) as in GPT-2: with PyTorch's N(0, 1) embeddings, tied to the head, the
        # first logits are huge and the initial loss is ~40x ln(vocab) instead of ~ln(vocab).
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """(B, T) token ids -> (B, T, d): token plus position embedding, then dropout."""
        T = idx.shape[1]
        if T > self.cfg.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.cfg.block_size}")
        pos = torch.arange(T, device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, d)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, d) -> (B, T, vocab): final LayerNorm and the (tied) output projection."""
        return self.head(self.ln_f(x))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """idx: (B, T) token ids. Returns logits (B, T, vocab); the loss is :func:`lm_loss`."""
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.logits(x)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy: logits (B, T, V), targets (B, T) -> scalar."""
    B, T, V = logits.shape
    return F.cross_entropy(logits.reshape(B * T, V), targets.reshape(B * T))


def gpt_loss(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``lm_loss(model(idx), targets)``: the loss callable the step-measuring helpers take."""
    return lm_loss(model(idx), targets)


def count_params_meta(cfg: GPTConfig) -> int:
    """Parameters of ``GPT(cfg)`` built on the meta device (no memory), a tied weight once."""
    with torch.device("meta"):
        model = GPT(cfg)
    return sum(p.numel() for p in model.parameters())  # parameters() yields a shared one once
