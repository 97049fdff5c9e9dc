"""Mixed precision: the loss scaler follows torch.amp.GradScaler step for step, the master
weights keep updates that bf16 weights lose, and loss scaling rescues fp16 gradients.

Every number here is computed on the CPU; dtypes are named in each test. fp16 runs only on
tiny models (this CPU has no fp16 arithmetic: about 30x slower than fp32).
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from torch import nn

from labkit.precision import DynamicLossScaler, MixedPrecisionTrainer, update_scale
from tests.ranks import run_ranks


def _tiny(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _run_with_overflows(scaler, model, opt, overflow: dict[int, float], steps: int):
    """Train ``steps`` steps; at step s in ``overflow`` put that value (inf/nan) in a grad."""
    g = torch.Generator().manual_seed(1)
    scales, params = [], []
    for step in range(steps):
        x = torch.randn(5, 8, generator=g)
        opt.zero_grad()
        scaler.scale(model(x).pow(2).mean()).backward()
        if step in overflow:
            model[2].weight.grad[1, 3] = overflow[step]
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        params.append([p.detach().clone() for p in model.parameters()])
    return scales, params


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(init_scale=2.0**10, growth_factor=2.0, backoff_factor=0.5, growth_interval=3),
        # not powers of 2
        dict(init_scale=1000.0, growth_factor=3.0, backoff_factor=0.3, growth_interval=2),
        # growth hits fp32 max
        dict(init_scale=2.0**126, growth_factor=4.0, backoff_factor=0.5, growth_interval=1),
    ],
)
def test_scaler_matches_gradscaler_with_injected_overflows(kwargs):
    overflow = {
        2: float("inf"),
        3: float("nan"),
        4: float("-inf"),
        9: float("inf"),
        15: float("nan"),
    }
    ours_model, ref_model = _tiny(), _tiny()
    ours_opt = torch.optim.SGD(ours_model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.05, momentum=0.9)
    ours = DynamicLossScaler(**kwargs)
    ref = torch.amp.GradScaler("cpu", **kwargs)
    s_ours, p_ours = _run_with_overflows(ours, ours_model, ours_opt, overflow, 20)
    s_ref, p_ref = _run_with_overflows(ref, ref_model, ref_opt, overflow, 20)
    assert s_ours == s_ref  # the same sequence of scales, bit for bit (floats compared exactly)
    for step, (a, b) in enumerate(zip(p_ours, p_ref)):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), f"parameters differ after step {step}"
    # skipped steps: exactly the overflow steps, parameters untouched there
    for step in overflow:
        assert all(torch.equal(x, y) for x, y in zip(p_ours[step], p_ours[step - 1]))
    assert ours.state_dict() == ref.state_dict()
    assert len(set(s_ours)) > 2  # the trace both grew and backed off


def test_update_rule_matches_torch_kernel_on_random_sequences():
    rng = random.Random(0)
    for _ in range(50):
        gf, bf, gi = rng.choice([2.0, 1.5, 3.0]), rng.choice([0.5, 0.25, 0.7]), rng.randint(1, 4)
        scale, tracker = rng.choice([1.0, 2.0**16, 3e37]), 0
        t_scale, t_tracker = (
            torch.tensor(scale, dtype=torch.float32),
            torch.tensor(0, dtype=torch.int32),
        )
        scale = float(t_scale)
        for _ in range(30):
            found = rng.random() < 0.3
            scale, tracker = update_scale(
                scale, tracker, found, growth_factor=gf, backoff_factor=bf, growth_interval=gi
            )
            torch._amp_update_scale_(t_scale, t_tracker, torch.tensor(float(found)), gf, bf, gi)
            assert (scale, tracker) == (float(t_scale), int(t_tracker))


def test_scaler_state_dict_roundtrip_and_interop():
    ours = DynamicLossScaler(init_scale=512.0, growth_interval=7)
    ref = torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=5)
    ref.load_state_dict(ours.state_dict())  # GradScaler accepts ours...
    ours2 = DynamicLossScaler()
    ours2.load_state_dict(ref.state_dict())  # ...and we accept GradScaler's
    assert ours2.state_dict() == ours.state_dict()
    with pytest.raises(KeyError, match="missing"):
        DynamicLossScaler().load_state_dict({"scale": 1.0})


def test_scaler_rejects_bad_arguments_and_misuse():
    for bad in (
        dict(init_scale=0.0),
        dict(growth_factor=1.0),
        dict(backoff_factor=1.0),
        dict(growth_interval=0),
    ):
        with pytest.raises(ValueError):
            DynamicLossScaler(**bad)
    model = _tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = DynamicLossScaler()
    s.scale(model(torch.randn(2, 8)).sum()).backward()
    s.unscale_(opt)
    with pytest.raises(RuntimeError, match="already"):
        s.unscale_(opt)
    s.step(opt)
    s.update()
    with pytest.raises(RuntimeError, match="update"):
        s.update()


def test_master_weights_float32_is_plain_training():
    """With dtype=float32 and no scaler the trainer must be exactly ordinary training."""
    a, b = _tiny(), _tiny()
    trainer = MixedPrecisionTrainer(
        a, lambda ps: torch.optim.AdamW(ps, lr=1e-2), dtype=torch.float32
    )
    opt = torch.optim.AdamW(b.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        x = torch.randn(4, 8, generator=g)
        trainer.zero_grad()
        trainer.backward(trainer.model(x).pow(2).mean())
        assert trainer.step()
        opt.zero_grad()
        b(x).pow(2).mean().backward()
        opt.step()
    assert all(torch.equal(m, p) for m, p in zip(trainer.master, b.parameters()))


def test_bf16_master_weights_keep_updates_that_bf16_weights_lose():
    """dtype bfloat16: 20 updates of 1e-3 on a weight equal to 1.0 are each below half a bf16
    ulp (2^-8); pure bf16 weights never move, fp32 master weights move by 0.02."""

    def model():
        lin = nn.Linear(1, 1, bias=False)
        nn.init.ones_(lin.weight)
        return lin

    pure = model().to(torch.bfloat16)
    pure_opt = torch.optim.SGD(pure.parameters(), lr=1e-3)
    trainer = MixedPrecisionTrainer(
        model(), lambda ps: torch.optim.SGD(ps, lr=1e-3), dtype=torch.bfloat16
    )
    x = torch.ones(1, 1)
    for _ in range(20):  # d(output)/dw = x = 1, so every step subtracts lr * 1
        pure_opt.zero_grad()
        pure(x.bfloat16()).sum().backward()
        pure_opt.step()
        trainer.zero_grad()
        trainer.backward(trainer.model(x.bfloat16()).sum())
        trainer.step()
    assert pure.weight.item() == 1.0  # every update rounded away
    assert trainer.master[0].item() == pytest.approx(1.0 - 20e-3, abs=1e-6)
    assert trainer.model.weight.dtype == torch.bfloat16
    # the re-rounded copy moved
    assert trainer.model.weight.item() == torch.tensor(0.98).bfloat16().item()


def test_bf16_training_tracks_fp32():
    """dtype bfloat16 vs float32 on a tiny MLP regression: same trajectory within bf16 noise."""
    torch.manual_seed(0)
    x, y = torch.randn(64, 8), torch.randn(64, 4)
    ref = _tiny()
    trainer = MixedPrecisionTrainer(
        _tiny(), lambda ps: torch.optim.Adam(ps, lr=1e-2), dtype=torch.bfloat16
    )
    opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for _ in range(40):
        opt.zero_grad()
        ref_loss = nn.functional.mse_loss(ref(x), y)
        ref_loss.backward()
        opt.step()
        trainer.zero_grad()
        loss = nn.functional.mse_loss(trainer.model(x.bfloat16()).float(), y)
        trainer.backward(loss)
        trainer.step()
    assert loss.item() < 0.8 * nn.functional.mse_loss(_tiny()(x), y).item()  # it learned
    assert abs(loss.item() - ref_loss.item()) < 0.05 * ref_loss.item()
    assert all(m.dtype == torch.float32 for m in trainer.master)


def test_fp16_loss_scaling_rescues_underflowing_gradients():
    """dtype float16, tiny model: gradients of size ~1e-9 are 0 in fp16 (below 2^-24 ~ 6e-8)
    without scaling; with a dynamic scaler they survive and match the fp32 update."""
    torch.manual_seed(0)
    x = torch.randn(16, 8)

    def tiny_loss(m, dtype):
        return 1e-8 * m(x.to(dtype)).float().pow(2).mean()

    ref = _tiny()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1e6)
    plain = MixedPrecisionTrainer(
        _tiny(), lambda ps: torch.optim.SGD(ps, lr=1e6), dtype=torch.float16
    )
    scaled = MixedPrecisionTrainer(
        _tiny(),
        lambda ps: torch.optim.SGD(ps, lr=1e6),
        dtype=torch.float16,
        scaler=DynamicLossScaler(init_scale=2.0**24),
    )
    tiny_loss(ref, torch.float32).backward()
    ref_opt.step()
    for t in (plain, scaled):
        t.backward(tiny_loss(t.model, torch.float16))
        assert t.step()
    before = _tiny()
    moved_plain = max((m - p).abs().max().item() for m, p in zip(plain.master, before.parameters()))
    assert moved_plain == 0.0  # every fp16 gradient underflowed to zero
    for m, r in zip(scaled.master, ref.parameters()):
        torch.testing.assert_close(m, r.detach(), atol=2e-3, rtol=2e-2)  # fp16 compute, fp32 update


def test_fp16_overflow_is_skipped_and_scale_backs_off():
    """dtype float16: an initial scale of 2^30 overflows fp16 (max 65504); steps are skipped,
    master weights untouched, until the scale has backed off enough."""
    trainer = MixedPrecisionTrainer(
        _tiny(),
        lambda ps: torch.optim.SGD(ps, lr=0.1),
        dtype=torch.float16,
        scaler=DynamicLossScaler(init_scale=2.0**30),
    )
    start = [m.detach().clone() for m in trainer.master]
    x = torch.randn(8, 8).half()
    took = []
    for _ in range(20):
        trainer.zero_grad()
        trainer.backward(trainer.model(x).float().pow(2).mean())
        took.append(trainer.step())
        if not took[-1]:
            assert all(torch.equal(a, b) for a, b in zip(trainer.master, start))
    first_ok = took.index(True)
    assert first_ok >= 3 and all(took[first_ok:])
    assert trainer.scaler is not None and trainer.scaler.get_scale() == 2.0 ** (30 - first_ok)


@pytest.mark.timeout(90)
def test_found_inf_is_agreed_across_ranks():
    """2 ranks (gloo, CPU, fp32). Only rank 1's gradient overflows: with agreement both ranks
    skip and back off; without it (sync_found_inf=False) rank 0 steps and the replicas diverge."""

    def body():
        import torch.distributed as dist

        rank = dist.get_rank()
        out = {}
        for sync in (True, False):
            torch.manual_seed(0)
            model = nn.Linear(4, 1)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            s = DynamicLossScaler(init_scale=8.0, sync_found_inf=sync)
            s.scale(model(torch.ones(1, 4)).sum()).backward()
            if rank == 1:
                model.weight.grad[0, 0] = float("inf")
            took = s.step(opt)
            s.update()
            out[sync] = (took, s.get_scale(), model.weight.detach().clone())
        return out

    r0, r1 = run_ranks(body, world_size=2, timeout=60)
    assert r0[True][:2] == r1[True][:2] == (False, 4.0)
    assert torch.equal(r0[True][2], r1[True][2])
    assert r0[False][:2] == (True, 8.0) and r1[False][:2] == (False, 4.0)
    assert not torch.equal(r0[False][2], r1[False][2])


def test_trainer_rejects_non_fp32_model():
    with pytest.raises(ValueError, match="float32"):
        MixedPrecisionTrainer(_tiny().half(), lambda ps: torch.optim.SGD(ps, lr=1.0))
    with pytest.raises(ValueError, match="dtype"):
        MixedPrecisionTrainer(
            copy.deepcopy(_tiny()), lambda ps: torch.optim.SGD(ps, lr=1.0), dtype=torch.int8
        )
