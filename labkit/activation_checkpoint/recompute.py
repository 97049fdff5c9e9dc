"""Activation checkpointing from scratch: keep a block's inputs, recompute the rest in backward.

The technique; ``costs.py`` beside it measures what it costs (FLOPs, peak bytes, seconds).

Backward needs the forward's intermediate tensors (the "activations": every matmul input,
every softmax output, every dropout mask). For a transformer block of width ``d`` on a
``(B, T)`` batch with ``h`` heads that is about ``B*T*(34d + 5hT)`` bytes in fp16
(Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models",
2022), for *every* block, all alive at the end of the forward pass.

A checkpointed block stores only its input ``x`` (``B*T*d`` values). Its forward runs under
``no_grad``, so no graph and no intermediates are kept. In backward, when autograd reaches
the block, we run the block's forward again *with* grad on the saved input, then
backpropagate through that fresh little graph. Memory per block drops to its input plus, at
any moment, one block's intermediates; the price is one extra forward of each wrapped block.

The FLOP arithmetic. A matmul costs ``2mnk`` FLOPs forward and twice that backward (a
gradient for the input and one for the weight), so a training step without checkpointing
costs ``F + 2F = 3F`` where ``F`` is the forward. Checkpointing blocks whose forward is
``F_c`` adds exactly ``F_c``: full checkpointing of a model that is all blocks makes a step
``4F``, i.e. 33% more compute. ``FlopCounterMode`` confirms the count to the FLOP
(tests/test_activation_checkpoint.py).

Randomness: dropout inside a block must draw *the same* mask in the recompute, or the
gradient belongs to a different function. So forward records the CPU RNG state (and the
CUDA RNG state of every device the inputs live on) and backward replays it inside
``torch.random.fork_rng``, leaving the surrounding RNG stream exactly where it was.
The autocast state is recorded and replayed for the same reason.

This is the "reentrant" design (a custom ``autograd.Function`` that calls
``torch.autograd.backward`` from inside backward). Consequence: at least one input of a
wrapped block must require grad, otherwise autograd never calls our backward and the
block's parameters get no gradient -- we raise instead of training silently wrong.
``torch.utils.checkpoint(use_reentrant=False)`` lifts that limit with saved-tensor hooks.
Second consequence, for code that hooks into backward (ZeRO, DDP): the block's parameter
hooks fire inside that nested backward, and a callback queued there with
``Variable._execution_engine.queue_callback`` runs when the *nested* backward ends, not
the user's. :mod:`labkit.zero.backward` therefore queues its end-of-backward flush from a
hook on the model's output, which runs in the outer backward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import ExitStack
from typing import Any

import torch
from torch import nn
from torch.utils import checkpoint as torch_checkpoint

__all__ = [
    "CheckpointedBlock",
    "Policy",
    "apply_activation_checkpointing",
    "checkpoint",
    "remove_activation_checkpointing",
    "select_blocks",
]

Policy = str | int | Iterable[int]  # "full" | "none" | every k-th block | a chosen set


def _autocast_state() -> list[tuple[str, torch.dtype]]:
    return [
        (d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)
    ]


class _Recompute(torch.autograd.Function):
    """forward: run ``fn`` without a graph, keep the inputs. backward: rerun with a graph."""

    @staticmethod
    def forward(ctx: Any, fn: Callable[..., Any], preserve_rng: bool, *args: Any) -> Any:
        ctx.fn = fn
        ctx.preserve_rng = preserve_rng
        ctx.autocast = _autocast_state()
        ctx.cuda_devices = sorted(
            {a.device.index or 0 for a in args if isinstance(a, torch.Tensor) and a.is_cuda}
        )
        if preserve_rng:
            ctx.cpu_rng = torch.get_rng_state()
            ctx.cuda_rng = [torch.cuda.get_rng_state(d) for d in ctx.cuda_devices]
        ctx.is_tensor = [isinstance(a, torch.Tensor) for a in args]
        ctx.others = [None if t else a for a, t in zip(args, ctx.is_tensor)]
        ctx.save_for_backward(*(a for a, t in zip(args, ctx.is_tensor) if t))
        with torch.no_grad():  # no graph: the block's intermediates die as soon as they are used
            return fn(*args)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> Any:
        saved = iter(ctx.saved_tensors)
        inputs = []
        for is_tensor, other in zip(ctx.is_tensor, ctx.others):
            if is_tensor:
                t = next(saved)
                inputs.append(t.detach().requires_grad_(t.requires_grad))
            else:
                inputs.append(other)
        with ExitStack() as stack:
            stack.enter_context(
                torch.random.fork_rng(devices=ctx.cuda_devices, enabled=ctx.preserve_rng)
            )
            if ctx.preserve_rng:
                torch.set_rng_state(ctx.cpu_rng)
                for device, state in zip(ctx.cuda_devices, ctx.cuda_rng):
                    torch.cuda.set_rng_state(state, device)
            for device_type, dtype in ctx.autocast:
                stack.enter_context(torch.autocast(device_type, dtype=dtype))
            with torch.enable_grad():
                outputs = ctx.fn(*inputs)  # the recompute: one more forward of the block
        outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if o.requires_grad and g is not None]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        grads = tuple(x.grad if isinstance(x, torch.Tensor) else None for x in inputs)
        return (None, None, *grads)


def checkpoint(fn: Callable[..., Any], *args: Any, preserve_rng_state: bool = True) -> Any:
    """``fn(*args)``, keeping only ``args`` for backward and recomputing ``fn`` there."""
    if not torch.is_grad_enabled():  # inference: nothing will be saved anyway
        return fn(*args)
    if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        raise ValueError(
            "labkit.activation_checkpoint.checkpoint needs at least one input that requires grad "
            "(otherwise backward never reaches the block and its parameters get no gradient)"
        )
    return _Recompute.apply(fn, preserve_rng_state, *args)


class CheckpointedBlock(nn.Module):
    """Wraps ``block`` so its forward is checkpointed. ``impl="torch"`` uses
    ``torch.utils.checkpoint`` (non-reentrant) instead, for side-by-side comparison.

    The wrapper is invisible in ``state_dict()``: keys stay ``blocks.0.ln1.weight``, not
    ``blocks.0.block.ln1.weight``, so checkpoints load with or without it.
    """

    def __init__(self, block: nn.Module, *, impl: str = "labkit", preserve_rng_state: bool = True):
        super().__init__()
        if impl not in ("labkit", "torch"):
            raise ValueError(f"impl must be 'labkit' or 'torch', got {impl!r}")
        self.block = block
        self.impl = impl
        self.preserve_rng_state = preserve_rng_state
        self.register_state_dict_post_hook(_strip_prefix)
        self.register_load_state_dict_pre_hook(_add_prefix)

    def forward(self, *args: Any) -> Any:
        if self.impl == "torch":
            return torch_checkpoint.checkpoint(
                self.block, *args, use_reentrant=False, preserve_rng_state=self.preserve_rng_state
            )
        return checkpoint(self.block, *args, preserve_rng_state=self.preserve_rng_state)


def _strip_prefix(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    for key in [k for k in state_dict if k.startswith(prefix + "block.")]:
        state_dict[prefix + key[len(prefix) + len("block.") :]] = state_dict.pop(key)


def _add_prefix(module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    for key in [
        k for k in state_dict if k.startswith(prefix) and not k.startswith(prefix + "block.")
    ]:
        state_dict[prefix + "block." + key[len(prefix) :]] = state_dict.pop(key)


def select_blocks(n_blocks: int, policy: Policy) -> list[int]:
    """Which of ``n_blocks`` blocks to checkpoint.

    ``"full"``: all; ``"none"``: none; an int ``k``: every k-th block (0, k, 2k, ...);
    an iterable of ints: exactly those blocks (the "selective" policy).
    """
    if isinstance(policy, str):
        if policy == "full":
            return list(range(n_blocks))
        if policy == "none":
            return []
        raise ValueError(
            f"policy must be 'full', 'none', an int k or a set of block indices, got {policy!r}"
        )
    if isinstance(policy, bool):
        raise ValueError(f"policy must not be a bool, got {policy!r}")
    if isinstance(policy, int):
        if policy < 1:
            raise ValueError(f"every-k-th policy needs k >= 1, got {policy}")
        return list(range(0, n_blocks, policy))
    chosen = sorted(set(policy))
    bad = [i for i in chosen if not (isinstance(i, int) and 0 <= i < n_blocks)]
    if bad:
        raise ValueError(f"block indices {bad} out of range for {n_blocks} blocks")
    return chosen


def apply_activation_checkpointing(
    blocks: nn.ModuleList,
    policy: Policy = "full",
    *,
    impl: str = "labkit",
    preserve_rng_state: bool = True,
) -> list[int]:
    """Wrap the chosen ``blocks`` (e.g. ``gpt.blocks``) in place; return their indices."""
    chosen = select_blocks(len(blocks), policy)
    for i in chosen:
        if isinstance(blocks[i], CheckpointedBlock):
            raise ValueError(f"block {i} is already checkpointed")
        blocks[i] = CheckpointedBlock(blocks[i], impl=impl, preserve_rng_state=preserve_rng_state)
    return chosen


def remove_activation_checkpointing(blocks: nn.ModuleList) -> None:
    """Undo :func:`apply_activation_checkpointing` in place."""
    for i, b in enumerate(blocks):
        if isinstance(b, CheckpointedBlock):
            blocks[i] = b.block
