"""A GPT whose feed-forward layers are MoE layers: :mod:`labkit.models.gpt`'s blocks, reused.

:func:`moe_gpt` builds ``GPT(cfg.gpt)`` and swaps the MLP of each block listed by
:meth:`labkit.models.moe.MoEConfig.moe_layers` for a :class:`labkit.experts.layer.MoELayer`,
so attention, embeddings and the head are the dense GPT's, unchanged (``gpt.py`` knows
nothing of experts). The training loss is the language-model loss plus, for every MoE layer,
``aux_coef`` times its balancing loss and ``z_coef`` times its z-loss (:func:`moe_gpt_loss`).
Parameter count: :meth:`MoEConfig.num_params` (tested against the built module).
"""

from __future__ import annotations

import torch
from torch import nn

from labkit.collectives import Comm
from labkit.experts.groups import ExpertGroups
from labkit.experts.layer import MoELayer
from labkit.experts.parallel import ExpertParallelMoE
from labkit.models.gpt import GPT, lm_loss
from labkit.models.moe import MoEConfig

__all__ = ["expert_parallel", "moe_aux_loss", "moe_gpt", "moe_gpt_loss", "moe_layers"]


def moe_gpt(cfg: MoEConfig) -> GPT:
    """The GPT of ``cfg.gpt`` with a MoE feed-forward layer in each of ``cfg.moe_layers()``."""
    model = GPT(cfg.gpt)
    d = cfg.gpt.n_embd
    for i in cfg.moe_layers():
        model.blocks[i].mlp = MoELayer(  # type: ignore[assignment]
            d, cfg.expert_d_ff, cfg.n_experts, cfg.top_k, cfg.capacity_factor,
            shared_d_ff=cfg.shared_d_ff,
        )  # fmt: skip
    model.moe_cfg = cfg  # type: ignore[assignment]
    return model


def expert_parallel(
    model: GPT, groups: ExpertGroups, impl: str = "labkit", tp_comm: Comm | None = None
) -> GPT:
    """In place: every block's :class:`MoELayer` becomes an :class:`ExpertParallelMoE` over
    ``groups.ep`` (its experts sliced, router and shared expert copied); returns ``model``.
    Every rank must pass the same model (same seed); the rest of the GPT stays replicated,
    so :func:`labkit.experts.groups.reduce_moe_gradients` reduces it over dp as before."""
    for block in model.blocks:
        if isinstance(block.mlp, MoELayer):
            block.mlp = ExpertParallelMoE(block.mlp, groups.ep, tp_comm=tp_comm, impl=impl)
    return model


def moe_layers(model: nn.Module) -> list[nn.Module]:
    """Every MoE layer of ``model`` (the reference or the expert-parallel one), in order."""
    return [m for m in model.modules() if isinstance(getattr(m, "aux", None), dict)]


def moe_aux_loss(model: nn.Module, aux_coef: float, z_coef: float) -> torch.Tensor:
    """``sum over MoE layers of aux_coef * balance + z_coef * z`` from the last forward."""
    total = torch.zeros(())  # a CPU scalar: adding a device tensor to it moves the sum there
    for layer in moe_layers(model):
        aux: dict[str, torch.Tensor] = getattr(layer, "aux")  # noqa: B009 - set by forward
        total = total + aux_coef * aux["balance"] + z_coef * aux["z"]
    return total


def moe_gpt_loss(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token loss plus the MoE layers' auxiliary losses (coefficients from the config)."""
    cfg: MoEConfig = model.moe_cfg  # type: ignore[assignment]
    loss = lm_loss(model(idx), targets)
    return loss + moe_aux_loss(model, cfg.aux_coef, cfg.z_coef)
