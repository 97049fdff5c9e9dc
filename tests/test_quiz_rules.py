"""The quiz tests what an interview grades (issue 35): a conceptual question offers at least
four options and its hint points at the reasoning, never naming or paraphrasing the answer
(P1.2's hint said "whether a kernel is running" for the answer "time a kernel runs"); a ladder's
hint names no rung, so it gives nothing away at either end; every scenario asks what to ask
first, what the choice trades and what to fall back on. Each rule has a negative control: a
bank that breaks it is reported, naming the question."""

from __future__ import annotations

import dataclasses
import re

from labkit.interview.quiz import QUESTIONS, Question
from labkit.interview.topics import load_topics

MOVES = ("clarify", "tradeoff", "fallback")
_STOP = {"the", "and", "for", "with", "its", "not", "all", "any", "one", "are", "per",
         "but", "from", "that", "this", "what", "which", "each", "only", "than", "into",
         "how"}  # fmt: skip


def _norm(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower())


def _stems(text: str) -> set[str]:
    """Three-letter stems of the words that carry meaning: "running" and "runs" meet."""
    return {w[:3] for w in re.findall(r"[a-z0-9]+", text.lower()) if len(w) >= 3 and w not in _STOP}


def _answers(q: Question) -> set[str]:
    return {q.draw(seed).expected for seed in range(40)}


def bank_problems(questions: dict[str, Question], scenarios: list[str]) -> list[str]:
    out = []
    for q in questions.values():
        if q.choices is None:
            continue
        hint = _norm(q.hint)
        if q.ordered:
            out += [f"{q.qid}: the ladder's hint names the rung {c!r}" for c in q.choices
                    if _norm(c) in hint]  # fmt: skip
            continue
        if len(q.choices) < 4:
            out.append(f"{q.qid}: a conceptual question with {len(q.choices)} options (< 4)")
        for answer in _answers(q):
            if _norm(answer) in hint:
                out.append(f"{q.qid}: the hint names the answer {answer!r}")
                continue
            # words only the answer has (words several options share point at none of them)
            others = set().union(*(_stems(c) for c in q.choices if c != answer))
            own = _stems(answer) - others
            shared = own & _stems(q.hint)
            if own and 2 * len(shared) > len(own):
                out.append(
                    f"{q.qid}: the hint paraphrases the answer {answer!r} ({sorted(shared)})"
                )
    for tid in scenarios:
        kinds = {q.kind for q in questions.values() if q.topic == tid}
        missing = [k for k in MOVES if k not in kinds]
        if missing:
            out.append(f"{tid}: no {'/'.join(missing)} question")
    return out


SCENARIOS = [t.id for t in load_topics() if t.section == "Scenarios"]


def test_the_bank_follows_the_rules():
    assert SCENARIOS == [f"S{i}" for i in range(1, 9)]
    assert bank_problems(QUESTIONS, SCENARIOS) == []
    moves = [q for q in QUESTIONS.values() if q.kind]
    assert len(moves) == 3 * len(SCENARIOS) and all(len(q.choices or ()) >= 4 for q in moves)


def test_a_bank_that_breaks_each_rule_is_caught():
    bank = dict(QUESTIONS)
    # the old P1.2: three options, and a hint that paraphrases the answer
    bank["P1.2"] = dataclasses.replace(
        QUESTIONS["P1.2"], choices=("time a kernel runs", "FLOP efficiency", "memory bandwidth"),
        solution="'time a kernel runs'",
        hint="what nvidia-smi samples: whether a kernel is running, or how much of the chip it "
        "uses",
    )  # fmt: skip
    # the old A3.2: a ladder hint that names the rung it expects
    bank["A3.2"] = dataclasses.replace(
        QUESTIONS["A3.2"], hint="walk the ladder to ZeRO-3 (16 psi / N) before splitting the model"
    )
    # a hint that states the answer outright
    k72 = QUESTIONS["K7.2"]
    bank["K7.2"] = dataclasses.replace(k72, hint=f"it is {k72.draw(0).expected}")
    # a scenario without its fallback question
    for q in QUESTIONS.values():
        if q.topic == "S6" and q.kind == "fallback":
            del bank[q.qid]
    problems = "\n".join(bank_problems(bank, SCENARIOS))
    assert "P1.2: a conceptual question with 3 options" in problems
    assert "P1.2: the hint paraphrases the answer 'time a kernel runs'" in problems
    assert "A3.2: the ladder's hint names the rung 'zero3'" in problems
    assert "K7.2: the hint names the answer" in problems
    assert "S6: no fallback question" in problems
    assert len(problems.splitlines()) == 5, problems
