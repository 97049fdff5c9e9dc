"""Parse ``topics.md``: each ``- **ID Title.** text`` bullet under a ``## Section`` is a topic."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TOPICS_PATH", "Topic", "load_topics", "topic_ids"]

TOPICS_PATH = Path(__file__).resolve().parent / "topics.md"
_ITEM = re.compile(r"^- \*\*(?P<id>[SAKP]\d+)\b\s*(?P<title>[^*]*)\*\*\s*(?P<text>.*)$")


@dataclass(frozen=True)
class Topic:
    id: str  # "S2", "K6" ...
    section: str  # "Scenarios", "Answer strategies", "Core knowledge", "Pitfalls"
    title: str  # may be empty (core-knowledge items have none)
    text: str


def load_topics(path: str | Path = TOPICS_PATH) -> list[Topic]:
    """Every id'd bullet of the file, in file order; duplicate ids are an error."""
    section = ""
    topics: list[Topic] = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
            continue
        m = _ITEM.match(line.strip())
        if m:
            topics.append(
                Topic(m["id"], section, m["title"].strip().rstrip("."), m["text"].strip())
            )
    ids = [t.id for t in topics]
    dups = sorted({i for i in ids if ids.count(i) > 1})
    if dups:
        raise ValueError(f"{path}: duplicate topic ids {dups}")
    return topics


def topic_ids(path: str | Path = TOPICS_PATH) -> list[str]:
    return [t.id for t in load_topics(path)]
