"""The composition matrix: the dimensions a user combines, what labkit refuses, and a pairwise
covering array over them (pure: no processes, no torch).

Each technique is proven alone elsewhere; the seams between them are proven here. Testing every
combination would be 8 x 2 x 2 x 3 x 5 x 2 x 2 x 3 x 3 x 2 x 2 x 2 = 138,240 runs; testing
every *pair* of values is enough to catch a defect that needs two techniques to show (the usual
kind: "tp with labkit's ring under overlapped DDP", "ZB-H1 under fp16"), and takes tens.

:func:`covering_array` is the greedy AETG construction (Cohen et al. 1997), deterministic:
while some valid pair is uncovered, start a configuration from the first uncovered pair, then
fill every other dimension with the value that covers the most still-uncovered pairs with the
values already chosen (ties: the first, i.e. cheapest, value), never a value refused next to
one already chosen. Every refusal is a rule about a *pair*, so a configuration whose pairs are
all allowed is allowed, and every valid pair is covered when the loop ends.

A refused combination (:data:`REFUSED`) is one labkit does not support, with the reason;
:func:`check_combo` raises ``ValueError`` naming both parts before any process starts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from itertools import combinations

__all__ = [
    "DIMENSIONS",
    "REFUSED",
    "SUITE",
    "Combo",
    "check_combo",
    "covering_array",
    "matrix_table",
    "refusal",
    "uncovered_pairs",
    "valid_pairs",
]

# Values in order of cost: the first is the cheapest (the greedy fill prefers it on a tie).
DIMENSIONS: dict[str, tuple[object, ...]] = {
    # "overlapped+views": OverlappedDDP(grad_as_bucket_view=True), .grad a view into its bucket
    "dp": ("naive", "flat", "bucketed", "overlapped", "overlapped+views", "zero1", "zero2",
           "zero3", "zero3+prefetch"),  # fmt: skip
    "dp_comm": ("torch", "ring"),  # the collectives of dp: torch's or labkit's ring
    "tp_comm": ("torch", "ring"),  # the collectives of tp (no-op at tp=1)
    # tensor parallel degree; "+sp": sequence parallelism; "+osp": its gathers and scatters
    # decomposed under the GEMMs (TPConfig(overlap=True), labkit/tensor_parallel/overlap.py)
    "tp": ("1", "2", "2+sp", "2+osp"),
    "pp": ("1", "gpipe", "1f1b", "interleaved", "zbh1"),  # pp = 2 unless "1"
    "layers": (4, 5),  # 5: an uneven cut under pp (3 + 2; interleaved 2 + 1 + 1 + 1)
    "checkpoint": (False, True),  # activation checkpointing of every block
    "precision": ("fp32", "bf16", "fp16"),  # bf16 autocast; fp16 autocast + loss scaler
    "accum": (1, 2, 3),  # micro-batches per replica per step
    "tied": (True, False),  # embedding and head share one Parameter
    "frozen": (False, True),  # wpe.weight has requires_grad=False
    "branch": (False, True),  # a module only some micro-batches (so some dp ranks) run
    # context parallel: the 2 data ranks become 1 replica x cp 2 (ring: zigzag; or Ulysses)
    "cp": ("1", "2", "2-ulysses"),
    # "0": dense MLPs; "moe": a MoE GPT, experts whole (ep 1); "2": experts over 2 ranks
    "ep": ("0", "moe", "2"),
}

# The values the suite's covering array spans: every dimension's, but cp's Ulysses, which the
# suite runs in one seed configuration only (tests/test_composition.py) to keep its time: all
# its pairs cost about 3 more configurations and several seconds (docs/composition.md, Cost).
# Overlapped SP likewise runs in one configuration (tests/test_composition.py): it is proven
# against the plain SP layer bit for bit in tests/test_tp_overlap.py.
SUITE = {**DIMENSIONS, "cp": ("1", "2"), "tp": ("1", "2", "2+sp")}
SEQUENCE_PARALLEL = ("2+sp", "2+osp")

ZERO23 = ("zero2", "zero3", "zero3+prefetch")

Pred = Callable[[object], bool]

# (dimension a, values of a, dimension b, values of b, why labkit refuses the pair)
REFUSED: list[tuple[str, Pred, str, Pred, str]] = [
    (
        "dp", lambda v: v in ZERO23, "pp", lambda v: v != "1",
        "ZeRO-2/3 reduce-scatter gradients (and ZeRO-3 re-gathers parameters) inside every "
        "micro-batch's backward, so under a pipeline of m micro-batches they communicate m "
        "times per step; Megatron-LM and DeepSpeed refuse the pair too (DeepSpeed: 'ZeRO-2 "
        "and ZeRO-3 are incompatible with pipeline parallelism'). Use ZeRO-1 or DDP with pp",
    ),
    (
        "dp", lambda v: v in ("zero3", "zero3+prefetch"), "branch", lambda v: v is True,
        "ZeRO-3 all-gathers a module's parameters from the module's own hooks, so every rank "
        "must run the same modules (FSDP's rule, labkit/zero/stage3.py); a branch that only "
        "some data-parallel ranks take mismatches the collectives. Run the module on every "
        "rank (on an empty selection) or keep it out of the sharded units",
    ),
    (
        "pp", lambda v: v == "interleaved", "accum", lambda v: v in (1, 3),
        "interleaved 1F1B needs the micro-batches to be a multiple of the pipeline ranks "
        "(pp=2; Megatron-LM's rule: the schedule runs rounds of p micro-batches)",
    ),
    (
        "cp", lambda v: v != "1", "branch", lambda v: v is True,
        "the branch decides per sequence from its first token, which only the context-parallel "
        "rank holding position 0 sees; the other ranks of the sequence would skip it. A "
        "per-sequence decision must be taken before the sequence is split (and sent along)",
    ),
    (
        "ep", lambda v: v != "0", "tp", lambda v: v in SEQUENCE_PARALLEL,
        "expert parallelism needs the tokens replicated over tp (each tp rank routes the same "
        "tokens and holds an f/tp slice of every local expert, labkit/experts/parallel.py); "
        "sequence parallelism leaves each tp rank T/tp of them",
    ),
    (
        "ep", lambda v: v == "2", "dp", lambda v: str(v).startswith("zero"),
        "labkit's ZeRO shards and reduces one group's parameters; experts at ep > 1 need their "
        "own group (gradients over edp, not dp x cp), i.e. ZeRO over two groups (DeepSpeed-MoE's "
        "expert data parallelism), which labkit does not build. Use a DDP wrapper with ep",
    ),
    (
        "tp", lambda v: v == "2+osp", "precision", lambda v: v != "fp32",
        "overlapped SP computes its decomposed GEMMs in a custom autograd function whose "
        "backward runs outside autocast, in the input's dtype; under bf16/fp16 autocast it "
        "refuses (on every rank) rather than mix dtypes. Use tp=2+sp with mixed precision",
    ),
]  # fmt: skip


@dataclass(frozen=True)
class Combo:
    """One configuration: a value for every dimension of :data:`DIMENSIONS` (dp = 2 always)."""

    dp: str = "naive"
    dp_comm: str = "torch"
    tp_comm: str = "torch"
    tp: str = "1"
    pp: str = "1"
    layers: int = 4
    checkpoint: bool = False
    precision: str = "fp32"
    accum: int = 1
    tied: bool = True
    frozen: bool = False
    branch: bool = False
    cp: str = "1"
    ep: str = "0"

    @property
    def cp_degree(self) -> int:
        return 1 if self.cp == "1" else 2

    @property
    def cp_attention(self) -> str | None:
        return {"1": None, "2": "ring", "2-ulysses": "ulysses"}[self.cp]

    @property
    def ep_degree(self) -> int:
        return 2 if self.ep == "2" else 1

    @property
    def sequence_parallel(self) -> bool:
        return self.tp in SEQUENCE_PARALLEL

    @property
    def tp_degree(self) -> int:
        return 1 if self.tp == "1" else 2

    @property
    def pp_degree(self) -> int:
        return 1 if self.pp == "1" else 2

    @property
    def world_size(self) -> int:
        """dp x cp = 2 always (cp takes the data ranks), times tp and pp."""
        return 2 * self.tp_degree * self.pp_degree

    @property
    def name(self) -> str:
        """Every dimension, short: ``zero1 ring tp2+sp pp=1f1b L5 ckpt bf16 acc3 tied ...``."""
        flags = [n for n in ("tied", "frozen", "branch") if getattr(self, n)]
        return " ".join(
            [self.dp, f"dp:{self.dp_comm}", f"tp{self.tp}:{self.tp_comm}", f"pp={self.pp}"]
            + [f"L{self.layers}"]
            + (["ckpt"] if self.checkpoint else [])
            + [self.precision, f"acc{self.accum}"]
            + (flags or ["plain"])
            + ([f"cp{self.cp}"] if self.cp != "1" else [])
            + ({"0": [], "moe": ["moe"], "2": ["ep2"]}[self.ep])
        )

    def values(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def refusal(a: str, va: object, b: str, vb: object) -> str | None:
    """Why labkit refuses ``a=va`` together with ``b=vb`` (either order), or None."""
    for da, pa, db, pb, why in REFUSED:
        for (x, vx), (y, vy) in (((a, va), (b, vb)), ((b, vb), (a, va))):
            if x == da and y == db and pa(vx) and pb(vy):
                return f"{da}={vx!r} with {db}={vy!r} is not supported: {why}"
    return None


def check_combo(combo: Combo) -> None:
    """Raise ``ValueError`` (naming both parts) for a value outside a dimension or a refused
    pair; call before any process starts."""
    values = combo.values()
    for name, v in values.items():
        if v not in DIMENSIONS[name]:
            raise ValueError(f"{name}={v!r}: expected one of {list(DIMENSIONS[name])}")
    for (a, va), (b, vb) in combinations(values.items(), 2):
        why = refusal(a, va, b, vb)
        if why is not None:
            raise ValueError(why)


Pair = tuple[tuple[str, object], tuple[str, object]]


Dims = dict[str, tuple[object, ...]]


def valid_pairs(dims: Dims | None = None) -> set[Pair]:
    """Every pair of values of two different dimensions that labkit supports (of ``dims``'s
    values; default :data:`DIMENSIONS`)."""
    dims = DIMENSIONS if dims is None else dims
    return {
        ((a, va), (b, vb))
        for a, b in combinations(list(dims), 2)
        for va in dims[a]
        for vb in dims[b]
        if refusal(a, va, b, vb) is None
    }


def _pairs(values: dict[str, object]) -> set[Pair]:
    order = list(DIMENSIONS)
    items = sorted(values.items(), key=lambda kv: order.index(kv[0]))
    return set(combinations(items, 2))


def uncovered_pairs(combos: Iterable[Combo], dims: Dims | None = None) -> set[Pair]:
    """The valid pairs no configuration of ``combos`` contains (empty: a covering array)."""
    left = valid_pairs(dims)
    for c in combos:
        left -= _pairs(c.values())
    return left


def covering_array(seeds: Iterable[Combo] = (), dims: Dims | None = None) -> list[Combo]:
    """``seeds`` (configurations that must run, e.g. a known seam) then greedy configurations
    until every valid pair of ``dims``'s values (default :data:`DIMENSIONS`; each a subset of
    it) is covered. Deterministic: the same list on every call."""
    dims = DIMENSIONS if dims is None else dims
    combos = list(seeds)
    for c in combos:
        check_combo(c)
    left = uncovered_pairs(combos, dims)
    while left:
        (a, va), (b, vb) = min(left, key=_pair_key)
        chosen: dict[str, object] = {a: va, b: vb}
        for name in dims:
            if name in chosen:
                continue
            best, best_gain = None, -1
            for v in dims[name]:
                if any(refusal(name, v, k, kv) for k, kv in chosen.items()):
                    continue
                gain = len(_pairs({**chosen, name: v}) & left)
                if gain > best_gain:
                    best, best_gain = v, gain
            chosen[name] = best  # some value always fits: every rule leaves one (see tests)
        combo = Combo(**chosen)  # type: ignore[arg-type]
        check_combo(combo)
        combos.append(combo)
        left -= _pairs(chosen)
    return combos


def _pair_key(pair: Pair) -> tuple[int, int, int, int]:
    """Deterministic order of pairs: by dimension, then by value index."""
    order = list(DIMENSIONS)
    (a, va), (b, vb) = pair
    return order.index(a), DIMENSIONS[a].index(va), order.index(b), DIMENSIONS[b].index(vb)


def matrix_table(combos: list[Combo]) -> str:
    """The matrix as a markdown table, one row per configuration (docs/composition.md)."""
    names = list(DIMENSIONS)
    lines = ["| # | ranks | " + " | ".join(names) + " |", "|---" * (len(names) + 2) + "|"]
    for i, c in enumerate(combos):
        vals = c.values()
        lines.append(
            f"| {i} | {c.world_size} | " + " | ".join(_cell(vals[n]) for n in names) + " |"
        )
    return "\n".join(lines)


def _cell(v: object) -> str:
    return {True: "yes", False: "no"}.get(v, str(v)) if isinstance(v, bool) else str(v)
