"""Launch overhead: a warm labkit.World, labkit.launch and `torchrun --standalone`, the same
work, the same run.

launch and torchrun start 2 gloo ranks that initialise the process group, all-reduce one tensor
and exit; ``world.run`` sends the same all-reduce to 2 ranks that are already up. Wall time from
the call to the results, median of interleaved repeats (plus a median of 200 back-to-back
``world.run`` calls). Also the machine's CPU seconds per launch and per torchrun (all cores,
from /proc/stat: run it on a quiet machine), the time from a rank raising to the exception
in the caller, and a World's own start (start, one call, close), its ranks forked from one
import of torch (``world_zygote.py``) against each rank its own interpreter.

    .venv/bin/python benchmarks/bench_launch.py [--repeats 5] [--world-size 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

import labkit
from labkit.launch import RankFailedError, world_procs
from labkit.measure.timing import interleaved_times, spread

TORCHRUN_SCRIPT = textwrap.dedent(
    """
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    """
)


def work() -> float:
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def fail_on_rank_1() -> None:
    if dist.get_rank() == 1:
        raise RuntimeError("injected")
    dist.all_reduce(torch.ones(1))


CPU: dict[str, list[float]] = {"launch": [], "torchrun": [], "forked": [], "spawned": []}


def machine_cpu_seconds() -> float:
    """Busy CPU seconds of the whole machine so far (every core; Linux's /proc/stat)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # minus idle, iowait


def time_world(world: labkit.World) -> float:
    start = time.perf_counter()
    world.run(work, quiet=True)
    return time.perf_counter() - start


def _wall_and_cpu(kind: str, run: Callable[[], object]) -> float:
    """Wall seconds of ``run()``; the machine's CPU seconds go to ``CPU[kind]``."""
    cpu, start = machine_cpu_seconds(), time.perf_counter()
    run()
    wall = time.perf_counter() - start
    time.sleep(0.5)  # the job's teardown finishes inside the CPU window
    CPU[kind].append(machine_cpu_seconds() - cpu)
    return wall


def time_labkit(world_size: int) -> float:
    return _wall_and_cpu("launch", lambda: labkit.launch(work, world_size=world_size, quiet=True))


def time_world_start(world_size: int, fork: bool) -> float:
    """A World's whole life: start ``world_size`` ranks, one call, close."""

    def life() -> None:
        default, world_procs.FORK_RANKS = world_procs.FORK_RANKS, fork
        try:
            with labkit.World(world_size, backend="gloo", quiet=True) as world:
                world.run(work, quiet=True)
        finally:
            world_procs.FORK_RANKS = default

    return _wall_and_cpu("forked" if fork else "spawned", life)


def time_torchrun(script: Path, world_size: int) -> float:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={world_size}",
        str(script),
    ]
    return _wall_and_cpu("torchrun", lambda: subprocess.run(cmd, check=True, capture_output=True))


def time_failure(world_size: int, log_dir: Path) -> float:
    try:
        labkit.launch(fail_on_rank_1, world_size=world_size, quiet=True, log_dir=log_dir)
    except RankFailedError as err:
        caught = time.time()
        record = json.loads(
            next(p for p in (err.log_dir or log_dir).parent.glob("error.1.json")).read_text()
        )
        return caught - record["time"]
    raise AssertionError("the job did not fail")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    n = args.world_size
    start = time.perf_counter()
    world = labkit.World(n, backend="gloo", quiet=True)
    world_start = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as tmp, world:
        script = Path(tmp) / "allreduce.py"
        script.write_text(TORCHRUN_SCRIPT)
        times = interleaved_times(
            {
                "world.run": lambda: time_world(world),
                "launch": lambda: time_labkit(n),
                "torchrun": lambda: time_torchrun(script, n),
                "forked": lambda: time_world_start(n, True),
                "spawned": lambda: time_world_start(n, False),
            },
            steps=args.repeats,
            warmup=1,  # warms the page cache for every contender
        )
        burst = [time_world(world) for _ in range(200)]
        failures = [time_failure(n, Path(tmp) / "runs") for _ in range(args.repeats)]
    w, o, t = (statistics.median(times[k]) for k in ("world.run", "launch", "torchrun"))
    print(f"{n}-rank round trip of an all-reduce, median of {args.repeats} interleaved rounds")
    print(f"(torch {torch.__version__}, CPU gloo, {os.cpu_count()} cores)")
    print(f"  world.run (warm World)  {w * 1e3:8.1f} ms   200 in a row: {spread(burst)}")
    print(f"  labkit.launch           {o * 1e3:8.1f} ms")
    print(f"  torchrun --standalone   {t * 1e3:8.1f} ms")
    print(f"  launch/torchrun         {o / t:8.2f}x")
    cl, ct = (statistics.median(CPU[k]) for k in ("launch", "torchrun"))
    print(f"  machine CPU s per run   launch {cl:.2f}, torchrun {ct:.2f} ({cl / ct:.2f}x)")
    print(f"  world.run/torchrun      {w / t:8.4f}x   (launch/world.run: {o / w:.0f}x)")
    print(f"  starting the World once {world_start * 1e3:8.1f} ms")
    f, p = (statistics.median(times[k]) for k in ("forked", "spawned"))
    cf, cp = (statistics.median(CPU[k]) for k in ("forked", "spawned"))
    print(f"  World life (start, 1 call, close): ranks forked {f * 1e3:.0f} ms, {cf:.2f} CPU s;"
          f" each its own interpreter {p * 1e3:.0f} ms, {cp:.2f} CPU s")
    med, worst = statistics.median(failures) * 1000, max(failures) * 1000
    print(f"  rank raises -> exception in caller: median {med:.0f} ms, max {worst:.0f} ms")


if __name__ == "__main__":
    main()
