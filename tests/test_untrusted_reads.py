"""One way to read untrusted bytes: unpickling runs whatever code the bytes name, so labkit
unpickles only (a) restricted -- ``torch.load(..., weights_only=True)``, or an ``Unpickler``
subclass whose ``find_class`` allows a fixed list (``checkpoint/dcp.py``) -- or (b) bytes
labkit itself just wrote where no other user can write: a private run folder checked before
the read, or an anonymous socketpair. (b) is an explicit, commented entry of :data:`TRUSTED`.

An AST scan of every module under labkit/ lists each ``pickle``/``cloudpickle``/``dill``
``load``/``loads``/``Unpickler``, ``torch.load``, ``numpy.load(allow_pickle=True)``,
``marshal.load(s)``, ``shelve.open``, a ``multiprocessing.connection`` channel (its
``recv`` unpickles), DCP's ``FileSystemReader.read_metadata`` (a plain
``pickle.load``) and ``Unpickler`` subclass, through any import alias, and fails on one that is
neither restricted nor in :data:`TRUSTED`; a stale entry fails too. Negative controls: planted
unsafe calls in synthetic sources are flagged, their restricted twins are not.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PICKLERS = {"pickle", "_pickle", "cloudpickle", "dill", "joblib"}
PLAIN = {"marshal.load", "marshal.loads", "shelve.open"}
CHANNELS = {f"multiprocessing.connection.{n}" for n in ("Connection", "Listener", "Client")}

# (module, enclosing function, callee) -> why the bytes cannot come from another user
TRUSTED = {
    ("labkit/launch/agent.py", "_agent_main", "cloudpickle.load"):
        "job.pkl in the run folder, check_run_dir (owner, mode, no link) just before the read",
    ("labkit/launch/rank.py", "_worker", "cloudpickle.load"):
        "job.pkl in the run folder, check_run_dir just before the read",
    ("labkit/launch/launcher.py", "_Job.results", "cloudpickle.load"):
        "result.<rank>.pkl, written by this job's ranks into its private (0700) run folder",
    ("labkit/launch/world.py", "World._outcome", "cloudpickle.loads"):
        "a rank's reply over its anonymous socketpair (an inherited fd: no path to open)",
    ("labkit/launch/world_rank.py", "_run_job", "cloudpickle.load"):
        "the caller's job over the rank's anonymous socketpair",
    ("labkit/launch/world_procs.py", "_Ranks._serve", "multiprocessing.connection.Connection"):
        "the caller's end of a socket.socketpair() made for one forked rank (no address)",
    ("labkit/launch/world_rank.py", "rank_main", "multiprocessing.connection.Connection"):
        "the rank's end of that socketpair, an inherited fd (no address to connect to)",
}  # fmt: skip


@dataclass(frozen=True)
class Site:
    path: str
    func: str
    callee: str
    line: int
    restricted: bool


class _Scan(ast.NodeVisitor):
    def __init__(self, path: str) -> None:
        self.path = path
        self.stack: list[str] = []
        self.sites: list[Site] = []
        self.alias: dict[str, str] = {}

    def resolve(self, node: ast.AST) -> str | None:
        """The dotted name an expression refers to through imports (None: not an import)."""
        if isinstance(node, ast.Name):
            return self.alias.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self.resolve(node.value)
            return None if base is None else f"{base}.{node.attr}"
        if isinstance(node, ast.Call):  # FileSystemReader(x).read_metadata()
            return self.resolve(node.func)
        return None

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            top = a.name.split(".")[0]  # import a.b binds a; import a.b as c binds c to a.b
            self.alias[a.asname or top] = a.name if a.asname else top

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        for a in node.names:
            self.alias[a.asname or a.name] = f"{node.module}.{a.name}"

    def _scoped(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> None:
        self.stack.append(node.name)
        self.generic_visit(node)
        self.stack.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = _scoped

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for base in node.bases:
            name = self.resolve(base) or ""
            if name.endswith("Unpickler") and name.split(".")[0] in PICKLERS:
                finds = any(isinstance(f, ast.FunctionDef) and f.name == "find_class"
                            for f in node.body)  # fmt: skip
                self._add(node, f"class {node.name}({name})", finds)
        self._scoped(node)

    def _add(self, node: ast.AST, callee: str, restricted: bool) -> None:
        func = ".".join(self.stack) or "<module>"
        self.sites.append(Site(self.path, func, callee, getattr(node, "lineno", 0), restricted))

    def visit_Call(self, node: ast.Call) -> None:
        name = self.resolve(node.func) or ""
        kw = {k.arg: k.value for k in node.keywords}

        def true(key: str) -> bool:
            v = kw.get(key)
            return isinstance(v, ast.Constant) and v.value is True

        parts = name.split(".")
        if parts[0] in PICKLERS and parts[-1] in ("load", "loads", "Unpickler"):
            self._add(node, name, False)
        elif name in ("torch.load", "torch.serialization.load"):
            self._add(node, name, true("weights_only"))
        elif name == "numpy.load" and "allow_pickle" in kw:
            self._add(node, name, not true("allow_pickle"))
        elif name in PLAIN or name in CHANNELS:  # a channel's recv() unpickles what comes
            self._add(node, name, False)
        elif parts[-1] == "read_metadata" and "FileSystemReader" in name:
            self._add(node, name, False)  # DCP: a plain pickle.load of .metadata
        self.generic_visit(node)


def scan(source: str, path: str = "<string>") -> list[Site]:
    visitor = _Scan(path)
    visitor.visit(ast.parse(source))
    return visitor.sites


def _labkit_sites() -> list[Site]:
    sites = []
    for file in sorted((ROOT / "labkit").rglob("*.py")):
        rel = file.relative_to(ROOT).as_posix()
        sites += scan(file.read_text(), rel)
    return sites


def test_every_unpickle_in_labkit_is_restricted_or_reads_what_labkit_wrote_privately() -> None:
    sites = _labkit_sites()
    unsafe = [s for s in sites if not s.restricted and (s.path, s.func, s.callee) not in TRUSTED]
    assert not unsafe, "unrestricted unpickling of bytes another user could write:\n" + "\n".join(
        f"  {s.path}:{s.line} in {s.func}: {s.callee}" for s in unsafe
    )
    found = {(s.path, s.func, s.callee) for s in sites}
    stale = sorted(set(TRUSTED) - found)
    assert not stale, f"TRUSTED entries that match no call any more (remove them): {stale}"
    restricted = {(s.path, s.callee) for s in sites if s.restricted}
    # the scan sees the restricted readers too (it is not blind to the package)
    assert ("labkit/checkpoint/layout.py", "torch.load") in restricted
    assert any(p == "labkit/checkpoint/dcp.py" and c.startswith("class ") for p, c in restricted)


@pytest.mark.parametrize(
    ("source", "flagged"),
    [("import pickle\ndef f(p):\n    return pickle.loads(open(p, 'rb').read())", True),
     ("import cloudpickle as cp\nwith open('j') as f:\n    cp.load(f)", True),
     ("from pickle import Unpickler as U\nU(open('x', 'rb')).load()", True),
     ("from torch import load as L\nL('x')", True),
     ("import torch\ntorch.load('x', weights_only=False)", True),
     ("import torch\ntorch.load('x')", True),
     ("import torch\ntorch.load('x', weights_only=True)", False),
     ("import numpy as np\nnp.load('x', allow_pickle=True)", True),
     ("import pickle\nclass U(pickle.Unpickler):\n    pass", True),
     ("import pickle\nclass U(pickle.Unpickler):\n    def find_class(self, m, n):\n"
      "        raise pickle.UnpicklingError(m)", False),
     ("import torch.distributed.checkpoint as dcp\ndcp.FileSystemReader('d').read_metadata()",
      True),
     ("from multiprocessing.connection import Listener\nListener(('', 0)).accept().recv()",
      True),
     ("import json\njson.loads('{}')", False)],
)  # fmt: skip
def test_the_scanner_flags_planted_unsafe_reads(source: str, flagged: bool) -> None:
    """Negative controls: each planted unsafe read is flagged, each restricted twin is not."""
    sites = scan(source)
    assert any(not s.restricted for s in sites) is flagged, sites
    assert sites or not flagged
