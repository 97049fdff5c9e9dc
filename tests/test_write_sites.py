"""One way to write files as root: every write site in labkit goes through labkit.safe_files.

labkit runs as root (the netns and Slurm clusters need it), so a file it creates in a folder
someone else controls can be a link to ``/etc/shadow``, or be swapped before it is read. The
scan below reads every module of labkit (the AST, not a grep: comments and strings never
count) and lists each call that creates or writes a file or folder:

* ``open(..., mode)`` and ``<path>.open(mode)`` with a mode that writes (``w``, ``a``, ``x``,
  ``+``, or a mode it cannot read: a variable);
* ``os.open`` with flags that write (``O_WRONLY``, ``O_RDWR``, ``O_CREAT``, ``O_APPEND``,
  ``O_TRUNC``, or flags it cannot read);
* ``write_text``, ``write_bytes``, ``touch``, ``mkdir``, ``os.mkdir``, ``os.makedirs``,
  ``os.symlink``, ``os.mkfifo``, ``savefig``, ``np.save``/``savez``, ``tofile``,
  ``export_chrome_trace``, ``urlretrieve``, ``shutil.copy*``/``copytree``/``move`` (they
  open the destination themselves);
* ``torch.save(obj, f)``, unless ``f`` is a name bound in the same function from
  :func:`labkit.safe_files.open_private` or ``io.BytesIO()`` (memory, not a file).

Each must be in :data:`ALLOWED` with a one-line reason, or the test fails naming it; an entry
that matches no call fails too (the list stays true). ``labkit/safe_files.py`` itself is the
helper and is not scanned. Negative control: a synthetic module with one bypass of each kind
is flagged, and the same module through the helper is not.
"""

from __future__ import annotations

import ast
import os
import stat
import sys
from pathlib import Path

import pytest

import labkit
from labkit.safe_files import (
    UnsafePathError,
    check_folder,
    make_private_dir,
    open_private,
    replace_private,
    write_private,
)

ROOT = Path(labkit.__file__).parent
HELPER = ROOT / "safe_files.py"
_WRITE_FLAGS = {"O_WRONLY", "O_RDWR", "O_CREAT", "O_APPEND", "O_TRUNC"}
_METHODS = {
    "write_text",
    "write_bytes",
    "touch",
    "mkdir",
    "savefig",
    "export_chrome_trace",
    "tofile",
}
_FUNCS = {
    "os.mkdir",
    "os.makedirs",
    "os.symlink",
    "np.save",
    "numpy.save",
    "urllib.request.urlretrieve",
    "shutil.copy",
    "shutil.copyfile",
    "shutil.copy2",
    "shutil.copytree",
    "shutil.move",
    "os.mkfifo",
    "np.savez",
    "numpy.savez",
}
_SAFE_FACTORIES = {"open_private", "BytesIO"}

# fmt: off
# "file:function:kind" -> why this write needs no helper. Keep each reason to one line.
ALLOWED: dict[str, str] = {
    "labkit/profiling/breakdown.py:export_trace:export_chrome_trace":
        "torch writes into a folder made new (0700) by mkdtemp the line above; then os.replace",
}
# fmt: on


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return "?"


def _mode(call: ast.Call, position: int) -> ast.expr | None:
    for kw in call.keywords:
        if kw.arg == "mode":
            return kw.value
    return call.args[position] if len(call.args) > position else None


def _writes(mode: ast.expr | None) -> bool:
    if mode is None:
        return False  # the default, "r"
    if isinstance(mode, ast.Constant) and isinstance(mode.value, str):
        return any(c in mode.value for c in "wax+")
    return True  # a mode it cannot read: counted as a write


def _os_open_writes(call: ast.Call) -> bool:
    flags = call.args[1] if len(call.args) > 1 else None
    names = {n.attr for n in ast.walk(flags) if isinstance(n, ast.Attribute)} if flags else set()
    if flags is not None and not names:
        return True  # a variable: counted as a write
    return bool(names & _WRITE_FLAGS)


class _Scanner(ast.NodeVisitor):
    def __init__(self, rel: str) -> None:
        self.rel = rel
        self.stack: list[str] = []
        self.safe: list[set[str]] = [set()]  # per function: names bound from the helper
        self.sites: list[tuple[str, int]] = []

    def _scope(self, node: ast.AST, name: str) -> None:
        self.stack.append(name)
        self.safe.append(set())
        self.generic_visit(node)
        self.stack.pop()
        self.safe.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._scope(node, node.name)

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
        self._scope(node, node.name)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._scope(node, node.name)

    def _bind(self, target: ast.expr | None, value: ast.expr) -> None:
        if (isinstance(target, ast.Name) and isinstance(value, ast.Call)
                and _dotted(value.func).split(".")[-1] in _SAFE_FACTORIES):  # fmt: skip
            self.safe[-1].add(target.id)

    def visit_With(self, node: ast.With) -> None:
        for item in node.items:
            self._bind(item.optional_vars, item.context_expr)
        self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            self._bind(target, node.value)
        self.generic_visit(node)

    def _flag(self, node: ast.Call, kind: str) -> None:
        where = ".".join(self.stack) or "<module>"
        self.sites.append((f"{self.rel}:{where}:{kind}", node.lineno))

    def visit_Call(self, node: ast.Call) -> None:
        name = _dotted(node.func)
        last = name.split(".")[-1]
        if name in ("open", "io.open", "builtins.open") and _writes(_mode(node, 1)):
            self._flag(node, "open")
        elif name == "os.open":
            if _os_open_writes(node):
                self._flag(node, "os.open")
        elif isinstance(node.func, ast.Attribute) and last == "open" and _writes(_mode(node, 0)):
            self._flag(node, "open")
        elif name in _FUNCS:
            self._flag(node, name.split(".")[-1])
        elif isinstance(node.func, ast.Attribute) and last in _METHODS:
            self._flag(node, last)
        elif name == "torch.save":
            f = node.args[1] if len(node.args) > 1 else None
            if not (isinstance(f, ast.Name) and any(f.id in s for s in self.safe)):
                self._flag(node, "torch.save")
        self.generic_visit(node)


def scan_source(source: str, rel: str) -> list[tuple[str, int]]:
    """The write sites of one module: ``("file:function:kind", line)``."""
    scanner = _Scanner(rel)
    scanner.visit(ast.parse(source, rel))
    return scanner.sites


def scan_labkit() -> list[tuple[str, int]]:
    sites = []
    for path in sorted(ROOT.rglob("*.py")):
        if path != HELPER:
            sites += scan_source(path.read_text(), str(path.relative_to(ROOT.parent)))
    return sites


def test_every_write_in_labkit_goes_through_the_helper_or_is_allowed_with_a_reason():
    sites = scan_labkit()
    allowed = ALLOWED
    bypass = sorted(f"{key} (line {line})" for key, line in sites if key not in allowed)
    assert not bypass, (
        "these write files without labkit.safe_files (use open_private / write_private / "
        "replace_private / make_private_dir, or add an ALLOWED entry with a reason):\n"
        + "\n".join(bypass)
    )
    seen = {key for key, _ in sites}
    stale = sorted(key for key in allowed if key not in seen)
    assert not stale, "allow-list entries that match no write any more (delete them):\n" + \
        "\n".join(stale)  # fmt: skip
    assert all(reason.strip() and "\n" not in reason for reason in allowed.values())


BYPASS = """
import os, numpy as np, torch
from pathlib import Path
def plant(d, x, obj):
    open(d / "a", "w").write("x")
    with open(d / "b", mode="ab") as f:
        f.write(b"x")
    Path(d, "c").write_text("x")
    (d / "e").write_bytes(b"x")
    (d / "g").mkdir()
    os.makedirs(d / "h")
    os.mkdir(d / "i", 0o700)
    fd = os.open(d / "j", os.O_WRONLY | os.O_CREAT)
    torch.save(obj, d / "k")
    (d / "l").open("w")
    open(d / "m", x)
    np.save(d / "n", obj)
    prof.export_chrome_trace(str(d / "o"))
    shutil.copy(d / "a", d / "p")
"""

THROUGH_THE_HELPER = """
import io, os, torch
from labkit.safe_files import make_private_dir, open_private, write_private
def fine(d, obj):
    print(open(d / "a").read(), open(d / "b", "rb").read(), (d / "c").open().read())
    fd = os.open(d / "d", os.O_RDONLY | os.O_NOFOLLOW)
    make_private_dir(d / "e")
    write_private(d / "f", "x")
    with open_private(d / "g", "wb") as f:
        torch.save(obj, f)
    buf = io.BytesIO()
    torch.save(obj, buf)
    text = "open(d, 'w') and .write_text() in a string, and # os.mkdir(x) in a comment"
"""


def test_the_scan_flags_each_kind_of_bypass():  # negative control
    kinds = [key.split(":")[-1] for key, _ in scan_source(BYPASS, "planted.py")]
    assert kinds == [
        "open",
        "open",
        "write_text",
        "write_bytes",
        "mkdir",
        "makedirs",
        "mkdir",
        "os.open",
        "torch.save",
        "open",
        "open",
        "save",
        "export_chrome_trace",
        "copy",
    ]
    assert {key.split(":")[1] for key, _ in scan_source(BYPASS, "planted.py")} == {"plant"}
    assert scan_source(THROUGH_THE_HELPER, "fine.py") == []


# ---- the helper itself: each check with its negative control ---------------------------------


@pytest.fixture
def box(tmp_path) -> Path:
    """A private folder (0700) and a victim file outside it that a planted link points at."""
    (tmp_path / "victim").write_text("precious\n")
    box = tmp_path / "box"
    box.mkdir(mode=0o700)
    return box


def test_a_planted_link_is_never_written_through(box):
    victim = box.parent / "victim"
    (box / "link").symlink_to(victim)
    with pytest.raises(FileExistsError, match="only as a new file"):
        write_private(box / "link", "x")
    with pytest.raises(UnsafePathError, match="it is a symbolic link"):
        open_private(box / "link", "a")
    replace_private(box / "link", "new")  # the link itself is replaced, never followed
    assert victim.read_text() == "precious\n"
    assert not (box / "link").is_symlink() and (box / "link").read_text() == "new"
    assert sorted(p.name for p in box.iterdir()) == ["link"]  # no temporary file left
    with pytest.raises(FileExistsError):  # negative control: an ordinary file is not clobbered
        write_private(box / "link", "x")
    write_private(box / "link", "x", overwrite=True)  # unless asked
    assert (box / "link").read_text() == "x"


def test_appending_refuses_a_file_others_could_write_or_a_second_link(box):
    (box / "log").write_text("a\n")
    with open_private(box / "log", "a") as f:  # negative control: an ordinary file of ours
        f.write("b\n")
    assert (box / "log").read_text() == "a\nb\n"
    os.chmod(box / "log", 0o666)
    with pytest.raises(UnsafePathError, match=r"others can write it \(mode 0666\)"):
        open_private(box / "log", "a")
    os.chmod(box / "log", 0o600)
    os.link(box / "log", box.parent / "elsewhere")
    with pytest.raises(UnsafePathError, match="links 2"):
        open_private(box / "log", "ab")
    with pytest.raises(UnsafePathError, match="links 2"):
        from labkit.safe_files import open_shared_fd

        open_shared_fd(box / "log")


def test_folders_others_can_write_or_own_are_refused(box):
    write_private(box / "ok", "x")  # negative control: a private folder is fine
    box.chmod(0o777)
    with pytest.raises(UnsafePathError, match=r"box: others can write it \(mode 0777\)"):
        write_private(box / "a", "x")
    box.chmod(0o700)
    box.parent.chmod(0o777)  # the folder above: someone could rename box and put theirs there
    with pytest.raises(UnsafePathError, match=r"others can write the folder above it"):
        write_private(box / "b", "x")
    box.parent.chmod(0o1777)  # sticky, like /tmp: others cannot move our entries
    write_private(box / "c", "x")
    if os.geteuid() == 0:
        os.chown(box.parent, 12345, -1)
        with pytest.raises(UnsafePathError, match=r"is owned by uid 12345"):
            check_folder(box)
        os.chown(box.parent, 0, -1)
        os.chown(box, 12345, -1)
        with pytest.raises(UnsafePathError, match=r"box: it is owned by uid 12345"):
            write_private(box / "d", "x")
    assert not (box / "a").exists() and not (box / "b").exists()


@pytest.mark.parametrize("umask", [0o002, 0o022, 0o077])
def test_modes_do_not_depend_on_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        deep = make_private_dir(tmp_path / "a" / "b", 0o755, parents=True)
        private = make_private_dir(tmp_path / "p")
        write_private(deep / "f", "x", perm=0o644)
        replace_private(private / "g", "x")
    finally:
        os.umask(old)
    modes = [stat.S_IMODE(p.stat().st_mode) for p in
             (tmp_path / "a", deep, private, deep / "f", private / "g")]  # fmt: skip
    assert modes == [0o755, 0o755, 0o700, 0o644, 0o600]
    with pytest.raises(ValueError, match="lets others write"):
        make_private_dir(tmp_path / "q", 0o775)
    with pytest.raises(FileExistsError):
        make_private_dir(private)
    assert make_private_dir(private, exist_ok=True) == private
    (tmp_path / "l").symlink_to(private)
    with pytest.raises(UnsafePathError, match="it is a symbolic link"):
        make_private_dir(tmp_path / "l", exist_ok=True)


def test_a_new_folder_never_lands_in_a_folder_others_can_write(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(UnsafePathError, match=r"others can write the folder above it"):
        make_private_dir(shared / "mine")
    shared.chmod(0o1777)
    assert stat.S_IMODE(make_private_dir(shared / "mine").stat().st_mode) == 0o700


def test_the_helper_imports_only_the_standard_library():
    """It sits below every floor (tests/test_imports.py): any module of labkit may use it."""
    tree = ast.parse(HELPER.read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert names and {n.split(".")[0] for n in names} <= set(sys.stdlib_module_names), names
