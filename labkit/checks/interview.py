"""The check behind the interview questions (notebook 13, exercise 13).

``q = ask("S2.1")`` draws this attempt's numbers and prints the question; ``check(q, answer)``
grades the answer against labkit's computation on those numbers. Right: the reasoning. Wrong:
which quantity to re-check and where to look, and whether the answer is too high or too low,
never the expected value (a learner who sees it copies it instead of finding the slip).
"""

from __future__ import annotations

import math
from typing import Any

from labkit.checks.core import CheckFailed, passed
from labkit.interview.quiz import QUESTIONS, Drawn, Question, new_seed, questions_for

__all__ = ["ask", "check", "is_right", "quiz", "feedback"]


def _question(qid: str) -> Question:
    if qid not in QUESTIONS:
        raise ValueError(f"no question {qid!r}; known: {', '.join(QUESTIONS)}")
    return QUESTIONS[qid]


def ask(qid: str, seed: int | None = None) -> Drawn:
    """Draw question ``qid`` for attempt ``seed`` (a fresh one when None), print it, return it."""
    d = _question(qid).draw(new_seed() if seed is None else seed)
    print(f"{qid} (attempt seed {d.seed}): {d.text}")
    return d


def _choice(q: Question, answer: Any) -> str | None:
    """The choice ``answer`` names (its text or its letter), or None."""
    assert q.choices is not None
    key = str(answer).strip().lower()
    for i, c in enumerate(q.choices):
        if key in (c.lower(), chr(97 + i)):
            return c
    return None


def _close(got: float, want: float, rel_tol: float) -> bool:
    return math.isclose(got, want, rel_tol=rel_tol, abs_tol=1e-12)


def is_right(d: Drawn, answer: Any) -> bool:
    q, want = d.question, d.expected
    if q.choices is not None:
        return _choice(q, answer) == want
    try:
        got = float(answer)
    except (TypeError, ValueError):
        return False
    return _close(got, float(want), q.rel_tol)


def feedback(d: Drawn, answer: Any) -> str:
    """What a wrong answer is told: the matching mistake's hint, or the question's, the
    direction (too high / too low) and where to look. Never the expected value."""
    q = d.question
    if q.choices is not None:
        side, picked = "", _choice(q, answer)
        if q.ordered and picked is not None:  # a ladder: say which way, not which rung
            at = q.choices.index(picked)
            below = at < q.choices.index(d.expected)
            # a direction with one rung left that way would name it: then only "re-check"
            left = len(q.choices) - 1 - at if below else at
            side = (
                " Re-check each rung in order."
                if left < 2
                else " It does not fit: climb higher."
                if below
                else " It fits, but so does a cheaper one below it: take the first that fits."
            )
        return f"{q.qid}: not {answer!r}.{side} Hint: {q.hint}. Look at {q.look}."
    got, want = float(answer), float(d.expected)
    for expression, hint in q.mistakes:
        wrong = float(d.evaluate(expression))
        if not _close(wrong, want, q.rel_tol) and _close(got, wrong, max(q.rel_tol, 1e-9)):
            return f"{q.qid}: {hint.format(**d.values)}. Look at {q.look}."
    side = "too high" if got > want else "too low"
    tol = "exactly" if q.rel_tol == 0 else f"within {q.rel_tol:.0%}"
    return (
        f"{q.qid}: {answer!r} is {side} (it must match {tol}). Hint: "
        f"{q.hint.format(**d.values)}. Look at {q.look}."
    )


def check(d: Drawn, answer: Any) -> None:
    """PASSED with the reasoning, or CheckFailed with a hint (see :func:`feedback`)."""
    if not isinstance(d, Drawn):
        raise TypeError(
            f"check takes the question ask() returned, not {d!r}: "
            f"q = ask('S1.1'); ...; check(q, answer)"
        )
    q = d.question
    if q.choices is not None and _choice(q, answer) is None:
        raise CheckFailed(f"{q.qid}: {answer!r} is not one of the choices {list(q.choices)}")
    if q.choices is None:
        try:
            float(answer)
        except (TypeError, ValueError):
            raise CheckFailed(f"{q.qid}: the answer must be a number, got {answer!r}") from None
    if not is_right(d, answer):
        raise CheckFailed(feedback(d, answer))
    passed(f"{q.qid}: {answer!r}. Why: {q.why}")


def quiz(topic: str, seed: int | None = None) -> None:
    """Print every question of a topic id (``"S2"``), drawn for one attempt. Returns nothing,
    so a cell shows the questions once; answer one with ``q = ask(qid, seed)``, ``check(q, x)``."""
    qs = questions_for(topic)
    if not qs:
        raise ValueError(f"no questions for topic {topic!r}")
    seed = new_seed() if seed is None else seed
    for q in qs:
        print(f"{q.qid}: {q.draw(seed).text}")
    print(f"(attempt seed {seed}: q = ask('{qs[0].qid}', seed={seed}); check(q, your_answer))")
