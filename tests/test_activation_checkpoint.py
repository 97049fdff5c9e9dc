"""Activation checkpointing: same gradients (dropout included), one extra forward of the
wrapped blocks in FLOPs, less peak activation memory; side by side with torch.utils.checkpoint.

All numbers: fp32 on the CPU; memory from labkit.memory.tracker (live tensors, exact).
"""

from __future__ import annotations

import copy

import pytest
import torch

from labkit.activation_checkpoint import (
    CheckpointedBlock,
    apply_activation_checkpointing,
    checkpoint,
    forward_flops,
    remove_activation_checkpointing,
    select_blocks,
    step_activation_bytes,
    step_flops,
)
from labkit.models import GPT, GPTConfig, gpt_loss

POLICIES = ["full", 2, {1, 2}]


@pytest.fixture(scope="module")
def gpt_and_batch():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=65, block_size=16, n_layer=4, n_head=2, n_embd=32, dropout=0.2)
    idx, tgt = torch.randint(0, 65, (2, 16)), torch.randint(0, 65, (2, 16))
    return GPT(cfg), idx, tgt


def _grads_and_next_random(model, idx, tgt):
    torch.manual_seed(123)
    model.zero_grad()
    loss = gpt_loss(model, idx, tgt)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()], torch.rand(4)


@pytest.mark.parametrize("impl", ["labkit", "torch"])
def test_gradients_equal_with_dropout(gpt_and_batch, impl):
    model, idx, tgt = gpt_and_batch
    ref_loss, ref_grads, ref_next = _grads_and_next_random(model, idx, tgt)
    for policy in POLICIES:
        ckpt = copy.deepcopy(model)
        chosen = apply_activation_checkpointing(ckpt.blocks, policy, impl=impl)
        assert chosen == select_blocks(4, policy)
        loss, grads, next_random = _grads_and_next_random(ckpt, idx, tgt)
        assert torch.equal(loss, ref_loss)
        for (name, _), a, b in zip(model.named_parameters(), grads, ref_grads):
            assert torch.equal(a, b), f"policy {policy}: gradient of {name} differs"
        # the recompute replayed the RNG inside fork_rng: the caller's stream is where it would be
        assert torch.equal(next_random, ref_next)


def test_without_rng_preservation_dropout_masks_differ(gpt_and_batch):
    """The failure mode the RNG replay prevents: a different mask in the recompute."""
    model, idx, tgt = gpt_and_batch
    _, ref_grads, _ = _grads_and_next_random(model, idx, tgt)
    ckpt = copy.deepcopy(model)
    apply_activation_checkpointing(ckpt.blocks, "full", preserve_rng_state=False)
    _, grads, _ = _grads_and_next_random(ckpt, idx, tgt)
    assert not all(torch.equal(a, b) for a, b in zip(grads, ref_grads))


def test_state_dict_keys_unchanged_and_removable(gpt_and_batch):
    model, _, _ = gpt_and_batch
    ckpt = copy.deepcopy(model)
    apply_activation_checkpointing(ckpt.blocks, 2)
    assert list(ckpt.state_dict()) == list(model.state_dict())
    fresh = GPT(model.cfg)
    apply_activation_checkpointing(fresh.blocks, "full")
    fresh.load_state_dict(model.state_dict())  # strict: every key found through the wrapper
    remove_activation_checkpointing(fresh.blocks)
    assert not any(isinstance(b, CheckpointedBlock) for b in fresh.blocks)
    for (k, a), b in zip(fresh.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), k
    with pytest.raises(ValueError, match="already"):
        apply_activation_checkpointing(ckpt.blocks, "full")


def test_flops_add_one_forward_of_wrapped_blocks(gpt_and_batch):
    model, idx, tgt = gpt_and_batch
    base = step_flops(copy.deepcopy(model), idx, tgt, loss_fn=gpt_loss)
    x = torch.randn(2, 16, 32)  # a block's input (B, T, C)
    per_block = forward_flops(model.blocks[0], x)
    assert per_block > 0
    for impl in ("labkit", "torch"):
        for policy in POLICIES:
            ckpt = copy.deepcopy(model)
            chosen = apply_activation_checkpointing(ckpt.blocks, policy, impl=impl)
            assert step_flops(ckpt, idx, tgt, loss_fn=gpt_loss) == base + len(chosen) * per_block, (
                impl,
                policy,
            )


def test_memory_full_lt_selective_lt_none_and_close_to_torch(gpt_and_batch):
    model, idx, tgt = gpt_and_batch
    peaks = {}
    for impl in ("labkit", "torch"):
        for policy in ("none", 2, "full"):
            m = copy.deepcopy(model)
            apply_activation_checkpointing(m.blocks, policy, impl=impl)
            peaks[impl, str(policy)] = step_activation_bytes(m, idx, tgt, loss_fn=gpt_loss)[
                "activations"
            ]
    ours = [peaks["labkit", p] for p in ("none", "2", "full")]
    assert ours[0] > ours[1] > ours[2]
    assert ours[0] > 2 * ours[2]  # 4 blocks' intermediates vs 4 inputs + one block's
    for p in ("none", "2", "full"):
        # the reentrant design keeps a few extra small tensors; same order as torch's
        assert abs(peaks["labkit", p] - peaks["torch", p]) <= 0.1 * peaks["torch", p], (p, peaks)


def test_select_blocks_policies_and_errors():
    assert select_blocks(6, "full") == [0, 1, 2, 3, 4, 5]
    assert select_blocks(6, "none") == []
    assert select_blocks(6, 2) == [0, 2, 4]
    assert select_blocks(6, 4) == [0, 4]
    assert select_blocks(6, [5, 1, 1]) == [1, 5]
    for bad in ("half", 0, True, [6], [-1]):
        with pytest.raises(ValueError):
            select_blocks(6, bad)


def test_checkpoint_needs_an_input_that_requires_grad_but_not_in_inference():
    lin = torch.nn.Linear(3, 3)
    with pytest.raises(ValueError, match="requires grad"):
        checkpoint(lin, torch.randn(2, 3))
    with torch.no_grad():
        assert torch.equal(checkpoint(lin, torch.ones(2, 3)), lin(torch.ones(2, 3)))


def test_autocast_state_is_replayed_in_recompute():
    """bf16 autocast on the CPU: the recompute must run in bf16 too, or gradients change."""
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 16))
    x = torch.randn(4, 16, requires_grad=True)
    grads = []
    for wrap in (False, True):
        block.zero_grad()
        x.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = checkpoint(block, x) if wrap else block(x)
        y.float().sum().backward()
        grads.append([x.grad.clone(), *(p.grad.clone() for p in block.parameters())])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
