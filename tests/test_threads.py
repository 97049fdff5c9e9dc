"""labkit's collectives on several threads of one rank at once (issue 21, item 1).

DDP's communication thread runs labkit collectives while the main thread runs others (tensor
parallelism's, on another group). Scratch buffers shared between the two threads mix their
data: a silent wrong answer. Two cases, each failing on the shared pool:

* two threads per rank, each all-reducing on its own group with labkit's tuned ring and
  recursive doubling, many iterations, every result equal to torch's to the bit (integer-
  valued floats: every order of addition gives the exact sum);
* the composed seam: tp2 x dp2 on 4 ranks, a tensor-parallel GPT over ``Comm(tp, "ring")``
  under ``OverlappedDDP(Comm(dp, "ring"))``, whose gradients must equal the same run with
  torch's collectives (fp32 sums in another order: ~1e-6; the shared pool missed by ~17).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from tests.ranks import run_ranks

ITERS = 40
SIZES = (3, 257, 40_000)  # numel: fewer than ranks per chunk, odd, a few pieces


def _threads_on_groups() -> dict[str, Any]:
    """Thread 0 all-reduces on all 4 ranks, threads 1 and 2 on two groups of ranks 0..2 (3
    ranks: recursive doubling's fold-in, a blocking send and receive between ranks 2 and 0 in
    both groups at once), all at once; each result against torch's all-reduce."""
    import torch.distributed as dist

    from labkit.collectives.common import DEFAULT_POOL
    from labkit.collectives.ring_tuned import tuned_all_reduce
    from labkit.collectives.tree import recursive_doubling_all_reduce

    rank = dist.get_rank()
    members = [[0, 1, 2, 3], [0, 1, 2], [0, 1, 2]]
    groups = [dist.new_group(m) for m in members]
    mine = [t for t, m in enumerate(members) if rank in m]
    inputs: dict[tuple[int, int], torch.Tensor] = {}
    for t in mine:
        for i in range(ITERS):
            g = torch.Generator().manual_seed(10_000 * t + 100 * i + rank)
            inputs[t, i] = torch.randint(-50, 50, (SIZES[i % 3],), generator=g).float()
    results: dict[tuple[int, int], torch.Tensor] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(mine))
    first = DEFAULT_POOL.allocations

    def work(t: int) -> None:
        try:
            start.wait()
            for i in range(ITERS):
                x = inputs[t, i].clone()
                fn = tuned_all_reduce if i % 2 == 0 else recursive_doubling_all_reduce
                fn(x, group=groups[t])  # check=True: the validated cache is shared too
                results[t, i] = x
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in mine]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    if errors:
        raise errors[0]
    worst = 0.0
    for t in mine:  # torch's all-reduce of the same inputs, one group at a time
        for i in range(ITERS):
            expected = inputs[t, i].clone()
            dist.all_reduce(expected, group=groups[t])
            worst = max(worst, (results[t, i] - expected).abs().max().item())
    return {"worst": worst, "threads": len(mine), "allocations": DEFAULT_POOL.allocations - first}


def test_threads_on_different_groups_equal_torch_to_the_bit() -> None:
    out = run_ranks(_threads_on_groups, world_size=4, timeout=120)
    assert [o["threads"] for o in out] == [3, 3, 3, 1]
    assert all(o["worst"] == 0.0 for o in out), [o["worst"] for o in out]
    # reuse survives: a thread allocates each of its 3 slots (ring.rs0, ring.rs1, rd.recv) at
    # most once per new size (3 sizes), where allocating per call would be ITERS per thread
    assert all(o["allocations"] <= 3 * len(SIZES) * o["threads"] for o in out), out


def _grads(impl: str, bucket_cap_mb: float, steps: int) -> dict[str, torch.Tensor]:
    """Gradients of this rank's shard after ``steps`` backward passes of tp2 x dp2."""
    import torch.distributed as dist

    from labkit.collectives import Comm
    from labkit.ddp import OverlappedDDP
    from labkit.models import GPT, GPTConfig
    from labkit.parallel.layout import ParallelDegrees, build_layout
    from labkit.tensor_parallel import TPConfig, tensor_parallel, vocab_parallel_cross_entropy

    layout = build_layout(ParallelDegrees(dp=2, tp=2))
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=64, dropout=0.0)
    torch.manual_seed(0)
    tp = tensor_parallel(GPT(cfg), layout.tp_group, TPConfig(impl=impl))
    model = OverlappedDDP(
        tp, comm=Comm(layout.dp_group, impl), bucket_cap_mb=bucket_cap_mb
    )  # small buckets: the communication thread runs while backward's tp collectives do
    grads: dict[str, torch.Tensor] = {}
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + dist.get_rank(layout.dp_group))
        idx, tgt = (
            torch.randint(0, 64, (4, 16), generator=g),
            torch.randint(0, 64, (4, 16), generator=g),
        )
        loss = vocab_parallel_cross_entropy(model(idx), tgt, tp.comms["loss"])
        loss.backward()
        model.finish_gradient_sync()
        for n, p in tp.named_parameters():
            assert p.grad is not None, n
            grads[f"{step}.{n}"] = p.grad.clone()
        model.zero_grad(set_to_none=True)
    return grads


def _composed() -> float:
    reference = _grads("torch", 0.01, steps=3)
    ring = _grads("ring", 0.01, steps=3)
    assert reference.keys() == ring.keys()
    return max((reference[k] - ring[k]).abs().max().item() for k in reference)


def test_tensor_parallel_ring_under_overlapped_ddp_ring_equals_torch() -> None:
    worst = run_ranks(_composed, world_size=4, timeout=120)
    assert max(worst) < 1e-5, worst


def test_buffer_pool_gives_each_thread_its_own_buffers_and_clear_frees_all() -> None:
    from labkit.collectives.pool import BufferPool

    pool, cpu = BufferPool(), torch.device("cpu")
    got: dict[str, torch.Tensor] = {}
    main = pool.get("ring.rs0", 8, torch.float32, cpu)

    def other() -> None:
        got["other"] = pool.get("ring.rs0", 8, torch.float32, cpu)
        got["again"] = pool.get("ring.rs0", 4, torch.float32, cpu)  # reused: no allocation

    th = threading.Thread(target=other)
    th.start()
    th.join()
    assert got["other"].data_ptr() != main.data_ptr()  # the shared pool handed out the same
    assert got["again"].data_ptr() == got["other"].data_ptr()
    assert pool.get("ring.rs0", 8, torch.float32, cpu).data_ptr() == main.data_ptr()
    assert pool.allocations == 2
    pool.mark_validated(("k",))
    pool.clear()
    assert not pool.is_validated(("k",))
    pool.get("ring.rs0", 8, torch.float32, cpu)
    assert pool.allocations == 3  # the main thread's buffer was freed and is allocated anew
