"""Shared test fixtures. Multi-process tests call labkit.launch with a short ``timeout``."""

from __future__ import annotations

import os
import sys
import uuid

import psutil
import pytest


def processes_tagged(tag: str) -> list[psutil.Process]:
    """Every live process whose environment carries LABKIT_TEST_TAG=tag (ours, never others')."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and p.environ().get("LABKIT_TEST_TAG") == tag:
                found.append(p)
        except (psutil.Error, OSError):
            continue
    return found


@pytest.fixture(scope="session", autouse=True)
def _shared_worlds():
    """run_ranks' warm worlds live for the session and end with it."""
    yield
    ranks = sys.modules.get("tests.ranks")  # imported only by tests that run ranks
    if ranks is not None:
        ranks.close_worlds()


def kill_survivors(tag: str, what: str = "their job") -> None:
    """Kill any process still tagged ``tag``, then fail naming them."""
    survivors = processes_tagged(tag)
    for p in survivors:
        p.kill()
    assert not survivors, f"processes outlived {what}: {[(p.pid, p.name()) for p in survivors]}"


@pytest.fixture
def job_tag():
    """A tag to pass as ``env={"LABKIT_TEST_TAG": tag}``.

    The test fails if any tagged process survives."""
    tag = uuid.uuid4().hex
    yield tag
    kill_survivors(tag)


@pytest.fixture
def checks_on_warm_ranks(monkeypatch):
    """Run exercise checks (``labkit.checks``) on run_ranks' warm worlds instead of a fresh
    launch each. The check's own code, its ranks' work and its verdicts are unchanged: only the
    processes are shared (the exercise notebooks, tests/test_exercises.py, keep fresh launches).
    """
    from labkit.checks import core
    from tests.ranks import run_ranks

    def warm_launch(fn, *args, world_size, timeout, **options):
        return run_ranks(fn, *args, world_size=world_size, timeout=timeout, **options)

    monkeypatch.setattr(core, "launch", warm_launch)
