"""The curriculum: ONE list of the lessons, from which notebook 00's map and the README's
curriculum table are both printed (``tests/test_lessons.py`` checks that the README shows
exactly :func:`markdown_table` and that every notebook in ``notebooks/`` is listed here).

A lesson is its notebook's stem, what a learner takes away from it, the ``labkit/`` code it
teaches, and its exercise (a notebook in ``exercises/``, generated from ``solutions/``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LESSONS", "Lesson", "lesson", "markdown_table"]


@dataclass(frozen=True)
class Lesson:
    name: str  # the notebook's stem, "01_mnist_ddp"
    learn: str  # what a learner takes away, one line of markdown
    code: tuple[str, ...]  # paths under labkit/ it teaches
    exercise: str = ""  # the exercise notebook's stem, "" when the lesson has none
    exercise_task: str = ""  # what the exercise asks
    rehearses: tuple[str, ...] = ()  # interview ids it measures (notebook 14's last column)

    @property
    def number(self) -> int:
        return int(self.name.split("_", 1)[0])


LESSONS: tuple[Lesson, ...] = (
    Lesson(
        "00_welcome",
        "the machine, a first 2-rank job, what a failing or hung rank looks like, how"
        " exercises work",
        ("launch/",),
        "00_warmup",
        "gather every rank's id",
    ),
    Lesson(
        "01_mnist_ddp",
        "data parallelism on real MNIST digits with PyTorch DDP: gradient sync proven"
        " bit-exact, speedup, effective batch, LR scaling, warmup",
        ("data/mnist.py", "data/sampler.py", "labs/mnist.py"),
        "",
        "",
        rehearses=("S1", "S2", "A3", "K1", "K5", "P2"),
    ),
    Lesson(
        "02_collectives",
        "point-to-point, naive vs ring all-reduce step by step, busbw against gloo, the α-β model",
        ("collectives/",),
        "02_ring",
        "ring reduce-scatter and all-gather",
        rehearses=("A4", "K6"),
    ),
    Lesson(
        "03_ddp_from_scratch",
        "DDP naive → flat → bucketed → overlapped with backward, bucket sweep, overlap timeline",
        ("ddp/",),
        "03_ddp_hooks",
        "bucketed overlapped hooks",
        rehearses=("S2", "S4", "A4"),
    ),
    Lesson(
        "04_memory_precision_checkpoints",
        "mixed precision with dynamic loss scaling, activation checkpointing, sharded"
        " checkpoints that survive a killed rank",
        ("precision/", "activation_checkpoint/", "checkpoint/"),
        "04_loss_scaler",
        "the scaler's update rule",
        rehearses=("S3", "K3", "K4", "K10", "K11"),
    ),
    Lesson(
        "05_zero",
        "ZeRO-1/2/3 with a measured memory ledger against the paper's formulas, vs "
        "ZeroRedundancyOptimizer and FSDP2",
        ("zero/", "memory/"),
        "05_zero1",
        "the ZeRO-1 step",
        rehearses=("S3", "S7", "A2", "K2", "K3", "P3"),
    ),
    Lesson(
        "06_tensor_parallel",
        "Megatron tensor parallelism: f and g, column/row-parallel layers, parallel "
        "attention, vocab-parallel loss, sequence parallelism, communication per "
        "layer, activation memory against Korthikanti",
        ("parallel/", "tensor_parallel/"),
        "06_tp_layers",
        "column- and row-parallel linear",
        rehearses=("S5", "K2"),
    ),
    Lesson(
        "07_pipeline_parallel",
        "schedules as data (GPipe, 1F1B, interleaved, ZB-H1), a validator and "
        "simulator, then real runs; bubble and stash against theory; a schedule "
        "widget",
        ("pipeline/",),
        "07_1f1b",
        "the 1F1B schedule",
        rehearses=("S5", "K2", "P3"),
    ),
    Lesson(
        "08_3d_100b_on_64_gpus",
        "dp x tp x pp composed and run on 8 processes, the rank grid, the planner "
        "(checked against Megatron's Table 1: what holds and what does not) on 100B "
        "over 8 x 8 GPUs, a plan widget",
        ("parallel/", "planner/", "labs/threed.py"),
        "08_plan_100b",
        "choose a layout, estimate its memory",
        rehearses=("S5", "S6"),
    ),
    Lesson(
        "09_bert_on_4_nodes",
        "scenario S4: BERT-style fine-tuning with DDP on 4 emulated nodes over a slow"
        " link: communication share, buckets, overlap, fp16/bf16 and PowerSGD "
        "compression, hierarchical all-reduce, strong scaling against the α-β "
        "prediction, the A4 answer",
        (
            "cluster/",
            "collectives/hierarchical.py",
            "ddp/compression.py",
            "models/bert.py",
            "labs/bert4nodes.py",
        ),
        "",
        "",
        rehearses=("S4", "A1", "A4", "K6"),
    ),
    Lesson(
        "10_10b_mixed_interconnects",
        "scenario S5: a 10B GPT on nodes with fast NVLink inside and slow links "
        "between; the planner with two link classes (why tp stays in the node, and "
        "which groups cross it), a miniature of the layout measured on the emulated cluster "
        "against its prediction",
        ("planner/links.py", "labs/mixed_links.py", "cluster/"),
        "",
        "",
        rehearses=("S5", "K2", "P3"),
    ),
    Lesson(
        "11_gpt2_1p3b_capstone",
        "fine-tuning GPT-2 1.3B under a memory limit: the memory table and widget, a "
        "CPU proxy measured against the estimate, the real thing on a GPU",
        ("memory/estimate.py", "measure/capstone.py", "viz/"),
        "",
        "",
        rehearses=("S3",),
    ),
    Lesson(
        "12_diagnosis_drills",
        "profiler-first diagnosis: per-rank step breakdown, traces, utilisation "
        "against FLOP efficiency, mystery runs with hidden faults",
        ("profiling/", "labs/drills.py"),
        "12_diagnosis",
        "name the fault",
        rehearses=("S8", "A1", "A4", "K7", "K8", "K12", "P1"),
    ),
    Lesson(
        "13_interview_walkthroughs",
        "a rehearsal for every scenario, strategy, core item and pitfall, worked with"
        " labkit's functions",
        ("interview/",),
        "13_interview_quiz",
        "checked questions",
    ),
    Lesson(
        "14_interview_index",
        "every interview id with a link to where it is rehearsed",
        ("interview/topics.md",),
        "",
        "",
    ),
    Lesson(
        "15_long_context",
        "context parallelism: attention memory O(s²) against flash kernels, what a "
        "128k sequence costs per GPU, ring attention step by step (forward and "
        "backward on the saved log-sum-exp), the causal imbalance and its zigzag fix,"
        " Ulysses against the ring, when CP and when SP",
        ("context_parallel/", "measure/context_parallel.py"),
        "15_online_softmax",
        "merge two attention blocks",
        rehearses=("K13",),
    ),
    Lesson(
        "16_experts",
        "mixture of experts: parameters against FLOPs per token (Mixtral, DeepSeek-V3"
        " shapes), top-k routing, capacity and drops, the balancing loss measured, "
        "expert parallelism with all-to-all against an all-gather dispatch, EP inside"
        " and across nodes",
        ("experts/", "collectives/all_to_all.py", "models/moe.py"),
        "16_all_to_all_dispatch",
        "route tokens to their experts",
        rehearses=("K14",),
    ),
    Lesson(
        "17_node_loss",
        "when a node dies: each rank's real error, torchrun's elastic restart on "
        "fewer nodes, the checkpoint resharded with the global batch kept, "
        "asynchronous saves and their cost, Young/Daly, the S6 fallback rehearsed",
        ("labs/node_loss.py", "checkpoint/", "cluster/"),
        "",
        "",
        rehearses=("S6", "K11"),
    ),
    Lesson(
        "18_fp8_and_overlap",
        "FP8 from scratch: e4m3/e5m2 against bf16/fp16, four scaling recipes (tensorwise,"
        " delayed, rowwise, DeepSeek-V3 tiles) measured on the same GEMMs, an FP8 GPT's"
        " curve against bf16's seed spread; tensor-parallel communication overlapped with"
        " its matmuls",
        ("precision/fp8/", "measure/fp8.py", "labs/fp8_training.py"),
        "18_delayed_scaling",
        "Transformer Engine's delayed-scaling update",
        rehearses=("K15", "K16"),
    ),
)


def lesson(number: int) -> Lesson:
    """The lesson numbered ``number`` (0 for the welcome notebook)."""
    for one in LESSONS:
        if one.number == number:
            return one
    raise KeyError(f"no lesson {number}: the lessons are {[x.number for x in LESSONS]}")


def markdown_table(*, code: bool = True) -> str:
    """The curriculum as a markdown table: notebook, what you learn, (code,) exercise."""
    head = ["notebook", "what you learn", *(["code in `labkit/`"] if code else []), "exercise"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for x in LESSONS:
        cells = [f"`{x.name}`", x.learn]
        if code:
            cells.append(", ".join(f"`{c}`" for c in x.code))
        cells.append(f"`{x.exercise}`: {x.exercise_task}" if x.exercise else "")
        rows.append("|" + "|".join(f" {c} " if c else " " for c in cells) + "|")
    return "\n".join(rows)
