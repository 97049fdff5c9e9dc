"""One configuration of the composition matrix in ONE process: its model, its data, its
reference run, and the comparison with what the ranks produced (see
:mod:`labkit.parallel.composed` for the ranks' side, :mod:`labkit.parallel.matrix` for the
configurations).

The model is lab 08's tiny GPT (``labkit.labs.threed.TINY``: vocabulary 64, 4 heads of 8,
8 positions) with the configuration's layers, tied or untied head, ``wpe`` frozen or not, and
optionally a *branch*: :class:`BranchEmbedding` adds ``extra(h)`` to the embedding of the
sequences whose first token is :data:`FLAG`. The data puts FLAG only in the first sequence of
the first micro-batch of step 0, which belongs to data-parallel replica 0: in step 0 one
replica runs the branch and the other does not; in step 1 nobody does, so AdamW must leave
``extra`` alone (its ``.grad`` stays None, as in the reference).

Tolerances follow the precision, as ``|got - ref| <= atol + rtol |ref|`` on every parameter
after every step and on every loss:

* fp32: 2e-5 (as tests/test_threed.py): reordered fp32 sums over 2 steps of AdamW at lr 0.5.
* bf16 / fp16 autocast: the reference runs the same autocast (and the same loss scaler) in
  one process, but tensor parallelism splits each matmul's reduction into per-rank partial
  products, each rounded to 16 bits before the sum, and the dp/tp reductions add in another
  order. One 16-bit rounding moves a value by at most the unit roundoff u (bf16 2^-8, fp16
  2^-11); a gradient element passes through a few such roundings, so it may move by
  ~k u relative, k = 4. With eps = 1, AdamW's update is ~lr g, so a parameter after a step may
  differ by ~lr k u |g|, |g| <= 1 here: atol = lr 4 u = 0.5 * 4 * 2^-8 = 0.0078 (bf16),
  0.5 * 4 * 2^-11 = 0.00098 (fp16); rtol = 4 u too, on the losses as well. Measured: the
  largest error of a passing configuration is 0.12 of its tolerance (bf16) and 0.09 (fp16);
  skipping the dp average is 25 (bf16) and 197 (fp16) times over it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from labkit.experts.model import moe_gpt
from labkit.experts.router import TopKRouter
from labkit.models.gpt import GPT, GPTConfig, lm_loss
from labkit.models.moe import MoEConfig
from labkit.parallel.matrix import Combo
from labkit.precision.loss_scaler import DynamicLossScaler
from labkit.reference import Trace, first_divergence, first_mismatch, train_reference
from labkit.zero.adam import AdamConfig

__all__ = [
    "ADAM",
    "FLAG",
    "BranchEmbedding",
    "ScaleGrad",
    "batch",
    "build_model",
    "compare",
    "model_config",
    "reference",
    "tolerance",
]

TINY = GPTConfig(vocab_size=64, block_size=8, n_layer=4, n_head=4, n_embd=32)  # lab 08's
SEQ, MICRO_BATCH, SEED, STEPS = 8, 2, 0, 2
FLAG = 0  # a sequence starting with this token takes the branch
# eps = 1: the update is nearly proportional to the gradient, so a gradient summed instead
# of averaged shows (with a tiny eps AdamW is scale-invariant); lab 08's choice.
ADAM = AdamConfig(lr=0.5, eps=1.0)
INIT_SCALE = 2.0**12  # the fp16 loss scale: gradients of this tiny model stay finite
# Dense routing (16 bits, see moe_config) weights experts by their gates alone; the router's
# N(0, 0.02) init gives gates within ~10% of 1/E, so this gain spreads the logits (std ~1.1):
# one expert taking another's gate moves parameters 11x the bf16 tolerance, not 1.6x.
ROUTER_GAIN = 10.0
UNIT_ROUNDOFF = {"fp32": 0.0, "bf16": 2.0**-8, "fp16": 2.0**-11}
AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def model_config(combo: Combo) -> GPTConfig:
    return TINY.with_(n_layer=combo.layers, tie_weights=combo.tied)


class BranchEmbedding(nn.Module):
    """``inner(idx)`` plus ``extra`` on the rows whose first token is :data:`FLAG`; no graph
    through ``extra`` when no row is flagged (AwkwardNet's ``extra``, in a GPT)."""

    def __init__(self, inner: nn.Module, extra: nn.Linear) -> None:
        super().__init__()
        self.inner, self.extra = inner, extra

    @property
    def weight(self) -> Any:  # the tied Parameter, where the pipeline looks for it
        return self.inner.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.inner(idx)  # (B, T, d), or (B, T/t, d) under sequence parallelism
        rows = (idx[:, 0] == FLAG).nonzero().flatten()  # (n_flagged,)
        if rows.numel() == 0:
            return h
        return h.index_add(0, rows, self.extra(h[rows]).to(h.dtype))


def make_extra(cfg: GPTConfig) -> nn.Linear:
    torch.manual_seed(SEED + 1)
    return nn.Linear(cfg.n_embd, cfg.n_embd)


def moe_config(combo: Combo) -> MoEConfig:
    """The matrix's MoE GPT (ep != "0"): 4 experts, top-2 in fp32 and all 4 (dense routing)
    under bf16/fp16 autocast, expert width 32 (splits over tp), dropless and without the
    auxiliary losses: a cp rank routes T/cp tokens of a micro-batch, so capacity and the
    balancing loss (functions of the routing group) would differ from one process's;
    tests/test_experts.py proves capacity, drops and the losses.

    Why dense under 16 bits: a top-k choice is discontinuous, and a parallel run's hidden
    states legitimately differ from one process's by 16-bit roundings (tp's partial products,
    cp's split softmax): 2^-8 relative in bf16. A router whose choice varies over tokens has a
    tie somewhere, so some of a configuration's hundreds of routings land within that noise of
    one: in zero2/tp2/bf16 (4 ranks) one token of the 320 routed in step 0 has fp32
    probabilities 0.24836 and 0.24832 for experts 0 and 2, the tp run picks expert 2, and
    ``experts.b2`` is off by 1.1x the bf16 tolerance after one step (rounding the probabilities to
    bf16 before top-k hid most such ties, and the router must not: issue 34, defect 9). With
    k = E every token reaches every expert, the gates stay continuous in the logits (the
    router still learns, compared after every step), and fp32 configurations keep top-2 with
    uneven expert loads. Dense routers start ROUTER_GAIN times wider (:func:`build_model`)."""
    top_k = 2 if combo.precision == "fp32" else 4
    return MoEConfig(
        model_config(combo), n_experts=4, top_k=top_k, expert_d_ff=32, capacity_factor=None,
        aux_coef=0.0, z_coef=0.0,
    )  # fmt: skip


def build_model(combo: Combo, *, branch: bool = True) -> GPT:
    """The full GPT of ``combo`` from one seed (``branch=False``: without the branch, which
    the ranks add after tensor parallelism, see :func:`add_branch`); a MoE GPT if ep != "0"."""
    torch.manual_seed(SEED)
    model = GPT(model_config(combo)) if combo.ep == "0" else moe_gpt(moe_config(combo))
    if combo.ep != "0" and moe_config(combo).top_k == moe_config(combo).n_experts:
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, TopKRouter):
                    m.proj.weight.mul_(ROUTER_GAIN)  # (E, d)
    model.wpe.weight.requires_grad_(not combo.frozen)
    if combo.branch and branch:
        add_branch(model)
    return model


def add_branch(gpt: Any, sequence_parallel: bool = False) -> Any:
    """Wrap ``gpt.wte`` (plain or vocab-parallel) in a :class:`BranchEmbedding`. Under
    sequence parallelism ``extra`` sees this rank's tokens only: partial gradients, summed
    over tp like the LayerNorms' (``sequence_parallel`` marks them)."""
    extra = make_extra(gpt.cfg)
    for p in extra.parameters():
        p.sequence_parallel = sequence_parallel  # type: ignore[attr-defined]
    gpt.wte = BranchEmbedding(gpt.wte, extra)
    return gpt


def batch(combo: Combo, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: tokens and targets (2 * accum, MICRO_BATCH, SEQ); replica
    d takes micro-batches [d accum, (d + 1) accum)."""
    g = torch.Generator().manual_seed(1000 + step)
    n = 2 * combo.accum
    data = torch.randint(1, TINY.vocab_size, (n, MICRO_BATCH, SEQ + 1), generator=g)
    if step == 0:
        data[0, 0, 0] = FLAG  # replica 0's first sequence takes the branch; nobody else
    return data[:, :, :-1], data[:, :, 1:]


class ScaleGrad(torch.autograd.Function):
    """Identity forward, gradient times ``scale`` backward: ``scaler.scale(loss)`` without
    changing the loss value the executor sums (its backward is the same multiplication)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        return g * ctx.scale, None


def autocast(combo: Combo) -> Any:
    dtype = AUTOCAST.get(combo.precision)
    return torch.autocast("cpu", dtype=dtype, enabled=dtype is not None)


def norm_name(name: str, tied: bool) -> str:
    """A parameter's name in the unsharded model without wrappers (the tied head is wte)."""
    name = name.replace(".inner", "").replace(".block.", ".")
    return "wte.weight" if tied and name == "head.weight" else name


class _ScaledAdamW:
    """What ``train_reference`` steps: AdamW through the loss scaler (fp16), or plain."""

    def __init__(self, opt: torch.optim.Optimizer, scaler: DynamicLossScaler | None) -> None:
        self.opt, self.scaler = opt, scaler

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.opt.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        if self.scaler is None:
            self.opt.step()
            return
        self.scaler.step(self.opt)
        self.scaler.update()


def reference(combo: Combo, replicas: int | None = None) -> Trace:
    """Single-process gradient accumulation over all 2 * accum micro-batches of every step,
    torch's AdamW, the same autocast and loss scaler (``replicas=1``: replica 0's
    micro-batches only, a negative control; with cp = 2 there is one replica, 1 x accum
    micro-batches, each split along the sequence). Parameter names: :func:`norm_name`."""
    model = build_model(combo)
    a = ADAM
    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=a.lr, betas=a.betas, eps=a.eps, weight_decay=a.weight_decay,
    )  # fmt: skip
    scaler = DynamicLossScaler(INIT_SCALE) if combo.precision == "fp16" else None

    def loss_fn(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with autocast(combo):
            loss = lm_loss(m(x).float(), y)
        return loss if scaler is None else ScaleGrad.apply(loss, scaler.get_scale())

    if replicas is None:
        replicas = 2 // combo.cp_degree
    keep = replicas * combo.accum
    steps = [list(zip(*(t[:keep] for t in batch(combo, s)))) for s in range(STEPS)]
    trace = train_reference(model, _ScaledAdamW(opt, scaler), steps, loss_fn)  # type: ignore[arg-type]
    trace.params = [{norm_name(n, False): p for n, p in snap.items()} for snap in trace.params]
    return trace


def tolerance(combo: Combo) -> tuple[float, float]:
    """(atol, rtol) from the precision: see the module docstring for the arithmetic."""
    u = UNIT_ROUNDOFF[combo.precision]
    return (2e-5, 2e-5) if u == 0.0 else (ADAM.lr * 4 * u, 4 * u)


def compare(combo: Combo, per_rank: list[dict[str, Any]], ref: Trace) -> str | None:
    """None if every rank's parameters (after every step) and losses match ``ref``; else the
    first divergence, named. Every reference parameter must be held by some rank."""
    atol, rtol = tolerance(combo)
    for r in per_rank:
        if r.get("error"):
            return f"rank {r['rank']} raised: {r['error']}"
    held: set[str] = set()
    for r in per_rank:
        if not r["params"]:
            continue
        held |= set(r["params"][0])
        want = [{n: snap[n] for n in r["params"][0]} for snap in ref.params]
        miss = first_divergence(want, r["params"], atol, rtol)
        if miss is not None:
            return f"rank {r['rank']}: {miss}"
        if r["losses"][0] is not None:
            got, exp = torch.tensor(r["losses"]), torch.tensor(ref.losses)
            bad = first_mismatch(exp, got, atol, rtol)
            if bad is not None:
                return f"rank {r['rank']}: losses {r['losses']}, the reference's {ref.losses}"
    if missing := set(ref.params[0]) - held:
        return f"no rank holds {sorted(missing)}"
    return None


LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
