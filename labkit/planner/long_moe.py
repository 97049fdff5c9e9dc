"""Two demonstrations of context and expert parallelism in the planner (printed, not asserted).

* Mixtral 8x7B's shapes (:data:`labkit.models.moe.PUBLISHED_MOES`; attention priced as MHA) on
  64 DGX H100 GPUs at sequence 4096 and 32k: the fastest layouts that fit, ``ep`` searched.
* A 128k-context dense model (a 7B-class GPT: 32 layers, d 4096, 32 heads) on 64 DGX H100
  GPUs: without cp nothing fits or the best layout is slower; with cp searched the planner
  picks cp > 1.

``python -m labkit.planner.long_moe`` prints both. Nothing here is compared with a published
throughput: no cited source gives one for these exact settings.
"""

from __future__ import annotations

from dataclasses import replace

from labkit.memory.moe_cp import MoESpec
from labkit.models.gpt import GPTConfig
from labkit.models.moe import PUBLISHED_MOES
from labkit.planner.cluster import CLUSTERS
from labkit.planner.plan import plan
from labkit.planner.space import Prediction

__all__ = ["dense_long_context", "main", "mixtral"]

H100_64 = replace(CLUSTERS["dgx-h100-80gb"], nodes=8)
SEARCH = dict(micro_batches=(1, 2), zero_stages=(1,), recompute=("selective", "full"),
              sp=(False, True), dp_overlap=True)  # fmt: skip


def mixtral(seq: int, global_batch: int = 256) -> list[Prediction]:
    """Mixtral 8x7B on 64 H100s at ``seq``, ep in {1, 2, 4, 8} and cp in {1, 2, 4}."""
    cfg, spec = MoESpec.from_published(PUBLISHED_MOES["mixtral-8x7b"], seq=seq)
    return plan(cfg, H100_64, global_batch, moe=spec, ep=(1, 2, 4, 8), cp=(1, 2, 4),
                **SEARCH)  # type: ignore[arg-type]  # fmt: skip


def dense_long_context(cp: tuple[int, ...], seq: int = 131072) -> list[Prediction]:
    """A 7B-class dense GPT at ``seq`` tokens on 64 H100s, cp searched over ``cp``."""
    cfg = GPTConfig(vocab_size=32000, block_size=seq, n_layer=32, n_head=32, n_embd=4096,
                    tie_weights=False)  # fmt: skip
    return plan(cfg, H100_64, 16, cp=cp, **SEARCH)  # type: ignore[arg-type]


def _line(r: Prediction) -> str:
    c = r.candidate
    named = {k: v for k, v in r.time.items() if v > 0}
    terms = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in named.items())
    return (f"  dp={c.dp} tp={c.tp} pp={c.pp} cp={c.cp} ep={c.ep} b={c.micro_batch} "
            f"sp={c.sp} {c.recompute}: {r.memory_total / 1e9:.1f} GB"
            f"{' (risky)' if r.risky else ''}, step {r.step_seconds:.2f} s, MFU {r.mfu:.1%}"
            f"\n    terms (ms): {terms}")  # fmt: skip


def main() -> None:
    for seq in (4096, 32768):
        rows = [r for r in mixtral(seq) if r.fits]
        print(f"Mixtral 8x7B shapes, 64 x H100, seq {seq}, global batch 256: "
              f"{len(rows)} layouts fit; the fastest three")
        for r in rows[:3]:
            print(_line(r))
    for cps in ((1,), (1, 2, 4, 8, 16)):
        rows = [r for r in dense_long_context(cps) if r.fits]
        print(f"7B dense GPT, seq 131072, 64 x H100, batch 16, cp searched over {cps}: "
              f"{len(rows)} layouts fit" + ("; the fastest" if rows else ""))
        if rows:
            print(_line(rows[0]))


if __name__ == "__main__":
    main()
