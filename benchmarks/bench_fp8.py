"""labkit's FP8 linear (each recipe, emulated and through torch._scaled_mm) against torch's
bf16 linear, and against torchao's Float8Linear where torchao is importable.

    .venv/bin/python benchmarks/bench_fp8.py [--steps 15] [--m 1024 --k 1024 --n 1024]
                                             [--device cpu|cuda]

One call = forward and backward of one linear, x (m, k) -> (m, n), the three GEMMs of
:mod:`labkit.precision.fp8.linear`. All contenders run interleaved round by round
(:func:`labkit.measure.timing.interleaved_times`, the order alternating), after warm-up;
each row prints the median time and the 95% interval of the median per-round ratio to
torch's bf16 linear (:func:`labkit.measure.bench_cells.median_interval`), and a verdict
against 1.0x (FP8 faster than bf16). A second table times the bare GEMM: ``torch._scaled_mm``
on e4m3 operands against a bf16 ``torch.mm`` of the same shape.

On a CPU there are no FP8 units: ``_scaled_mm`` converts and multiplies in software, so FP8
loses to bf16 here and the interesting number is the *overhead* of the recipes (amax,
scale, cast, requantisation). On an H100/H200 the same script measures the real thing.
torchao's "tensorwise" recipe is the same algorithm as ours: its ratio is the peer check.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from labkit.measure.bench_cells import verdict
from labkit.measure.timing import interleaved_times
from labkit.precision.fp8 import E4M3, Fp8Config, Fp8Linear


def _contenders(m: int, k: int, n: int, device: str) -> dict[str, Callable[[], object]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g).to(device)
    dy = torch.randn(m, n, generator=g).to(device) * 1e-3
    base = torch.nn.Linear(k, n, bias=False).to(device)

    def step(module: torch.nn.Module, inp: torch.Tensor, grad: torch.Tensor
             ) -> Callable[[], object]:  # fmt: skip
        inp = inp.detach().requires_grad_()

        def run() -> object:
            out = module(inp)
            out.backward(grad)
            module.zero_grad(set_to_none=True)
            inp.grad = None
            return out

        return run

    bf16 = torch.nn.Linear(k, n, bias=False).to(device, torch.bfloat16)
    fns = {"torch bf16 linear": step(bf16, x.bfloat16(), dy.bfloat16())}
    for recipe in ("tensorwise", "delayed", "rowwise", "tiles"):
        for kernel in ("emulated", "scaled_mm"):
            lin = torch.nn.Linear(k, n, bias=False).to(device)
            lin.load_state_dict(base.state_dict())
            fns[f"labkit {recipe} {kernel}"] = step(Fp8Linear(lin, Fp8Config(recipe, kernel)),
                                                     x, dy)  # fmt: skip
    try:  # the peer, optional: torchao's float8 training (torchtitan's)
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        for recipe in ("tensorwise", "rowwise"):
            seq = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False)).to(device)
            convert_to_float8_training(seq, config=Float8LinearConfig.from_recipe_name(recipe))
            fns[f"torchao {recipe}"] = step(seq, x, dy)
    except Exception as exc:  # noqa: BLE001 - absent or failing: say so and go on
        print(f"torchao float8 not run: {type(exc).__name__}: {exc}")
    return fns


def _gemm(m: int, k: int, n: int, device: str) -> dict[str, Callable[[], object]]:
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(m, k, generator=g).to(device), torch.randn(n, k, generator=g).to(device)
    a8, b8 = a.to(E4M3), b.to(E4M3).t()  # B column-major, as cuBLASLt wants it
    one = torch.ones((), device=device)
    a16, b16 = a.bfloat16(), b.bfloat16().t()
    return {
        "torch.mm bf16": lambda: torch.mm(a16, b16),
        "torch._scaled_mm e4m3 -> bf16": lambda: torch._scaled_mm(
            a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
    }  # fmt: skip


def _table(times: dict[str, list[float]], ref: str) -> None:
    base = times[ref]
    print(f"{'contender':34} {'median (ms)':>12}  ours/theirs vs {ref!r}")
    for name, t in times.items():
        med = sorted(t)[len(t) // 2] * 1e3
        if name == ref:
            print(f"{name:34} {med:12.2f}  (the reference)")
            continue
        print(f"{name:34} {med:12.2f}  {verdict(t, base, 1.0)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--m", type=int, default=1024)
    p.add_argument("--k", type=int, default=1024)
    p.add_argument("--n", type=int, default=1024)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    a = p.parse_args()
    sync = torch.cuda.synchronize if a.device == "cuda" else None
    print(f"torch {torch.__version__}, device {a.device}, threads {torch.get_num_threads()}, "
          f"linear ({a.m} x {a.k}) -> {a.n}, {a.steps} interleaved rounds")  # fmt: skip
    print("\n== one linear, forward + backward (3 GEMMs)")
    fns = _contenders(a.m, a.k, a.n, a.device)
    times = interleaved_times(fns, a.steps, warmup=2, sync=sync)
    _table(times, "torch bf16 linear")
    for recipe in ("tensorwise", "rowwise"):
        if f"torchao {recipe}" in times:  # the peer: the same recipe, same rounds
            ours, theirs = times[f"labkit {recipe} scaled_mm"], times[f"torchao {recipe}"]
            print(f"labkit {recipe} scaled_mm against torchao {recipe}: "
                  f"{verdict(ours, theirs, 1.10)}")  # fmt: skip
    print("\n== the bare GEMM")
    _table(interleaved_times(_gemm(a.m, a.k, a.n, a.device), a.steps, sync=sync),
           "torch.mm bf16")  # fmt: skip


if __name__ == "__main__":
    main()
