"""Tensor parallelism (Megatron-LM) and sequence parallelism, against the unsharded GPT.

One launch per world size (tp = 2 and 4) runs every multi-rank case; the test functions then
assert on its results. Cases: equivalence of outputs, loss, gradients and parameters after 3
AdamW steps of 2 micro-batches each, with dropout active (SP off and on, torch and ring
collectives, tied and untied head); communication per block and per step against the
formula; activation bytes per layer against Korthikanti Table 2; Megatron's dropout streams;
mismatched configs; and a negative control (f and g swapped) that must fail equivalence.
The composed case goes through ``labkit.parallel.compose`` with every block checkpointed, and
proves it (each block's forward ran twice, the recompute's collectives counted). The
vocab-parallel loss at the edges: ignore_index, all ignored, out-of-range targets (an error
on every rank), against ``F.cross_entropy`` on the gathered logits.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from labkit.measure.tp import block_comm_formula
from labkit.memory.model import activation_bytes_per_layer, activation_bytes_per_layer_sized
from labkit.models import GPTConfig
from labkit.tensor_parallel import check_tp
from tests.ranks import run_ranks

CFG = GPTConfig(
    vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, dropout=0.1, attention="explicit"
)
B, T, STEPS, MICRO = 2, 16, 3, 2
MEM_CFG = CFG.with_(block_size=64, n_embd=64)  # the memory case: s = 64, b = 2, h = 64, a = 4
# fp32 sums in another order: ~1e-6 on the loss and gradients; logits and parameters after
# three AdamW steps (lr 1e-2, whose update ~ lr * sign(g) amplifies rounding in tiny gradients)
# ~3e-5. The negative control misses by > 0.1.
TOL = {"loss": 1e-5, "grads": 1e-5, "logits": 1e-4, "params": 1e-4}


def _batches(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randint(0, CFG.vocab_size, (B, T), generator=g), torch.randint(
        0, CFG.vocab_size, (B, T), generator=g
    )


def _gather_last(t: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim=-1)  # (B, T, V/t) per rank -> (B, T, V)


def _equivalence(cfg: GPTConfig, sp: bool, impl: str, checkpoint: bool = False) -> dict[str, Any]:
    """Train the GPT and its TP version side by side; the largest differences, and the
    communication of one step (2 micro-batches). ``checkpoint``: built through
    ``labkit.parallel.compose`` over a real layout, every block checkpointed after TP; the
    forwards each block really ran are counted (a recompute is a second one)."""
    from labkit.activation_checkpoint import CheckpointedBlock
    from labkit.models import GPT, lm_loss
    from labkit.tensor_parallel import (
        TPConfig,
        seeded_dropout,
        tensor_parallel,
        vocab_parallel_cross_entropy,
    )

    torch.manual_seed(0)
    ref = seeded_dropout(GPT(cfg), seed=7)
    tp_cfg = TPConfig(sequence_parallel=sp, impl=impl, masks="sliced", seed=7)
    forwards = [0] * cfg.n_layer
    if checkpoint:
        import torch.distributed as dist

        from labkit.parallel import ParallelDegrees, build_layout
        from labkit.parallel.compose import compose

        layout = build_layout(ParallelDegrees(tp=dist.get_world_size()))
        tp: Any = compose(ref, layout, tensor_parallel=tp_cfg, checkpoint="full")
        for i, block in enumerate(tp.gpt.blocks):
            assert isinstance(block, CheckpointedBlock), type(block)

            def count(*_: Any, i: int = i) -> None:
                forwards[i] += 1

            block.block.register_forward_hook(count)  # the wrapped block: runs twice if recomputed
    else:
        tp = tensor_parallel(ref, None, tp_cfg)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt_tp = torch.optim.AdamW(tp.parameters(), lr=1e-2)
    out: dict[str, Any] = {"loss": 0.0, "logits": 0.0, "grads": 0.0}
    for step in range(STEPS):
        tp.reset_counts()
        for micro in range(MICRO):
            idx, tgt = _batches(step, micro)
            logits_ref, logits_tp = ref(idx), tp(idx)
            if micro == 0:  # what the forward alone communicated, per block
                out["forward_calls"] = {k: dict(c.calls) for k, c in tp.comms.items()}
            loss_ref = lm_loss(logits_ref, tgt)
            loss_tp = vocab_parallel_cross_entropy(logits_tp, tgt, tp.comms["loss"])  # one forward
            out["logits"] = max(
                out["logits"], (_gather_last(logits_tp) - logits_ref).abs().max().item()
            )
            out["loss"] = max(out["loss"], abs(loss_tp.item() - loss_ref.item()))
            (loss_ref / MICRO).backward()
            (loss_tp / MICRO).backward()
        tp.finish_grads()
        grads = tp.gather_full(grads=True)
        out["grads"] = max(
            [out["grads"]]
            + [(grads[n] - p.grad).abs().max().item() for n, p in ref.named_parameters()]
        )
        opt_ref.step()
        opt_tp.step()
        opt_ref.zero_grad()
        opt_tp.zero_grad()
    params = tp.gather_full()
    out["params"] = max((params[n] - p).abs().max().item() for n, p in ref.named_parameters())
    out["names"] = sorted(params) == sorted(n for n, _ in ref.named_parameters())
    out["calls"] = {k: dict(c.calls) for k, c in tp.comms.items()}  # the last step
    out["sent"] = {k: dict(c.sent) for k, c in tp.comms.items()}
    out["block_forwards"] = forwards  # over all steps and micro-batches (counted if composed)
    return out


def _swapped_f_g() -> float:
    """Negative control: f and g exchanged (all-reduce in the wrong direction)."""
    import labkit.tensor_parallel.layers as layers
    import labkit.tensor_parallel.transform as transform
    from labkit.models import GPT
    from labkit.tensor_parallel import TPConfig, copy_to_tp, reduce_from_tp, tensor_parallel

    torch.manual_seed(0)
    ref = GPT(CFG.with_(dropout=0.0))
    layers.reduce_from_tp, transform.copy_to_tp = copy_to_tp, reduce_from_tp  # type: ignore[assignment]
    try:
        tp = tensor_parallel(ref, None, TPConfig())
        idx, _ = _batches(0, 0)
        return (_gather_last(tp(idx)) - ref(idx)).abs().max().item()
    finally:
        layers.reduce_from_tp, transform.copy_to_tp = reduce_from_tp, copy_to_tp  # type: ignore[assignment]


def _dropout_streams() -> dict[str, Any]:
    """Megatron's streams (masks="per_rank"): the masks each rank drew at two sites."""
    import torch.distributed as dist

    from labkit.models import GPT
    from labkit.tensor_parallel import RegionDropout, TPConfig, tensor_parallel

    torch.manual_seed(0)
    tp = tensor_parallel(GPT(CFG), None, TPConfig(masks="per_rank", seed=3))
    sites = {
        "replicated": "blocks.0.attn.inner.dropout",
        "sharded": "blocks.0.attn.inner.attn_drop",
    }
    for name in sites.values():
        m = tp.gpt.get_submodule(name)
        assert isinstance(m, RegionDropout)
        m.record_masks = True
    tp(_batches(0, 0)[0])
    out = {}
    for kind, name in sites.items():
        mask = tp.gpt.get_submodule(name).last_mask
        everyone = [torch.empty_like(mask) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mask)
        out[kind] = [bool(torch.equal(everyone[0], m)) for m in everyone]
    return out


def _mismatch(what: str) -> str:
    import torch.distributed as dist

    from labkit.models import GPT
    from labkit.tensor_parallel import tensor_parallel

    rank = dist.get_rank()
    torch.manual_seed(rank if what == "seed" else 0)
    cfg = CFG.with_(n_layer=2 + rank) if what == "config" else CFG
    try:
        tensor_parallel(GPT(cfg), None)
    except ValueError as err:
        return str(err)
    return "no error"


def _memory() -> dict[str, tuple[int, int]]:
    from labkit.measure.tp import layer_activation_bytes
    from labkit.models import GPT
    from labkit.tensor_parallel import TPConfig, seeded_dropout, tensor_parallel

    torch.manual_seed(0)
    ref = seeded_dropout(GPT(MEM_CFG), seed=1)
    idx = torch.randint(0, MEM_CFG.vocab_size, (B, MEM_CFG.block_size))
    out = {"none": layer_activation_bytes(ref, idx, block=1)}
    for sp in (False, True):
        tp = tensor_parallel(ref, None, TPConfig(sequence_parallel=sp))
        out["sp" if sp else "tp"] = layer_activation_bytes(tp.gpt, idx, block=1)
    return out


def _loss_edges() -> dict[str, Any]:
    """The vocab-parallel loss and its logits' gradients against ``F.cross_entropy`` on the
    gathered logits: padding (-100) ignored, another ``ignore_index``, every target ignored;
    out-of-range targets, the same on every rank or on one rank only (each rank's error)."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from labkit.collectives import Comm
    from labkit.tensor_parallel import vocab_parallel_cross_entropy

    rank, t, V = dist.get_rank(), dist.get_world_size(), CFG.vocab_size
    n, comm = V // t, Comm(None)
    g = torch.Generator().manual_seed(5)
    full = torch.randn(B, T, V, generator=g) * 3  # (B, T, V), the same on every rank
    tgt = torch.randint(0, V, (B, T), generator=g)
    tgt[0, :5], tgt[1, -3:] = -100, -100  # padding

    def ours(targets: torch.Tensor, **kw: Any) -> tuple[float, torch.Tensor]:
        mine = full[..., rank * n : (rank + 1) * n].clone().requires_grad_()  # (B, T, V/t)
        loss = vocab_parallel_cross_entropy(mine, targets, comm, **kw)
        loss.backward()
        assert mine.grad is not None
        return loss.item(), _gather_last(mine.grad)

    def theirs(targets: torch.Tensor, **kw: Any) -> tuple[float, torch.Tensor]:
        x = full.clone().requires_grad_()
        loss = F.cross_entropy(x.reshape(-1, V), targets.reshape(-1), **kw)
        loss.backward()
        assert x.grad is not None
        return loss.item(), x.grad

    out: dict[str, Any] = {}
    cases = {
        "padded": (tgt, {}),
        "ignore_7": (tgt.masked_fill(tgt == -100, 7), {"ignore_index": 7}),
        "all_ignored": (torch.full_like(tgt, -100), {}),
    }
    for case, (targets, kw) in cases.items():
        (loss, grad), (want, want_grad) = ours(targets, **kw), theirs(targets, **kw)
        out[case] = {"loss": loss, "want": want, "grads": (grad - want_grad).abs().max().item()}
    # negative control: the padding counted as a real token (target 0) is another loss
    out["padding_counted"] = theirs(tgt.clamp(min=0))[0]
    bad = {"above": V + 3, "negative": -5, "rank0_only": V if rank == 0 else 1}
    for case, value in bad.items():
        targets = tgt.clone()
        targets[0, 7] = value
        try:
            ours(targets)
            out[case] = "no error"
        except IndexError as err:
            out[case] = str(err)
    return out


def _all_cases(tp: int) -> dict[str, Any]:
    impls = ("torch", "ring") if tp == 2 else ("ring", "torch")
    return {
        "loss_edges": _loss_edges(),
        "eq_tp": _equivalence(CFG, False, impls[0]),
        "eq_sp": _equivalence(CFG, True, impls[1]),
        "eq_untied": _equivalence(CFG.with_(tie_weights=False), tp == 4, "torch"),
        "eq_composed": _equivalence(CFG, tp == 2, "torch", checkpoint=True),
        "swapped": _swapped_f_g(),
        "dropout": _dropout_streams(),
        "mismatch_config": _mismatch("config"),
        "mismatch_seed": _mismatch("seed"),
        "memory": _memory(),
    }


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2", "tp4"])
def world(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    tp = request.param
    return tp, run_ranks(_all_cases, tp, world_size=tp, timeout=300)


@pytest.mark.parametrize("case", ["eq_tp", "eq_sp", "eq_untied", "eq_composed"])
def test_equivalent_to_unsharded_gpt(world: tuple[int, list[dict[str, Any]]], case: str) -> None:
    tp, results = world
    for rank, r in enumerate(results):
        eq = r[case]
        assert eq["names"], f"rank {rank}: gathered names differ from the GPT's"
        for what in ("logits", "loss", "grads", "params"):
            assert eq[what] < TOL[what], (
                f"tp={tp} {case} rank {rank}: {what} differ by {eq[what]:.3g}"
            )


def test_composed_case_really_checkpoints(world: tuple[int, list[dict[str, Any]]]) -> None:
    """eq_composed goes through ``compose`` with every block checkpointed: each block's
    forward ran twice per micro-batch (forward, then recompute in backward), and each block's
    communicator saw the recompute's collectives on top of a plain step's (SP at tp=2)."""
    tp, results = world
    for r in results:
        assert r["eq_composed"]["block_forwards"] == [2 * STEPS * MICRO] * CFG.n_layer
        formula = block_comm_formula(B, T, CFG.n_embd, tp, tp == 2)
        for i in range(CFG.n_layer):
            recomputed = {
                k: MICRO * (v + formula.forward_calls.get(k, 0)) for k, v in formula.calls.items()
            }
            assert r["eq_composed"]["calls"][f"block{i}"] == recomputed
        # negative control: the plain (uncomposed) case has no recompute
        assert r["eq_sp" if tp == 2 else "eq_tp"]["calls"]["block0"] != recomputed


def test_vocab_parallel_loss_matches_torch_at_the_edges(
    world: tuple[int, list[dict[str, Any]]],
) -> None:
    """F.cross_entropy's semantics: ignore_index (-100 and another value) not counted in the
    mean, zero gradient there; all ignored: nan loss, zero gradient (before: -100 counted,
    10.72 against 11.43 at tp=2). The negative control: counting the padding is far off."""
    import math

    tp, results = world
    for rank, r in enumerate(results):
        e = r["loss_edges"]
        for case in ("padded", "ignore_7"):
            assert abs(e[case]["loss"] - e[case]["want"]) < 1e-5, (tp, rank, case, e[case])
            assert e[case]["grads"] < 1e-6, (tp, rank, case, e[case])
        assert math.isnan(e["all_ignored"]["loss"]) and math.isnan(e["all_ignored"]["want"])
        assert e["all_ignored"]["grads"] == 0.0
        assert abs(e["padding_counted"] - e["padded"]["want"]) > 100 * 1e-5, e


def test_out_of_range_targets_raise_on_every_rank(
    world: tuple[int, list[dict[str, Any]]],
) -> None:
    """As F.cross_entropy, an IndexError naming the value; raised on every rank, also when
    only rank 0's targets hold it (no peer is left waiting in a collective)."""
    tp, results = world
    V = CFG.vocab_size
    for rank, r in enumerate(results):
        e = r["loss_edges"]
        assert f"out of range [0, {V})" in e["above"] and f"[{V + 3}]" in e["above"], e["above"]
        assert "[-5]" in e["negative"], e["negative"]
        msg = e["rank0_only"]
        assert msg != "no error" and "bad targets per rank: rank 0: " in msg, msg
        assert f"rank {tp - 1}: 0" in msg and (f"[{V}]" in msg) == (rank == 0), msg


def test_swapping_f_and_g_breaks_equivalence(world: tuple[int, list[dict[str, Any]]]) -> None:
    tp, results = world
    for rank, r in enumerate(results):
        assert r["swapped"] > 1e-3, (
            f"tp={tp} rank {rank}: wrong-direction all-reduce went unnoticed"
        )


def test_communication_per_block_and_step_equals_formula(
    world: tuple[int, list[dict[str, Any]]],
) -> None:
    tp, results = world
    for r in results:
        for case, sp in (("eq_tp", False), ("eq_sp", True)):
            formula = block_comm_formula(B, T, CFG.n_embd, tp, sp)
            for i in range(CFG.n_layer):  # one step = MICRO micro-batches
                assert r[case]["forward_calls"][f"block{i}"] == formula.forward_calls
                assert r[case]["calls"][f"block{i}"] == {
                    k: MICRO * v for k, v in formula.calls.items()
                }
                assert r[case]["sent"][f"block{i}"] == {
                    k: MICRO * v for k, v in formula.sent.items()
                }
        # outside the blocks, per micro-batch: the embedding's g (forward) and the head's f
        # (backward); with SP a reduce-scatter / all-gather pair each, plus the head's regather
        assert r["eq_tp"]["calls"]["embed"] == {"all_reduce": MICRO}
        assert r["eq_tp"]["calls"]["head"] == {"all_reduce": MICRO}
        assert r["eq_sp"]["calls"]["embed"] == {"reduce_scatter": MICRO, "all_gather": MICRO}
        assert r["eq_sp"]["calls"]["head"] == {"all_gather": 2 * MICRO, "reduce_scatter": MICRO}
        # the loss: t maxima gathered, sum-exp and target logit summed: B*T numbers each
        assert r["eq_tp"]["calls"]["loss"] == {"all_gather": MICRO, "all_reduce": 2 * MICRO}
        assert r["eq_tp"]["sent"]["loss"]["all_reduce"] == MICRO * 2 * (
            2 * B * T * 4 * (tp - 1) // tp
        )
        # once per step: the sequence-parallel parameters' partial gradients, one flat all-reduce
        assert r["eq_tp"]["calls"]["grads"] == {}
        sp_params = (
            CFG.n_layer * (4 * CFG.n_embd + 2 * CFG.n_embd)
            + 2 * CFG.n_embd
            + CFG.block_size * CFG.n_embd
        )
        assert r["eq_sp"]["sent"]["grads"] == {"all_reduce": 2 * (sp_params * 4) * (tp - 1) // tp}


def test_dropout_masks_equal_where_replicated_and_differ_where_sharded(
    world: tuple[int, list[dict[str, Any]]],
) -> None:
    tp, results = world
    for r in results:
        assert all(r["dropout"]["replicated"]), "replicated activations must be dropped identically"
        assert r["dropout"]["sharded"] == [True] + [False] * (tp - 1), (
            "heads must draw their own masks"
        )


def test_mismatched_configs_raise_a_clear_error_not_a_hang(
    world: tuple[int, list[dict[str, Any]]],
) -> None:
    tp, results = world
    for r in results:
        msg = r["mismatch_config"]
        assert (
            "disagree on n_layer" in msg
            and "rank 0: n_layer=2" in msg
            and f"rank {tp - 1}: n_layer={tp + 1}" in msg
        )
        assert "weights checksum" in r["mismatch_seed"], r["mismatch_seed"]


def test_activation_bytes_per_layer_match_korthikanti(
    world: tuple[int, list[dict[str, Any]]],
) -> None:
    """fp32 activations (4 bytes) and 1-byte masks: the paper's sbh(10 + 24/t + 5as/(ht)) and
    sbh(34/t + 5as/(ht)) with its 2-byte terms doubled. Within 10%, and the difference is
    exactly what the paper leaves out: LayerNorm's saved mean and 1/std (2 LayerNorms x 2
    (b, s, 1) fp32 tensors, split by SP) and the (s, s) bool causal mask of the explicit
    attention."""
    tp, results = world
    s, b, h, a = MEM_CFG.block_size, B, MEM_CFG.n_embd, MEM_CFG.n_head
    for r in results:
        for key, t, sp in (("none", 1, False), ("tp", tp, False), ("sp", tp, True)):
            formula = activation_bytes_per_layer_sized(s, b, h, a, tp=t, sp=sp, act_bytes=4)
            extra = 2 * 2 * s * b * 4 // (t if sp else 1) + s * s
            measured = r["memory"][key]
            assert abs(measured - formula) / formula < 0.10, (key, measured, formula)
            assert measured - formula == extra, (key, measured, formula, extra)


def test_sized_formula_is_table2_at_16_bit() -> None:
    for t, sp in ((1, False), (2, False), (4, False), (2, True), (8, True)):
        paper = activation_bytes_per_layer(2048, 4, 2048, 16, tp=t, sp=sp)
        assert activation_bytes_per_layer_sized(2048, 4, 2048, 16, tp=t, sp=sp) == pytest.approx(
            paper
        )


def test_parallel_and_tensor_parallel_import_one_way() -> None:
    """tensor_parallel (a technique) imports labkit.parallel.layout only; labkit.parallel's
    package import does not pull compose (which imports tensor_parallel) back in. Before:
    parallel/__init__ -> compose -> tensor_parallel -> transform -> parallel, a circle
    (compose's import was lazy, inside the function, and still a circle)."""
    from tests.test_imports import cycles, import_graph

    graph = import_graph()
    assert graph["labkit.parallel"] == {"labkit.parallel.layout"}, graph["labkit.parallel"]
    assert (
        graph["labkit.tensor_parallel.transform"] & {"labkit.parallel", "labkit.parallel.compose"}
        == set()
    )
    ours = ("labkit.parallel", "labkit.tensor_parallel")
    assert [c for c in cycles(graph) if any(m.startswith(ours) for m in c)] == []


def test_bad_sizes_fail_before_any_process_starts() -> None:
    with pytest.raises(ValueError, match=r"hidden size 30 is not divisible by tp=4"):
        check_tp(GPTConfig(n_embd=30, n_head=3, vocab_size=64), 4)
    with pytest.raises(ValueError, match=r"head count 6 is not divisible by tp=4"):
        check_tp(GPTConfig(n_embd=48, n_head=6, vocab_size=64), 4)
    with pytest.raises(ValueError, match=r"vocabulary 65 is not divisible by tp=2"):
        check_tp(GPTConfig(vocab_size=65), 2)
    check_tp(CFG, 4)


class _WrongF(torch.autograd.Function):
    """f written as g: all-reduce in forward, nothing in backward (the wrong direction)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        out = x.clone()
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class _WrongColumn(torch.nn.Module):
    def __init__(self, full: torch.nn.Linear, group: Any = None) -> None:
        import torch.distributed as dist

        super().__init__()
        r, t = dist.get_rank(group), dist.get_world_size(group)
        n = full.out_features // t
        self.weight = torch.nn.Parameter(full.weight.detach()[r * n : (r + 1) * n].clone())
        self.bias = torch.nn.Parameter(full.bias.detach()[r * n : (r + 1) * n].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(_WrongF.apply(x), self.weight, self.bias)


class _Row(torch.nn.Module):
    """labkit's RowParallelLinear behind the exercise's constructor."""

    def __init__(self, full: torch.nn.Linear, group: Any = None) -> None:
        from labkit.collectives import Comm
        from labkit.tensor_parallel import RowParallelLinear

        super().__init__()
        self.layer = RowParallelLinear(full, Comm(group))
        self.weight, self.bias = self.layer.weight, self.layer.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


@pytest.mark.usefixtures("checks_on_warm_ranks")
def test_exercise_check_rejects_an_all_reduce_in_the_wrong_direction() -> None:
    from labkit.checks.core import CheckFailed
    from labkit.checks.tp import check_tp_layers

    with pytest.raises(CheckFailed, match=r"rank 0: ColumnParallelLinear: forward output"):
        check_tp_layers(_WrongColumn, _Row, world_sizes=(2,))
