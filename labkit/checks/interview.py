"""The check behind the interview questions (notebook 13, exercise 13): right within tolerance,
or wrong with the reasoning and the labkit expression that computes the answer."""

from __future__ import annotations

import math
from typing import Any

from labkit.checks.core import CheckFailed, passed
from labkit.interview.quiz import QUESTIONS, Question, expected

__all__ = ["ask", "check", "is_right", "quiz"]


def _question(qid: str) -> Question:
    if qid not in QUESTIONS:
        raise ValueError(f"no question {qid!r}; known: {', '.join(QUESTIONS)}")
    return QUESTIONS[qid]


def ask(qid: str) -> str:
    """The question's text (and its choices), printed and returned."""
    q = _question(qid)
    text = f"{qid}: {q.prompt}" + (f"  Choose one of {list(q.choices)}." if q.choices else "")
    print(text)
    return text


def is_right(qid: str, answer: Any) -> bool:
    q = _question(qid)
    want = expected(q)
    if q.choices is not None:
        return str(answer).strip().lower() == str(want).lower()
    try:
        got = float(answer)
    except (TypeError, ValueError):
        return False
    return math.isclose(got, float(want), rel_tol=q.rel_tol, abs_tol=1e-12)


def check(qid: str, answer: Any) -> None:
    """PASSED, or CheckFailed naming the expected value, the reasoning and labkit's expression."""
    q = _question(qid)
    if q.choices is not None and str(answer).strip().lower() not in [c.lower() for c in q.choices]:
        raise CheckFailed(f"{qid}: {answer!r} is not one of the choices {list(q.choices)}")
    want = expected(q)
    if not is_right(qid, answer):
        shown = f"{want:.4g}" if isinstance(want, float) else repr(want)
        tol = "" if q.choices else f" (within {q.rel_tol:.0%})"
        raise CheckFailed(
            f"{qid}: expected {shown}{tol}, got {answer!r}. Why: {q.why} "
            f"labkit computes it as: {q.solution}"
        )
    passed(f"{qid}: {answer!r}. {q.why}")


def quiz(topic: str) -> list[str]:
    """Print every question of a topic id (``"S2"``); answer each with ``check(qid, answer)``."""
    from labkit.interview.quiz import questions_for

    qs = questions_for(topic)
    if not qs:
        raise ValueError(f"no questions for topic {topic!r}")
    return [ask(q.qid) for q in qs]
