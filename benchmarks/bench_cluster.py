"""All-reduce busbw and DDP step time on the emulated cluster (issue 12, scenario S4).

    .venv/bin/python benchmarks/bench_cluster.py [--nodes 4] [--ranks-per-node 2]
        [--inter-mbps 50] [--steps 5] [--mode auto]

Table 1: busbw over sizes of labkit's flat all-reduce (``Comm(impl="ring")``), the
hierarchical all-reduce and torch's ``dist.all_reduce``, interleaved step by step in one
launch, medians after warm-up, with ours/torch per size. Table 2: step time of the tiny BERT
under labkit's DDP per (impl, compression, wrapper), with the exposed communication, its share
and the bytes sent. Table 3: strong scaling on 1, 2, 4 nodes next to the alpha-beta prediction.
Prints which emulation mode ran (netns: real shaped links; software: alpha-beta delays, and
torch's own collectives across nodes charged by the model rather than emulated).
Takes a few minutes; not part of the test suite.
"""

from __future__ import annotations

import argparse
import os

from labkit.measure.collectives import human_bytes


def main() -> None:
    from labkit.cluster import EmulatedCluster, probe
    from labkit.labs.bert4nodes import gradient_bytes, strong_scaling_prediction
    from labkit.measure.cluster import (
        DEFAULT_VARIANTS,
        Variant,
        measure_busbw,
        measure_ddp,
        measure_strong_scaling,
    )
    from labkit.models.bert import bert_preset

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--inter-mbps", type=float, default=50.0, help="uplink MB/s per node")
    parser.add_argument("--steps", type=int, default=5, help="timed rounds (interleaved)")
    parser.add_argument("--mode", default="auto", choices=("auto", "netns", "software"))
    args = parser.parse_args()
    world = args.nodes * args.ranks_per_node
    cluster = EmulatedCluster(
        nodes=args.nodes, inter_bandwidth=args.inter_mbps * 1e6, mode=args.mode
    )
    mode = cluster.resolved_mode()
    print(
        f"emulated cluster: {args.nodes} nodes x {args.ranks_per_node} ranks, uplink "
        f"{args.inter_mbps:g} MB/s per node, mode {mode!r}"
    )
    if mode == "software":
        print("(software mode: torch's collectives across nodes are charged a modelled cost)")

    res = measure_busbw(cluster, world, (2**12, 2**15, 2**18, 2**20, 2**22), steps=args.steps)
    impls = list(res["busbw"])
    print(f"\nall-reduce busbw (MB/s), median of {args.steps}, {world} ranks")
    print(
        f"{'size':>8}"
        + "".join(f"{i:>14}" for i in impls)
        + f"{'ring/torch':>12}{'hier/torch':>12}"
    )
    for size in sorted(res["busbw"]["torch"]):
        row = [res["busbw"][i][size] / 1e6 for i in impls]
        t = res["seconds"]
        ratio_ring = t["torch"][size] / t["ring"][size]
        ratio_hier = t["torch"][size] / t["hierarchical"][size]
        print(
            f"{human_bytes(size):>8}" + "".join(f"{v:>14.1f}" for v in row)
            + f"{ratio_ring:>12.2f}{ratio_hier:>12.2f}"
        )  # fmt: skip
    print("(ratios: torch time / ours, > 1 means ours is faster)")

    variants = (
        *DEFAULT_VARIANTS,
        Variant("hierarchical", wrapper="bucketed"),
        Variant("torch", "fp16"),
    )
    ddp = measure_ddp(cluster, world, variants, steps=args.steps)
    print(f"\nDDP step of the tiny BERT (labkit DDP, global batch 32), {world} ranks")
    print(f"{'variant':>40}{'step ms':>9}{'exposed ms':>11}{'share':>7}{'sent KB':>9}{'torch/':>8}")
    torch_step = ddp["steps"][Variant("torch").name]["step"]
    for name, row in ddp["steps"].items():
        print(
            f"{name:>40}{row['step'] * 1e3:>9.1f}{row['exposed_comm'] * 1e3:>11.1f}"
            f"{row['comm_share']:>7.0%}{row['sent'] / 1e3:>9.1f}{torch_step / row['step']:>8.2f}"
        )
    print("(torch/: torch's overlapped step time over this one, > 1 means faster than torch)")

    # Strong scaling: 1, 2, 4 nodes of one rank, global batch 32, next to alpha-beta from the
    # probed inter-node link (compute capped at the machine's cores: the nodes share them).
    def make(n: int) -> EmulatedCluster | None:
        return None if n == 1 else EmulatedCluster(n, args.inter_mbps * 1e6, mode=args.mode)

    link = probe(EmulatedCluster(2, args.inter_mbps * 1e6, mode=args.mode), 2).inter.fit
    scaling = measure_strong_scaling(make, (1, 2, 4), steps=args.steps)
    predicted = strong_scaling_prediction(
        scaling[1]["step"], gradient_bytes(bert_preset("lab")), [1, 2, 4], 1, link, link,
        algorithm="flat ring", parallel=os.cpu_count(),
    )  # fmt: skip
    print(f"\nstrong scaling, global batch 32, 1 rank per node, {os.cpu_count()} cores")
    print(f"{'nodes':>6}{'step ms':>9}{'exposed ms':>11}{'efficiency':>12}{'alpha-beta':>12}")
    for n, row in scaling.items():
        print(
            f"{n:>6}{row['step'] * 1e3:>9.1f}{row['exposed_comm'] * 1e3:>11.1f}"
            f"{row['efficiency']:>12.0%}{predicted[n]['efficiency']:>12.0%}"
        )


if __name__ == "__main__":
    main()
