"""The test suite's notebook kernels: forked from the kernel zygote (tests/kernel_zygote.py)
against spawned as jupyter_client does, each started, asked to ``import torch`` (what every
lesson's first cell does) and shut down. Interleaved rounds after one warm-up each (which
also starts the zygote); medians of wall time and of the machine's CPU seconds (/proc/stat:
run it on a quiet machine).

    .venv/bin/python benchmarks/bench_kernels.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_launch import machine_cpu_seconds  # noqa: E402
from labkit.measure.timing import interleaved_times  # noqa: E402
from tests.kernels import ipc_kernel_manager  # noqa: E402

CPU: dict[str, list[float]] = {"forked": [], "spawned": []}


def kernel_life(kind: str) -> float:
    km = ipc_kernel_manager("python3", fork=kind == "forked")  # else jupyter_client's launch
    cpu, start = machine_cpu_seconds(), time.perf_counter()
    km.start_kernel()
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=120)
    reply = kc.execute_interactive("import torch", timeout=120)
    assert reply["content"]["status"] == "ok", reply["content"]
    kc.stop_channels()
    km.shutdown_kernel(now=False)
    wall = time.perf_counter() - start
    CPU[kind].append(machine_cpu_seconds() - cpu)
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    times = interleaved_times({k: (lambda k=k: kernel_life(k)) for k in CPU},
                              steps=args.repeats, warmup=1)  # fmt: skip
    print(f"a kernel's life (start, import torch, shut down), median of {args.repeats} "
          f"interleaved rounds, {os.cpu_count()} cores")
    for kind in CPU:
        cpu = statistics.median(CPU[kind][-args.repeats:])
        print(f"  {kind:8s} {statistics.median(times[kind]) * 1e3:7.0f} ms  {cpu:.2f} CPU s")


if __name__ == "__main__":
    main()
