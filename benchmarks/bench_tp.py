"""Our tensor parallelism against PyTorch's (``parallelize_module``), on 2 ranks, same GPT.

Both contenders shard the same GPT the same way (Megatron's plan): q/k/v and fc column-wise,
the two projections row-wise, the embedding and the output layer over the vocabulary, and the
loss computed on vocab-sharded logits (ours: ``vocab_parallel_cross_entropy``; PyTorch's:
``loss_parallel``). ``--sp`` adds sequence parallelism (PyTorch: ``SequenceParallel`` on the
LayerNorms, the row-parallel layers' outputs sharded on the sequence). One difference in
PyTorch's SP plan: the embedding output is all-reduced and then split on the sequence (a
learned position embedding does not fit its ``RowwiseParallel(output_layouts=Shard(1))``);
ours reduce-scatters it.

Steps (forward, backward, AdamW) are interleaved contender by contender, warmed up, and the
median is reported with its spread, with the ratio ours / PyTorch (target <= 1.0x). Peak
bytes per rank come from labkit's live-tensor tracker during one step; a DTensor is counted
through the local tensors its operators produce (see labkit.memory.tracker), so PyTorch's
numbers are its local shards plus what DTensor allocates.

    .venv/bin/python benchmarks/bench_tp.py          # tensor parallel
    .venv/bin/python benchmarks/bench_tp.py --sp     # with sequence parallelism
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from labkit import launch
from labkit.models import GPTConfig
from labkit.tensor_parallel import check_tp

CFG = GPTConfig(vocab_size=512, block_size=128, n_layer=4, n_head=8, n_embd=256, tie_weights=False)
BATCH = 8


def _torch_tp(model: Any, sp: bool) -> Any:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    t = dist.get_world_size()
    mesh = init_device_mesh("cpu", (t,))
    seq = Shard(1) if sp else Replicate()
    for block in model.blocks:
        plan: dict[str, Any] = {
            "attn.q": ColwiseParallel(),
            "attn.k": ColwiseParallel(),
            "attn.v": ColwiseParallel(),
            "attn.proj": RowwiseParallel(output_layouts=seq),
            "mlp.fc": ColwiseParallel(),
            "mlp.proj": RowwiseParallel(output_layouts=seq),
        }
        if sp:
            plan |= {
                "ln1": SequenceParallel(),
                "ln2": SequenceParallel(),
                "attn": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
                "mlp": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
            }
        parallelize_module(block, mesh, plan)
        block.attn.q.out_features //= t  # the attention reads its local head count from here
    top: dict[str, Any] = {
        "wte": RowwiseParallel(input_layouts=Replicate()),
        "head": ColwiseParallel(
            input_layouts=seq, output_layouts=Shard(-1), use_local_output=False
        ),
    }
    if sp:
        top |= {
            "blocks.0": PrepareModuleInput(
                input_layouts=(Replicate(),),
                desired_input_layouts=(Shard(1),),
                use_local_output=True,
            ),
            "ln_f": SequenceParallel(),
        }
    return parallelize_module(model, mesh, top)


def _work(sp: bool, steps: int, warmup: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.tensor.parallel import loss_parallel

    from labkit.measure.timing import interleaved_times, spread
    from labkit.memory.tracker import MemoryTracker
    from labkit.models import GPT
    from labkit.tensor_parallel import TPConfig, tensor_parallel

    torch.manual_seed(0)
    ours = tensor_parallel(GPT(CFG), None, TPConfig(sequence_parallel=sp))
    torch.manual_seed(0)
    theirs = _torch_tp(GPT(CFG), sp)
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-3, foreach=False)
    # foreach=False on both: the torch model mixes DTensor and plain parameters
    opt_theirs = torch.optim.AdamW(theirs.parameters(), lr=1e-3, foreach=False)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, CFG.vocab_size, (BATCH, CFG.block_size), generator=g)
    tgt = torch.randint(0, CFG.vocab_size, (BATCH, CFG.block_size), generator=g)

    def step_ours() -> float:
        loss = ours.loss(idx, tgt)
        loss.backward()
        ours.finish_grads()
        opt_ours.step()
        opt_ours.zero_grad()
        return loss.item()

    def step_theirs() -> float:
        logits = theirs(idx)
        with loss_parallel():
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tgt.flatten())
            loss.backward()
        opt_theirs.step()
        opt_theirs.zero_grad()
        return float(loss.full_tensor().item() if hasattr(loss, "full_tensor") else loss.item())

    losses = (step_ours(), step_theirs())  # same init, same data: the first losses agree
    times = interleaved_times(
        {"ours": step_ours, "torch": step_theirs}, steps, warmup, sync=dist.barrier
    )
    peaks = {}
    for name, fn in (("ours", step_ours), ("torch", step_theirs)):
        try:
            with MemoryTracker() as mt:
                fn()
            peaks[name] = mt.peak_bytes
        except Exception as exc:  # a tensor subclass the tracker cannot read
            peaks[name] = f"n/a ({type(exc).__name__})"
    return {
        "times": {k: spread(v) for k, v in times.items()},
        "peaks": peaks,
        "first_losses": losses,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sp", action="store_true", help="sequence parallelism too")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    check_tp(CFG, 2)  # before any process starts
    results = launch(
        _work,
        args.sp,
        args.steps,
        args.warmup,
        world_size=2,
        backend="gloo",
        timeout=600,
        quiet=True,
    )
    r0 = results[0]
    ours, theirs = r0["times"]["ours"], r0["times"]["torch"]
    kind = "TP + SP" if args.sp else "TP"
    print(
        f"{kind}, 2 ranks, GPT d={CFG.n_embd} L={CFG.n_layer} h={CFG.n_head} "
        f"V={CFG.vocab_size}, batch {BATCH}x{CFG.block_size}"
    )
    print(f"  first-step loss: ours {r0['first_losses'][0]:.5f}, torch {r0['first_losses'][1]:.5f}")
    print(f"  ours : {ours}")
    print(f"  torch: {theirs}")
    print(
        f"  ratio ours/torch (median step time): {ours.median / theirs.median:.2f}x "
        "(target <= 1.0x)"
    )
    for rank, r in enumerate(results):
        print(
            f"  rank {rank} peak bytes in a step: ours {r['peaks']['ours']}, "
            f"torch {r['peaks']['torch']}"
        )
    print(
        "  note: the tracker sees DTensor-level operators for PyTorch's model; until it counts a\n"
        "  DTensor at its local size, PyTorch's peak may include global-size wrappers (over-count)."
    )


if __name__ == "__main__":
    main()
