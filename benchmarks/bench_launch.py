"""Launch overhead: labkit.launch against `torchrun --standalone`, the same work, the same run.

Both start 2 gloo ranks that initialise the process group, all-reduce one tensor and exit.
Wall time from the call to the results, median of interleaved repeats. Also measures the time
from a rank raising to the exception in the caller.

    .venv/bin/python benchmarks/bench_launch.py [--repeats 5] [--world-size 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch
import torch.distributed as dist

import labkit
from labkit.launch import RankFailedError

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


def time_labkit(world_size: int) -> float:
    start = time.perf_counter()
    labkit.launch(work, world_size=world_size, quiet=True)
    return time.perf_counter() - start


def time_torchrun(script: Path, world_size: int) -> float:
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}", str(script)]
    subprocess.run(cmd, check=True, capture_output=True)
    return time.perf_counter() - start


def time_failure(world_size: int, log_dir: Path) -> float:
    try:
        labkit.launch(fail_on_rank_1, world_size=world_size, quiet=True, log_dir=log_dir)
    except RankFailedError as err:
        caught = time.time()
        record = json.loads(next(p for p in (err.log_dir or log_dir).parent.glob("error.1.json")).read_text())
        return caught - record["time"]
    raise AssertionError("the job did not fail")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "allreduce.py"
        script.write_text(TORCHRUN_SCRIPT)
        time_labkit(args.world_size)  # warm the page cache for both
        time_torchrun(script, args.world_size)
        ours, theirs, failures = [], [], []
        for _ in range(args.repeats):
            ours.append(time_labkit(args.world_size))
            theirs.append(time_torchrun(script, args.world_size))
            failures.append(time_failure(args.world_size, Path(tmp) / "runs"))
    o, t = statistics.median(ours), statistics.median(theirs)
    print(f"{args.world_size}-rank launch, median of {args.repeats} (torch {torch.__version__}, CPU gloo)")
    print(f"  labkit.launch           {o:6.2f} s")
    print(f"  torchrun --standalone   {t:6.2f} s")
    print(f"  ours/torchrun           {o / t:6.2f}x")
    print(f"  rank raises -> exception in caller: median {statistics.median(failures) * 1000:.0f} ms, max {max(failures) * 1000:.0f} ms")


if __name__ == "__main__":
    main()
