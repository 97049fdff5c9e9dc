"""Mixed-precision training from scratch: fp32 master weights, a bf16/fp16 compute copy.

The recipe (Micikevicius et al., "Mixed Precision Training", 2018)::

    master (fp32, owned by the optimizer) --round--> model params (bf16/fp16)
    forward + backward in bf16/fp16            -> grads (bf16/fp16)
    grads --copy to fp32--> master.grad --unscale, inf check--> optimizer.step() on master

Why keep fp32 master weights? An update is ``w - lr * g``. bf16 carries 8 significant
bits: near ``w = 1`` its spacing is 2^-7, so any update smaller than 2^-8 (about 0.004)
rounds back to ``w`` and is lost -- every step, forever. With lr 1e-3 most updates are
that small. The master copy accumulates them in fp32 (24 bits), and the compute copy is
re-rounded from it after each step, so many small updates add up to a visible change.

Why bring gradients back to fp32 before unscaling? ``g * S`` fits fp16, but ``g`` itself may
not (that was the point of scaling); dividing in fp32 keeps it. The optimizer state (Adam's
moments) lives in fp32 next to the master weights too.

Memory per parameter with Adam: 2 (bf16 weight) + 2 (bf16 grad) + 4 (master) + 4 (master
grad, transient) + 8 (moments) -- the "16 bytes per parameter" of the ZeRO paper counts
weight, grad, master and moments: 2 + 2 + 4 + 8.

PyTorch's ``torch.autocast`` does something different: weights stay fp32 and each op
casts its inputs on the fly. Here the cast happens once per step, on the weights.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from labkit.precision.loss_scaler import DynamicLossScaler

__all__ = [
    "MixedPrecisionTrainer",
    "PrecisionPolicy",
    "master_copy",
    "grads_to_master",
    "master_to_model",
]

COMPUTE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class PrecisionPolicy:
    """The recipe above as a policy on flat tensors, for optimizers that own their buffers
    (ZeRO shards them): compute in ``param_dtype``, update an fp32 master.

    With ``param_dtype=float32`` the parameters are their own master copy (no second fp32
    buffer: K = 8 bytes of Adam state per parameter instead of the paper's 12).
    """

    param_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.param_dtype not in COMPUTE_DTYPES:
            raise ValueError(
                f"param_dtype must be float32, bfloat16 or float16, got {self.param_dtype}"
            )

    @property
    def keeps_master(self) -> bool:
        return self.param_dtype != torch.float32

    def master_of(self, params32: torch.Tensor) -> torch.Tensor:
        """The fp32 master of ``params32`` (an fp32 tensor): a copy, or itself in fp32 training."""
        return params32.clone() if self.keeps_master else params32

    def grad_to_master(self, grad: torch.Tensor, divide_by: int = 1) -> torch.Tensor:
        """``float32(grad) / divide_by``: a new tensor for a 16-bit ``grad``; an fp32 ``grad`` is
        divided in place (it is a buffer the optimizer owns and zeroes before the next step)."""
        return grad.float().div_(divide_by)

    @torch.no_grad()
    def master_to_model(self, master: torch.Tensor, params: torch.Tensor) -> None:
        """Round the updated master into the compute copy (nothing to do in fp32 training)."""
        if master is not params:
            params.copy_(master)


def master_copy(params: Iterable[torch.Tensor]) -> list[nn.Parameter]:
    """fp32 copies of ``params`` on the same device: the weights the optimizer really updates."""
    return [nn.Parameter(p.detach().to(torch.float32).clone()) for p in params]


@torch.no_grad()
def grads_to_master(model_params: list[nn.Parameter], master: list[nn.Parameter]) -> None:
    """``master.grad = float32(param.grad)``, and free the low-precision gradient."""
    for p, m in zip(model_params, master, strict=True):
        m.grad = None if p.grad is None else p.grad.to(torch.float32)
        p.grad = None


@torch.no_grad()
def master_to_model(master: list[nn.Parameter], model_params: list[nn.Parameter]) -> None:
    """Round the updated fp32 master weights into the compute copy (round-to-nearest-even)."""
    for m, p in zip(master, model_params, strict=True):
        p.copy_(m)


class MixedPrecisionTrainer:
    """Owns the compute copy (``model``, cast to ``dtype``), the fp32 master weights, the
    optimizer over the master weights and an optional loss scaler.

    One training step::

        loss = trainer.model(x, y)        # runs in dtype
        trainer.backward(loss)            # scale (if a scaler) then backward
        took_step = trainer.step()        # grads -> fp32, unscale, skip on inf, update, re-round

    ``make_optimizer`` builds the optimizer from the master parameters, e.g.
    ``lambda ps: torch.optim.AdamW(ps, lr=1e-3)``. Pass ``model`` in fp32: the master
    weights are copied *before* the cast, so they start exact. The device is the model's.
    With ``dtype=torch.float16`` use a ``DynamicLossScaler``; bf16 rarely needs one.
    """

    def __init__(
        self,
        model: nn.Module,
        make_optimizer: Callable[[list[nn.Parameter]], Optimizer],
        *,
        dtype: torch.dtype = torch.bfloat16,
        scaler: DynamicLossScaler | None = None,
    ) -> None:
        if dtype not in COMPUTE_DTYPES:
            raise ValueError(f"dtype must be one of {COMPUTE_DTYPES}, got {dtype}")
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the model has no trainable parameters")
        if any(p.dtype != torch.float32 for p in params):
            raise ValueError("pass the model in float32: the master weights are copied from it")
        self.dtype = dtype
        self.master = master_copy(params)  # before the cast: exact fp32 starting point
        self.model = model.to(dtype)  # the compute copy (parameters and buffers)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(self.master)
        self.scaler = scaler

    @property
    def device(self) -> torch.device:
        return self.master[0].device

    def backward(self, loss: torch.Tensor) -> None:
        """Backward through the low-precision model, of ``S * loss`` when there is a scaler."""
        loss = loss.float()  # the scaled loss itself could overflow in fp16
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self) -> bool:
        """Gradients to fp32, unscale + inf check, optimizer step on the master weights,
        re-round the compute copy. Returns False when the step was skipped (inf/nan)."""
        grads_to_master(self.params, self.master)
        if self.scaler is None:
            self.optimizer.step()
            took = True
        else:
            took = self.scaler.step(self.optimizer)
            self.scaler.update()
        if took:
            master_to_model(self.master, self.params)
        return took

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: the compute copy is re-derived from the master."""
        return {
            "master": [m.detach() for m in self.master],
            "optimizer": self.optimizer.state_dict(),
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for m, saved in zip(self.master, state["master"], strict=True):
                m.copy_(saved)
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None and state.get("scaler") is not None:
            self.scaler.load_state_dict(state["scaler"])
        master_to_model(self.master, self.params)
