"""Gradient compression for DDP: send fewer bytes per step, keep the average (nearly) right.

The contract, one method (:meth:`Compression.all_reduce_mean`). The DDP wrapper packs a
bucket as ``[grad_0, ..., grad_k, used_0, ..., used_k]`` (:meth:`DataParallel.pack`) and, when
built with ``compression=``, hands that buffer over instead of calling ``comm.all_reduce``.
On return::

    buf[:n]  ~  (1 / world_size) * sum_r grad_r      the MEAN over ranks (approximate)
    buf[n:]  ==  sum_r used_r                          the used flags' SUM, exact

so a parameter no rank used still keeps ``grad=None``. Every byte goes through the wrapper's
``comm.all_reduce``: ``comm.sent`` counts what really went on the wire, and compression
composes with any ``Comm`` implementation (``"torch"``, ``"ring"``, ``"hierarchical"``).

* :class:`Fp16Compression`: cast to fp16 / bf16, as torch's ``fp16_compress_hook``: half the
  bytes; the error of the average is a few units in the last place of the 16-bit format.
* :class:`PowerSGD`: rank-``r`` approximation of every matrix (Vogels, Karimireddy & Jaggi,
  "PowerSGD: Practical Low-Rank Gradient Compression for Distributed Optimization",
  NeurIPS 2019), with error feedback: an ``n x m`` gradient costs ``r (n + m)`` numbers.

Usage: ``OverlappedDDP(net, comm=comm, compression=PowerSGD(rank=2))``. A compression object
keeps per-parameter state (PowerSGD's errors and ``Q``): one object per wrapper.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import nn

from labkit.collectives.comm import Comm

__all__ = [
    "COMPRESSIONS",
    "Compression",
    "Fp16Compression",
    "PowerSGD",
    "make_compression",
    "matrix_shape",
    "powersgd_numel",
]


class Compression:
    """How a packed bucket is averaged over ranks (the base: exact, uncompressed)."""

    def all_reduce_mean(self, buf: torch.Tensor, params: list[nn.Parameter], comm: Comm) -> None:
        """``buf = [grads (n), used flags (len(params))]`` -> ``[mean of grads, sum of flags]``."""
        n = buf.numel() - len(params)
        comm.all_reduce(buf)
        buf[:n].div_(comm.world_size)


@dataclass
class Fp16Compression(Compression):
    """Gradients travel as ``dtype`` (float16 or bfloat16): half of fp32's bytes.

    As torch's ``fp16_compress_hook``, with one change: divide by ``world_size`` *before* the
    cast (torch casts, then divides in fp16), so each rank's term is rounded once and the sum
    of ``W`` terms, each at most ``max / W``, cannot overflow fp16's 65504.

    Error bound (``u`` = unit roundoff: fp16 ``2**-11``, bf16 ``2**-8``): one rounding at the
    cast and ``W - 1`` additions in the 16-bit format give, per element,
    ``|mean_hat - mean| <= gamma_W * mean_r |grad_r|`` with ``gamma_W = W u / (1 - W u)``
    (Higham's summation bound), plus fp16's subnormal spacing ``2**-24`` per rounding for
    gradients below ``2**-14``. The used flags travel undivided: 0/1 sums stay exact integers
    up to 2048 ranks in fp16, 256 in bf16, and a zero sum (what ``unpack`` tests) is exact always.
    """

    dtype: torch.dtype = torch.float16

    def __post_init__(self) -> None:
        if self.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"Fp16Compression dtype must be float16 or bfloat16, got {self.dtype}")

    def all_reduce_mean(self, buf: torch.Tensor, params: list[nn.Parameter], comm: Comm) -> None:
        n = buf.numel() - len(params)
        low = torch.empty(buf.numel(), dtype=self.dtype, device=buf.device)
        torch.div(buf[:n], comm.world_size, out=low[:n])  # computed in fp32, rounded once
        low[n:] = buf[n:]  # used flags, undivided
        comm.all_reduce(low)  # 2 bytes per element on the wire
        buf.copy_(low)


def matrix_shape(p: nn.Parameter) -> tuple[int, int] | None:
    """The ``(n, m)`` PowerSGD sees: ``(out, in)`` for a Linear, ``(out, in*kh*kw)`` for a conv
    kernel; None for vectors (biases, norms), which are sent uncompressed."""
    if p.dim() <= 1:
        return None
    return p.shape[0], p.numel() // p.shape[0]


def powersgd_numel(shape: tuple[int, int], rank: int) -> int:
    """Numbers sent for one ``n x m`` matrix at rank ``r``: ``P`` (n x r) and ``Q`` (m x r)."""
    n, m = shape
    r = min(rank, n, m)
    return r * (n + m)


def orthonormalize(p: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning ``p``'s (n x r, r <= n), in ``p``'s dtype. Householder QR:
    stays orthonormal to machine precision even for rank-deficient ``p`` (a gradient of rank
    < r), where plain Gram-Schmidt would normalise rounding noise into a direction that is not
    orthogonal.

    16-bit ``p`` (bf16 / fp16 gradients): ``torch.linalg.qr`` has no kernel for them. torch's
    own PowerSGD hook (``powerSGD_hook._orthogonalize``) switches to Gram-Schmidt in the 16-bit
    dtype there; we upcast instead: QR on an fp32 copy, then one rounding of ``Q`` back. Why:
    ``P`` is only n x r (the upcast costs 4 n r bytes, nothing next to the n x m gradient);
    Gram-Schmidt in 16 bits squares each column in fp16 (it can overflow, torch's comment
    warns), divides a zero column by a zero norm (nan, unless an epsilon is set), and loses
    orthogonality in proportion to the unit roundoff times the condition of ``p``; the upcast
    keeps the fp32 algorithm, so the 16-bit path differs from fp32 only by the rounding of its
    inputs and of ``Q`` (orthonormal to within the 16-bit unit roundoff)."""
    if p.dtype in (torch.float16, torch.bfloat16):
        return torch.linalg.qr(p.float(), mode="reduced").Q.to(p.dtype)  # (n, r)
    return torch.linalg.qr(p, mode="reduced").Q  # (n, r)


@dataclass
class PowerSGD(Compression):
    """Rank-``rank`` PowerSGD with error feedback (Vogels et al. 2019, Algorithm 1 + EF).

    Per bucket, after ``start_iter`` exact syncs (a warm-up; before it: a plain all-reduce):

    1. vectors (``ndim <= 1``), matrices not worth compressing and the used flags: one exact
       all-reduce in one buffer;
    2. each matrix gradient, viewed as ``M`` (n x m), error added: ``M = grad + e``;
    3. ``P = M Q`` (n x r) for all matrices, all-reduced in one buffer: ``P = sum_r M_r Q``;
    4. ``P <- orthonormalize(P)`` (the same on every rank: the same input);
    5. ``Q = M^T P`` (m x r), all-reduced in one buffer: ``Q = sum_r M_r^T P``;
    6. ``M_hat = P Q^T / W = P P^T mean_r(M_r)``: the projection of the mean onto ``span(P)``,
       the same on every rank; the error ``e = M - M_hat`` stays on this rank.

    Bytes: an ``n x m`` matrix sends ``r (n + m)`` numbers instead of ``n m`` (a 784 x 128
    layer at rank 2: 1,824 instead of 100,352, 55x less). It is sent only if
    ``r (n + m) * min_compression_rate < n m`` (``min_compression_rate=1``: whenever it pays;
    ``0``: always, the exactness control: at ``rank >= min(n, m)`` ``M_hat`` is the exact mean).

    ``Q`` is one step of power iteration: ``warm_start`` reuses last step's ``Q``, so the
    subspace keeps improving across steps; the first ``Q`` comes from a generator seeded with
    ``seed`` (never the global RNG), so it is the same on every rank.

    Why error feedback: ``M_hat`` is biased (it drops every direction outside ``span(P)``);
    plain low-rank SGD can lose a direction forever. Feeding ``e`` back into the next step
    delays what was dropped instead of losing it. The invariant, over steps ``t = 1..T``::

        sum_t M_hat_t + mean_r e_r(T) == sum_t mean_r grad_r(t)

    i.e. everything the ranks computed is applied, only later. A matrix no rank used in a step
    (the used counts say so, identically everywhere) is skipped: its ``grad`` stays None and
    its error is carried over unchanged, which keeps the invariant. Memory: one error tensor
    the size of each compressed gradient, per rank.
    """

    rank: int = 1
    start_iter: int = 0
    min_compression_rate: float = 2.0
    error_feedback: bool = True
    warm_start: bool = True
    seed: int = 0
    errors: dict[int, torch.Tensor] = field(default_factory=dict, init=False, repr=False)
    qs: dict[int, torch.Tensor] = field(default_factory=dict, init=False, repr=False)
    syncs: dict[tuple[int, ...], int] = field(default_factory=dict, init=False, repr=False)
    # id -> parameter: holding the parameter keeps its id from being reused by another tensor
    _owners: dict[int, nn.Parameter] = field(default_factory=dict, init=False, repr=False)
    _generator: torch.Generator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.rank < 1 or self.start_iter < 0 or not self.min_compression_rate >= 0:
            raise ValueError(
                "PowerSGD needs rank >= 1, start_iter >= 0, min_compression_rate >= 0; got "
                f"rank={self.rank}, start_iter={self.start_iter}, "
                f"min_compression_rate={self.min_compression_rate}"
            )
        self._generator = torch.Generator().manual_seed(self.seed)

    def compresses(self, p: nn.Parameter) -> bool:
        """Whether ``p`` travels as ``P, Q``: a matrix on which compression pays enough."""
        shape = matrix_shape(p)
        if shape is None:
            return False
        return powersgd_numel(shape, self.rank) * self.min_compression_rate < p.numel()

    def _initial_q(self, p: nn.Parameter, shape: tuple[int, int]) -> torch.Tensor:
        r = min(self.rank, *shape)
        q = torch.randn(shape[1], r, generator=self._generator)  # (m, r), same on every rank
        return q.to(p.device, p.dtype)

    def all_reduce_mean(self, buf: torch.Tensor, params: list[nn.Parameter], comm: Comm) -> None:
        world_size = comm.world_size
        n = buf.numel() - len(params)
        key = tuple(id(p) for p in params)
        self.syncs[key] = self.syncs.get(key, 0) + 1
        if self.syncs[key] <= self.start_iter:  # warm-up: the exact average
            super().all_reduce_mean(buf, params, comm)
            return

        views, offset = [], 0
        for p in params:
            views.append(buf[offset : offset + p.numel()])  # (numel,)
            offset += p.numel()
        mats = [i for i, p in enumerate(params) if self.compresses(p)]  # few: a list will do

        # 1. Exact: vectors, small matrices and the used flags, in one buffer.
        exact = [v for i, v in enumerate(views) if i not in mats]
        flat = torch.cat([*exact, buf[n:]])  # (exact numel + len(params),)
        comm.all_reduce(flat)
        pieces = flat.split([v.numel() for v in exact] + [len(params)])
        for view, total in zip(exact, pieces):
            torch.div(total, world_size, out=view)
        buf[n:] = pieces[-1]
        used = pieces[-1].tolist()  # summed: identical on every rank
        live = [i for i in mats if used[i] > 0]  # no rank used it: grad stays None, e carried
        if not live:
            return

        # 2. M = grad + e (error feedback), Q from last step or from the seeded generator.
        ms, qs = [], []
        for i in live:
            p, shape = params[i], matrix_shape(params[i])
            assert shape is not None
            m = views[i].view(shape)  # (numel,) -> (n, m), a view into buf
            if self.error_feedback and id(p) in self.errors:
                m.add_(self.errors[id(p)])
            if not self.warm_start or id(p) not in self.qs:
                self.qs[id(p)] = self._initial_q(p, shape)
                self._owners[id(p)] = p
            ms.append(m)
            qs.append(self.qs[id(p)])

        # 3. P = M Q for every matrix, summed in one all-reduce; 4. orthonormalised.
        p_flat = torch.cat([(m @ q).reshape(-1) for m, q in zip(ms, qs)])  # (sum n_i r_i,)
        comm.all_reduce(p_flat)
        p_sizes = [m.shape[0] * q.shape[1] for m, q in zip(ms, qs)]
        p_mats = [
            orthonormalize(chunk.view(m.shape[0], q.shape[1]))  # (n_i r_i,) -> (n, r)
            for m, q, chunk in zip(ms, qs, p_flat.split(p_sizes))
        ]
        # 5. Q = M^T P for every matrix, summed in one all-reduce.
        q_flat = torch.cat([(m.T @ p).reshape(-1) for m, p in zip(ms, p_mats)])  # (sum m_i r_i,)
        comm.all_reduce(q_flat)
        q_sizes = [q.numel() for q in qs]
        # 6. M_hat = P Q^T / W replaces M in the buffer; e = M - M_hat stays here.
        for i, m, p_mat, q_sum, q in zip(live, ms, p_mats, q_flat.split(q_sizes), qs):
            q_sum = q_sum.view(q.shape)  # (m_i r_i,) -> (m, r)
            if self.error_feedback:
                if id(params[i]) not in self.errors:
                    self.errors[id(params[i])] = torch.empty_like(m)
                error = self.errors[id(params[i])]
                error.copy_(m)  # M = grad + e_prev
            torch.matmul(p_mat, q_sum.T, out=m)
            m.div_(world_size)
            if self.error_feedback:
                error.sub_(m)
            self.qs[id(params[i])] = q_sum  # warm start: next step's Q


COMPRESSIONS = ("none", "fp16", "bf16", "powersgd<r>", "powersgd<r>-noef")


def make_compression(name: str) -> Compression | None:
    """A fresh compression from its short name (labs and command lines), or None for "none".

    ``"fp16"``, ``"bf16"``, ``"powersgd<r>"`` (rank ``r``, error feedback),
    ``"powersgd<r>-noef"`` (without: the negative control). A bad name is refused here,
    before any process starts.
    """
    if name == "none":
        return None
    if name in ("fp16", "bf16"):
        return Fp16Compression(torch.float16 if name == "fp16" else torch.bfloat16)
    found = re.fullmatch(r"powersgd([1-9][0-9]*)(-noef)?", name)
    if found is None:
        raise ValueError(f"unknown compression {name!r}; expected one of {COMPRESSIONS}")
    return PowerSGD(rank=int(found.group(1)), error_feedback=found.group(2) is None)
