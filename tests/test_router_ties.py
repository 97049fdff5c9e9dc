"""The router's choice in 16 bits and on ties (issue 34, defect 9).

Routing chooses on float32 probabilities (rounding them to bfloat16 first tied experts that
differ) and breaks ties by the lower expert index, explicitly, so CPU and CUDA agree
(``torch.topk`` promises no order among equal values). The reference is a plain Python sort
by (-probability, index); the old choice (bfloat16 probabilities, ``topk``) is the negative
control, rejected by the same comparison.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from labkit.experts.router import route, top_k_lowest_index


def _reference(probs: torch.Tensor, k: int) -> list[list[int]]:
    """The k largest of each row, ties to the lower index, by a Python sort."""
    return [sorted(range(len(row)), key=lambda e: (-row[e], e))[:k] for row in probs.tolist()]


def _old_choice(logits: torch.Tensor, k: int) -> torch.Tensor:
    """What router.py did before: fp32 softmax rounded back to the logits' dtype, then topk."""
    probs = F.softmax(logits.float(), dim=-1).to(logits.dtype)
    return probs.topk(k, dim=-1).indices


def test_bfloat16_logits_pick_the_leading_expert() -> None:
    logits = torch.zeros(1, 8, dtype=torch.bfloat16)
    logits[0, 5] = 2**-8  # expert 5 leads; its bfloat16 probability ties with the others
    assert route(logits, 1).experts.tolist() == [[5]]
    assert route(logits, 2).experts.tolist() == [[5, 0]]  # then the lowest index of the tie
    assert _old_choice(logits, 1).tolist() != [[5]]  # negative control: rounding first loses it


def test_ties_go_to_the_lower_index_as_documented() -> None:
    equal = torch.zeros(3, 8)
    assert route(equal, 2).experts.tolist() == [[0, 1]] * 3
    assert route(equal.bfloat16(), 3).experts.tolist() == [[0, 1, 2]] * 3
    # many ties of every kind: logits drawn from 3 values, 400 tokens, k = 1..4
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 3, (400, 8), generator=g).float() * 0.5
    for k in (1, 2, 3, 4):
        routing = route(logits, k)
        want = _reference(F.softmax(logits, dim=-1), k)
        assert routing.experts.tolist() == want, k
        assert top_k_lowest_index(F.softmax(logits, dim=-1), k).tolist() == want
    # negative control: bfloat16 logits with small leads, chosen the old way, miss the reference
    small = (torch.randn(400, 8, generator=g) * 2**-7).bfloat16()
    want = _reference(F.softmax(small.float(), dim=-1), 2)
    assert route(small, 2).experts.tolist() == want
    assert _old_choice(small, 2).tolist() != want


def test_gates_come_from_the_float32_probabilities() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 8, generator=g).bfloat16()
    routing = route(logits, 2, normalize=True)
    probs = F.softmax(logits.float(), dim=-1)
    chosen = probs.gather(1, routing.experts)
    want = (chosen / chosen.sum(-1, keepdim=True)).bfloat16()
    assert torch.equal(routing.gates, want)
    assert routing.gates.dtype == torch.bfloat16 and routing.probs.dtype == torch.bfloat16
