"""Checked questions for every interview topic id: 2-4 each, answers computed by labkit code.

The bank is data, ``questions.json`` beside this module; this file loads and draws it.

Each question's ``prompt`` is a template over ``params`` (name -> the values it may take).
An attempt draws one value per name from ``random.Random(f"{seed}:{qid}")``, so the same seed
draws the same numbers again and another seed draws others: an answer copied from someone
else's notebook is graded against *their* draw, not yours. The ``solution`` is a Python
expression over labkit's functions (:func:`namespace`) and the drawn names; its value IS the
expected answer, so a question never disagrees with the code it rehearses.

A wrong answer is met with a ``hint`` (which quantity to re-check) and ``look`` (where),
never with the expected value; ``mistakes`` are common wrong expressions, each with its own
hint, recognised when the learner's answer equals their value; for an ``ordered`` ladder of
choices, a wrong rung is told whether it is below or above the one that fits first. ``why`` is
shown once the
answer is right. Numeric answers pass within ``rel_tol`` (0: exact, for counts); choice
answers must be one of ``choices``. A conceptual question (choices, not a ladder) offers at
least four, and its hint points at the reasoning without naming or paraphrasing the answer.
Every scenario also asks what to ask first, what the choice trades and what to fall back on:
``kind`` is ``"clarify"``, ``"tradeoff"`` or ``"fallback"`` for those (``""`` otherwise);
``tests/test_quiz_rules.py`` holds the bank to these rules.
"""

from __future__ import annotations

import functools
import json
import random
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "BANK_PATH",
    "KINDS",
    "Drawn",
    "Question",
    "QUESTIONS",
    "load_questions",
    "namespace",
    "new_seed",
    "questions_for",
]

BANK_PATH = Path(__file__).resolve().parent / "questions.json"
DEFAULT_REL_TOL = 0.02
KINDS = ("", "clarify", "tradeoff", "fallback")


@dataclass(frozen=True)
class Question:
    qid: str  # "<topic>.<n>", e.g. "S2.1"
    prompt: str  # a str.format template over the names in ``params``
    solution: str  # an expression in namespace() and the drawn names; its value is the answer
    hint: str  # which quantity to re-check, shown on a wrong answer
    look: str  # where to look: a notebook section, a labkit function
    why: str  # the reasoning, shown once the answer is right
    params: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    choices: tuple[str, ...] | None = None
    rel_tol: float = DEFAULT_REL_TOL
    mistakes: tuple[tuple[str, str], ...] = ()  # (wrong expression, its hint)
    ordered: bool = False  # the choices are a ladder (DDP, ZeRO-1, ...): the first that fits
    kind: str = ""  # "clarify", "tradeoff" or "fallback" (a scenario's interview moves), or ""

    @property
    def topic(self) -> str:
        return self.qid.split(".")[0]

    def draw(self, seed: int) -> Drawn:
        """This question's parameters for attempt ``seed`` (the same seed, the same draw)."""
        rng = random.Random(f"{seed}:{self.qid}")
        return Drawn(self, seed, {k: rng.choice(vs) for k, vs in self.params.items()})


@dataclass(frozen=True)
class Drawn:
    """One attempt at a question: the drawn values read as attributes (``q.gpus``)."""

    question: Question
    seed: int
    values: dict[str, Any]

    def __getattr__(self, name: str) -> Any:
        values = self.__dict__.get("values", {})
        if name in values:
            return values[name]
        raise AttributeError(f"{name!r}: this question draws {sorted(values) or 'nothing'}")

    @property
    def qid(self) -> str:
        return self.question.qid

    @property
    def text(self) -> str:
        q = self.question
        body = q.prompt.format(**self.values)
        if q.choices:
            body += (
                "  Choose one of "
                + ", ".join(f"({chr(97 + i)}) {c}" for i, c in enumerate(q.choices))
                + "."
            )
        return body

    def evaluate(self, expression: str) -> Any:
        return _evaluate(expression, tuple(sorted(self.values.items())))

    @property
    def expected(self) -> Any:
        return self.evaluate(self.question.solution)

    def __repr__(self) -> str:
        return f"<{self.qid}, seed {self.seed}: {self.text}>"


@functools.cache
def namespace() -> dict[str, Any]:
    """The names a ``solution`` may use: labkit's estimates, memory and cost models."""
    import math

    from labkit.collectives import cost_model
    from labkit.interview import beyond, estimates
    from labkit.labs.mnist import effective_batch, lr_at, scaled_lr
    from labkit.measure.h2d import percentile
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
    ns.update(busbw_factor=cost_model.busbw_factor, percentile=percentile)
    ns.update({k: getattr(beyond, k) for k in beyond.__all__})
    return ns


@functools.cache
def _evaluate(expression: str, values: tuple[tuple[str, Any], ...]) -> Any:
    # one globals dict: lambdas inside an expression see the drawn names too
    scope = {**namespace(), **dict(values)}
    return eval(expression, scope)  # noqa: S307 - the bank's own expressions, not user input


def new_seed() -> int:
    """A fresh attempt: a seed nobody else is likely to hold."""
    return secrets.randbelow(1_000_000)


def load_questions(path: str | Path = BANK_PATH) -> dict[str, Question]:
    """The bank, keyed by qid, with a clear error naming any question that lacks a field."""
    raw = json.loads(Path(path).read_text(encoding="utf-8"))
    out: dict[str, Question] = {}
    for item in raw["questions"]:
        missing = [k for k in ("id", "prompt", "solution", "hint", "look", "why") if k not in item]
        if missing:
            raise ValueError(f"{path}: question {item.get('id', '?')!r} lacks {missing}")
        if item["id"] in out:
            raise ValueError(f"{path}: duplicate question id {item['id']!r}")
        if item.get("kind", "") not in KINDS:
            raise ValueError(f"{path}: question {item['id']!r} has kind {item['kind']!r}, "
                             f"not one of {KINDS}")  # fmt: skip
        choices = item.get("choices")
        out[item["id"]] = Question(
            item["id"],
            item["prompt"],
            item["solution"],
            item["hint"],
            item["look"],
            item["why"],
            # a drawn value may be a list (a sample of numbers): a tuple, so draws can be cached
            {
                k: tuple(tuple(x) if isinstance(x, list) else x for x in v)
                for k, v in item.get("params", {}).items()
            },  # fmt: skip
            tuple(choices) if choices else None,
            float(item.get("rel_tol", DEFAULT_REL_TOL)),
            tuple((m["solution"], m["hint"]) for m in item.get("mistakes", ())),
            bool(item.get("ordered", False)),
            item.get("kind", ""),
        )
    return out


QUESTIONS: dict[str, Question] = load_questions()


def questions_for(topic: str) -> list[Question]:
    return [q for q in QUESTIONS.values() if q.topic == topic]
