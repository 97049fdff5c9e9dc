"""Checked questions for every interview topic id: 2-4 each, answers computed by labkit code.

Why this module is long: it is mostly data, a bank of 2-4 questions for each topic id;
the checking logic is a small part of it.

A question's ``solution`` is a Python expression over labkit's functions (the namespace
:func:`namespace`); its value IS the expected answer, so a question can never disagree with
the code it rehearses. Numeric answers are checked within ``rel_tol``; choice answers must be
one of ``choices`` and equal the computed one. ``why`` is shown when an answer is wrong.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

__all__ = ["Question", "QUESTIONS", "namespace", "expected", "questions_for"]


@dataclass(frozen=True)
class Question:
    qid: str  # "<topic>.<n>", e.g. "S2.1"
    prompt: str
    solution: str  # an expression in namespace(); its value is the answer
    why: str  # the reasoning, shown on a wrong answer
    choices: tuple[str, ...] | None = None
    rel_tol: float = 0.02

    @property
    def topic(self) -> str:
        return self.qid.split(".")[0]


@functools.cache
def namespace() -> dict[str, Any]:
    """The names a ``solution`` may use: labkit's estimates, memory and cost models."""
    import math

    from labkit.collectives import cost_model
    from labkit.interview import estimates
    from labkit.labs.mnist import effective_batch, lr_at, scaled_lr
    from labkit.memory import model as memory
    from labkit.models.gpt import count_params_meta, preset
    from labkit.profiling import derived

    ns: dict[str, Any] = {"math": math, "memory": memory, "cost_model": cost_model}
    ns.update({k: getattr(estimates, k) for k in estimates.__all__})
    ns.update({k: getattr(derived, k) for k in derived.__all__})
    ns.update(effective_batch=effective_batch, lr_at=lr_at, scaled_lr=scaled_lr)
    ns.update(count_params_meta=count_params_meta, preset=preset, GB=1e9, MB=1e6)
    ns.update(
        model_states=memory.model_states, MIXED_ADAM=memory.MIXED_ADAM, FP32_ADAM=memory.FP32_ADAM
    )
    ns.update(act=memory.activation_bytes_per_layer, ring=cost_model.ring_all_reduce_time)
    return ns


def expected(q: Question) -> Any:
    """The value of ``q.solution`` (computed once per question)."""
    return _evaluate(q.solution)


@functools.cache
def _evaluate(solution: str) -> Any:
    return eval(solution, namespace())  # noqa: S307 - our own expressions, not user input


_RESNET = "resnet50_counts()"
STAGE_CHOICES = ("ddp", "zero1", "zero2", "zero3", "model parallel")

QUESTIONS: dict[str, Question] = {
    q.qid: q
    for q in [
        # ---- scenarios ------------------------------------------------------------------
        Question(
            "S1.1",
            "MNIST on 2 GPUs, 64 images per GPU, no accumulation: the effective batch?",
            "effective_batch(64, 2, 1)",
            "effective batch = per-GPU batch x GPUs x accumulation (K1).",
        ),
        Question(
            "S1.2",
            "The single-GPU recipe used lr 0.05 at batch 64. Linear scaling: the lr at 2 GPUs x "
            "64?",
            "scaled_lr(0.05, 64, effective_batch(64, 2, 1))",
            "k times the batch, k times the lr (Goyal et al. 2017).",
        ),
        Question(
            "S2.1",
            "Real ResNet-50 (parameters counted by labkit), AMP (autocast keeps gradients in "
            "fp32), 4 GPUs on PCIe: seconds of one ring all-reduce of the gradients "
            "(LINKS['PCIe'])?",
            f"ring({_RESNET}[0] * 4, 4, LINKS['PCIe'].alpha, LINKS['PCIe'].beta)",
            "2(p-1) alpha + 2(p-1)/p * D * beta with D = 4 bytes x 25.6M parameters (fp32: "
            "only a compression hook sends 2).",
        ),
        Question(
            "S2.2",
            "Same on NVLink: how many times faster is the all-reduce than on PCIe?",
            f"ring({_RESNET}[0] * 4, 4, LINKS['PCIe'].alpha, LINKS['PCIe'].beta) / "
            f"ring({_RESNET}[0] * 4, 4, LINKS['NVLink'].alpha, LINKS['NVLink'].beta)",
            "at 102 MB the transfer is bandwidth-bound: the ratio is close to the bandwidth ratio.",
        ),
        Question(
            "S2.3",
            "Without overlap, 64 images per GPU on 4 PCIe GPUs (predict_ddp_step's defaults): "
            "weak-scaling efficiency t1 / t4?",
            f"weak_efficiency(predict_ddp_step(*{_RESNET}, 64, 1, LINKS['PCIe'], "
            f"overlap=False).step, "
            f"predict_ddp_step(*{_RESNET}, 64, 4, LINKS['PCIe'], overlap=False).step)",
            "t1 is pure compute; t4 adds the exposed all-reduce. Overlap with backward would "
            "hide it.",
        ),
        Question(
            "S3.1",
            "GPT-2 1.3B (preset 'gpt2-1.3b'), mixed-precision Adam, plain DDP: GB of model "
            "states per GPU?",
            "model_states('ddp', count_params_meta(preset('gpt2-1.3b')), 8).total / GB",
            "16 bytes per parameter (2 fp16 weights + 2 fp16 grads + 12 Adam/master), not sharded.",
        ),
        Question(
            "S3.2",
            "8 GPUs of 24 GB, 4 GB of activations each: the first DDP/ZeRO stage that fits?",
            "first_fitting_stage(count_params_meta(preset('gpt2-1.3b')), 8, 4 * GB, 24 * GB)",
            "walk the ladder: DDP 16 psi, ZeRO-1 4psi + 12psi/N, ZeRO-2 2psi + 14psi/N, ZeRO-3 "
            "16psi/N.",
            choices=STAGE_CHOICES,
        ),
        Question(
            "S4.1",
            "BERT-base (110M parameters), fp16 gradients, ring all-reduce over 4 nodes on "
            "25 Gb/s Ethernet (LINKS['Ethernet25']): seconds per step?",
            "ring(110e6 * 2, 4, LINKS['Ethernet25'].alpha, LINKS['Ethernet25'].beta)",
            "220 MB at ~2.5 GB/s, times 2(p-1)/p: network, not compute, sets the pace.",
        ),
        Question(
            "S4.2",
            "Same gradients in 1 MB buckets instead of one message: extra latency seconds "
            "(alpha terms only) the buckets add?",
            "(math.ceil(110e6 * 2 / MB) - 1) * 2 * 3 * LINKS['Ethernet25'].alpha",
            "each all-reduce pays 2(p-1) alpha; 220 buckets pay it 220 times. Buckets buy overlap.",
        ),
        Question(
            "S5.1",
            "10B parameters, mixed Adam, tensor parallel 8 inside a node and ZeRO-1 over 4 "
            "data-parallel replicas: GB of model states per GPU (model_states on psi/8)?",
            "model_states('zero1', 10e9 / 8, 4).total / GB",
            "tensor parallelism divides psi by t; ZeRO-1 then shards the optimizer over the "
            "replicas.",
        ),
        Question(
            "S5.2",
            "Which link should carry tensor parallelism, whose all-reduces run inside every layer?",
            "'NVLink' if LINKS['NVLink'].beta < LINKS['InfiniBand'].beta else 'InfiniBand'",
            "tensor parallel communicates every layer, forward and backward: the fastest link.",
            choices=("NVLink", "InfiniBand"),
        ),
        Question(
            "S6.1",
            "100B parameters, mixed Adam: TB of model states in total (before any sharding)?",
            "model_states('ddp', 100e9, 1).total / 1e12",
            "16 bytes x 100e9 = 1.6 TB.",
        ),
        Question(
            "S6.2",
            "Spread evenly over all 64 GPUs (ZeRO-3, or TP x PP = 64): GB per GPU?",
            "model_states('zero3', 100e9, 64).total / GB",
            "1.6 TB / 64; activations come on top, so TP/PP with recompute are needed here.",
        ),
        Question(
            "S7.1",
            "2B model on 64 GPUs, mixed Adam, ZeRO-2: GB of model states per GPU?",
            "model_states('zero2', 2e9, 64).total / GB",
            "2psi fp16 weights stay; (2 + 12) psi / 64 shard.",
        ),
        Question(
            "S7.2",
            "Activations 20 GB per GPU on 80 GB GPUs: first stage that fits (the ladder)?",
            "first_fitting_stage(2e9, 64, 20 * GB)",
            "DDP needs 32 GB + 20 GB: fits already.",
            choices=STAGE_CHOICES,
        ),
        Question(
            "S7.3",
            "Micro-batch 4 per GPU, 64 GPUs, target global batch 2048: accumulation steps?",
            "2048 // effective_batch(4, 64, 1)",
            "global = micro x GPUs x accumulation (K1).",
        ),
        Question(
            "S8.1",
            "A loader needs 6 ms per image per worker and the GPUs eat 1500 images/s: "
            "workers needed (workers_needed)?",
            "workers_needed(1500, 6e-3)",
            "each worker makes 1/0.006 images/s.",
        ),
        Question(
            "S8.2",
            "Step 100 ms of which forward+backward+optimizer 40 ms: compute's share of the step?",
            "40 / 100",
            "compute / step; the rest is data, communication or host overhead (nvidia-smi would"
            " also count the all-reduce kernels as busy).",
        ),
        # ---- answer strategies ----------------------------------------------------------
        Question(
            "A1.1",
            "Clean step: data 2 ms, comm 10 ms. Slow step: data 60 ms, comm 40 ms. "
            "Which category to fix first (the largest growth)?",
            "max({'data': 60 - 2, 'comm': 40 - 10}.items(), key=lambda kv: kv[1])[0]",
            "fix the largest departure; comm grew because ranks waited on a slow loader.",
            choices=("data", "comm"),
        ),
        Question(
            "A1.2",
            "Gloo all-reduce measured alpha 50 us: seconds of pure latency in 300 all-reduces on "
            "2 ranks?",
            "300 * ring(0, 2, 50e-6, 0)",
            "2(p-1) alpha per all-reduce, p = 2.",
        ),
        Question(
            "A2.1",
            "Bytes ZeRO-3 sends per step relative to DDP (communication_bytes)?",
            "memory.communication_bytes('zero3', 1e9) / memory.communication_bytes('ddp', 1e9)",
            "parameters all-gathered in forward and backward plus a gradient reduce-scatter: 3 "
            "psi vs 2 psi.",
        ),
        Question(
            "A2.2",
            "Memory per GPU of ZeRO-3 relative to ZeRO-2, 1B parameters on 8 GPUs?",
            "model_states('zero3', 1e9, 8).total / model_states('zero2', 1e9, 8).total",
            "ZeRO-3 also shards the 2psi fp16 weights.",
        ),
        Question(
            "A3.1",
            "A 350M model, 10 GB of activations, 8 GPUs of 80 GB: first stage that fits?",
            "first_fitting_stage(350e6, 8, 10 * GB)",
            "it fits: data parallelism, no model parallelism.",
            choices=STAGE_CHOICES,
        ),
        Question(
            "A3.2",
            "A 70B model, 20 GB of activations, 8 GPUs of 80 GB: first stage that fits?",
            "first_fitting_stage(70e9, 8, 20 * GB)",
            "16 x 70e9 / 8 = 140 GB per GPU even fully sharded: split the model.",
            choices=STAGE_CHOICES,
        ),
        Question(
            "A4.1",
            "ResNet-50 fp32 gradients (AMP keeps them fp32) in 25 MB buckets on 4 NVLink "
            "GPUs: number of buckets?",
            f"math.ceil({_RESNET}[0] * 4 / 25e6)",
            "gradient bytes / bucket bytes, rounded up.",
        ),
        Question(
            "A4.2",
            "Share of a 4 KB all-reduce's time that is latency on 4 PCIe GPUs?",
            "ring(0, 4, LINKS['PCIe'].alpha, 0) / ring(4096, 4, LINKS['PCIe'].alpha, "
            "LINKS['PCIe'].beta)",
            "small messages are latency-bound: fuse them.",
        ),
        # ---- core knowledge -------------------------------------------------------------
        Question(
            "K1.1",
            "Per-GPU batch 16, 8 GPUs, 4 accumulation steps: effective batch?",
            "effective_batch(16, 8, 4)",
            "16 x 8 x 4.",
        ),
        Question(
            "K1.2",
            "To keep effective batch 512 on 4 GPUs at micro-batch 32: accumulation steps?",
            "512 // (32 * 4)",
            "512 / (32 x 4).",
        ),
        Question(
            "K2.1",
            "Which family splits ONE layer's matrix multiply across ranks?",
            "'tensor'",
            "Megatron tensor parallelism shards weight matrices by rows/columns.",
            choices=("tensor", "pipeline", "zero"),
        ),
        Question(
            "K2.2",
            "ZeRO-3 model states per GPU for 1B params on 16 GPUs, in GB?",
            "model_states('zero3', 1e9, 16).total / GB",
            "16 psi / N: every state sharded.",
        ),
        Question(
            "K3.1",
            "One GPT-2 1.3B layer, sequence 2048, micro-batch 1, no recompute: GB of activations?",
            "act(2048, 1, 2048, 16) / GB",
            "Korthikanti: s b h (34 + 5 a s / h) bytes.",
        ),
        Question(
            "K3.2",
            "Same layer with full activation recompute: GB?",
            "act(2048, 1, 2048, 16, recompute='full') / GB",
            "only the layer input, 2 s b h, is kept.",
        ),
        Question(
            "K4.1",
            "Bytes of model state per parameter: mixed-precision Adam over fp32 Adam (ratio)?",
            "model_states('ddp', 1, 1, MIXED_ADAM).total / model_states('ddp', 1, 1, "
            "FP32_ADAM).total",
            "16 vs 16: AMP saves activation memory and time, not model-state memory.",
        ),
        Question(
            "K4.2",
            "Activation bytes in 16-bit relative to 32-bit for the same tensors?",
            "2 / 4",
            "half the bytes per element.",
        ),
        Question(
            "K5.1",
            "Base lr 0.1 at batch 256; new batch 8192: linearly scaled lr?",
            "scaled_lr(0.1, 256, 8192)",
            "k = 32 times the batch, 32 times the lr.",
        ),
        Question(
            "K5.2",
            "With 5 warm-up steps to lr 0.4, the lr at step 0 (lr_at)?",
            "lr_at(0, 0.4, 5)",
            "linear warm-up from lr/warmup_steps.",
        ),
        Question(
            "K6.1",
            "Bytes one rank sends in a ring all-reduce of 100 MB on 8 ranks?",
            "2 * (8 - 1) / 8 * 100 * MB",
            "2(p-1)/p x D.",
        ),
        Question(
            "K6.2",
            "Message size (bytes) where alpha and the bandwidth term are equal on PCIe, p=4?",
            "LINKS['PCIe'].alpha * 4 / LINKS['PCIe'].beta",
            "2(p-1) alpha = 2(p-1)/p D beta  =>  D = p alpha / beta.",
        ),
        Question(
            "K7.1",
            "Decoding takes 2 ms per image per worker; 4000 images/s needed: workers?",
            "workers_needed(4000, 2e-3)",
            "4000 x 0.002 = 8 workers' worth of work.",
        ),
        Question(
            "K7.2",
            "Pinned memory matters for which copy?",
            "'host-to-device'",
            "page-locked host buffers let the copy run asynchronously (CUDA).",
            choices=("host-to-device", "all-reduce", "checkpoint save"),
        ),
        Question(
            "K8.1",
            "A layer does 2e12 FLOPs in 20 ms on a 312 TFLOP/s GPU: FLOP efficiency?",
            "flop_efficiency(2e12, 20e-3, 312e12)",
            "achieved FLOP/s over peak.",
        ),
        Question(
            "K8.2",
            "128 images per step at 0.25 s per step: samples per second?",
            "samples_per_second(128, 0.25)",
            "global batch / step time.",
        ),
        Question(
            "K9.1",
            "Strong scaling: 1 GPU 8 s, 4 GPUs 2.5 s per epoch: efficiency?",
            "strong_efficiency(8, 2.5, 4)",
            "t1 / (p tp).",
        ),
        Question(
            "K9.2",
            "Weak scaling: 1 GPU 0.10 s per step, 4 GPUs 0.12 s per step: efficiency?",
            "weak_efficiency(0.10, 0.12)",
            "t1 / tp at the same per-GPU batch.",
        ),
        Question(
            "K10.1",
            "Is a float32 sum split over 2 ranks bitwise equal to the same sum over 4? "
            "(sum_order_changes_bits)",
            "'no' if sum_order_changes_bits() else 'yes'",
            "float addition is not associative; the world size changes the order.",
            choices=("yes", "no"),
        ),
        Question(
            "K10.2",
            "Which needs deterministic algorithms to be bitwise reproducible on CUDA?",
            "'atomic-add kernels'",
            "scatter-add/index_add backward use atomics whose order varies (CUDA).",
            choices=("atomic-add kernels", "a seeded CPU matmul", "integer addition"),
        ),
        Question(
            "K11.1",
            "Save time 60 s, job MTBF 8 h: Young/Daly interval in minutes?",
            "young_daly_interval(60, 8 * 3600) / 60",
            "sqrt(2 C M).",
        ),
        Question(
            "K11.2",
            "At that interval: fraction of time lost (checkpoint_overhead)?",
            "checkpoint_overhead(young_daly_interval(60, 8 * 3600), 60, 8 * 3600)",
            "C/tau + tau/(2M); at the optimum both terms are equal.",
        ),
        Question(
            "K12.1",
            "8 GPUs at 4000 samples/s: GPU-hours per million samples?",
            "gpu_hours_per_million(4000, 8)",
            "8 x 1e6 / 4000 / 3600.",
        ),
        Question(
            "K12.2",
            "At $2 per GPU-hour: dollars per million samples?",
            "cost_per_million(4000, 8, 2.0)",
            "GPU-hours x price.",
        ),
        # ---- pitfalls -------------------------------------------------------------------
        Question(
            "P1.1",
            "Utilisation 95%, 9e12 FLOPs per step, step 1 s, peak 312 TFLOP/s: FLOP efficiency?",
            "flop_efficiency(9e12, 1.0, 312e12)",
            "busy is not efficient: small kernels, memory stalls.",
        ),
        Question(
            "P1.2",
            "Which number does nvidia-smi's utilisation report?",
            "'time a kernel runs'",
            "the fraction of time any kernel is active (NCCL's all-reduces included), not how"
            " much of the SMs or FLOPs it uses: a communication-bound job reads near 100%.",
            choices=("time a kernel runs", "FLOP efficiency", "memory bandwidth"),
        ),
        Question(
            "P2.1",
            "lr 0.1 at batch 256 scaled to batch 65536 by the linear rule: lr?",
            "scaled_lr(0.1, 256, 65536)",
            "an lr of 25.6 diverges without LARS/LAMB and long warm-up.",
        ),
        Question(
            "P2.2",
            "Warm-up of 5 epochs at 1000 steps/epoch: lr at step 999 as a fraction of the target?",
            "lr_at(999, 1.0, 5000)",
            "(step + 1) / warmup_steps.",
        ),
        Question(
            "P3.1",
            "A 1.3B model on 8 GPUs of 80 GB with 10 GB activations: first stage that fits?",
            "first_fitting_stage(1.3e9, 8, 10 * GB)",
            "data parallelism fits: no TP/PP needed.",
            choices=STAGE_CHOICES,
        ),
        Question(
            "P3.2",
            "A 7B model on 8 x 80 GB with 20 GB activations: first stage that fits?",
            "first_fitting_stage(7e9, 8, 20 * GB)",
            "ZeRO shards enough: still no TP/PP.",
            choices=STAGE_CHOICES,
        ),
    ]
}


def questions_for(topic: str) -> list[Question]:
    return [q for q in QUESTIONS.values() if q.topic == topic]
