"""One source of hardware truth (issue 35): every hardware figure lives in
``labkit/data/files/hardware.json`` with its source, and nothing else types one.

* the catalog loads, every entry has a unit and a source, bands are ordered;
* **no hardware literal** outside it: labkit's modules and the notebooks' code cells are parsed
  with ``ast`` and a numeric literal of a hardware size (>= 1e9, or ``N * GB``) on a line that
  talks about links, FLOP/s or memory, or any literal inside ``AlphaBeta(...)``, fails, naming
  file and line (negative control: the old ``LINKS`` line is caught); a nominal figure that
  is no hardware (a miniature's memory) says ``# not hardware`` on its line;
* **prose numbers derived**: a number with a unit (GB, GB/s, Gb/s, TFLOP/s, ms, s, min, h,
  days, %, 1.5x ...) in any notebook's markdown, or typed into a code cell's ``"Say: ..."``
  template (outside its ``{...}`` fields), fails unless its line names a catalog entry in
  backticks (`` `a100.nic_bandwidth` ``) or it is one of the few ``ALLOWED`` phrases (each
  with why it is no figure). A markdown **Say:** may not carry a claim at all (a digit, a
  magnitude word such as "twice" or "tens of", a placement such as "across nodes"): those are
  printed by the cell, from its variables. Negative controls: the typed lines issue 35 found
  ("tens of GB per layer", "dp crosses nodes", "~150 GB/s") are caught.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import nbformat
import pytest

import labkit
from labkit import hardware

ROOT = Path(labkit.__file__).resolve().parent
NB = ROOT.parent / "notebooks"
CATALOG_READERS = {ROOT / "hardware.py"}
KEYWORDS = re.compile(
    r"bandwidth|_bw\b|\bbw\b|flops|flop/s|peak|nvlink|infiniband|ethernet|pcie|hbm|\blinks?\b|"
    r"\bnics?\b|memory_bytes|card_bytes|gpu_memory|\bfits\(|intra|inter_|tflop|gb/s",
    re.IGNORECASE,
)
# unit conversions, not hardware: 1e9 (GB), 1e12 (TB, TFLOP), 2**30 (GiB) ...
UNITS = {1e3, 1e6, 1e9, 1e12, 1e15, 1e18, 1e21, 2.0**20, 2.0**30, 2.0**40}
GB_NAMES = {"GB", "GiB", "TB"}


def hardware_literals(source: str, name: str) -> list[str]:
    """``"name:line: text"`` for each hardware-sized literal (module docstring) in ``source``."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    lines = source.splitlines()
    found: dict[int, str] = {}

    def flag(node: ast.AST) -> None:
        ln = getattr(node, "lineno", 0)
        if "not hardware" in lines[ln - 1]:  # a nominal figure, said so on its line
            return
        found.setdefault(ln, f"{name}:{ln}: {lines[ln - 1].strip()[:100]}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) \
                == "AlphaBeta":  # fmt: skip
            for arg in [*node.args, *(k.value for k in node.keywords)]:
                for sub in ast.walk(arg):
                    if isinstance(sub, ast.Constant) and isinstance(sub.value, (int, float)) \
                            and sub.value not in (0, 1):  # fmt: skip
                        flag(sub)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
            sides = (node.left, node.right)
            if any(isinstance(s, ast.Name) and s.id in GB_NAMES for s in sides) and any(
                isinstance(s, ast.Constant) and isinstance(s.value, (int, float)) for s in sides
            ) and KEYWORDS.search(lines[node.lineno - 1]):  # fmt: skip
                flag(node)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) \
                and not isinstance(node.value, bool):  # fmt: skip
            v = float(node.value)
            if v >= 1e9 and v not in UNITS and KEYWORDS.search(lines[node.lineno - 1]):
                flag(node)
    return [found[k] for k in sorted(found)]


def _sources() -> list[tuple[str, str]]:
    out = [(str(p.relative_to(ROOT.parent)), p.read_text()) for p in sorted(ROOT.rglob("*.py"))
           if p not in CATALOG_READERS]  # fmt: skip
    for nb in sorted(NB.glob("*.ipynb")):
        for i, cell in enumerate(nbformat.read(nb, as_version=4).cells):
            if cell.cell_type == "code":
                out.append((f"{nb.name}[{i}]", cell.source))
    return out


def test_the_catalog_loads_and_every_entry_has_a_unit_and_a_source() -> None:
    ent, bnd = hardware.entries(), hardware.bands()
    assert len(ent) >= 30 and {"a100.mfu", "h100.mfu"} <= set(bnd)
    for e in ent.values():
        assert e.unit and len(e.source) > 10, e
    assert hardware.value("a100.nvlink_per_direction") == 300e9
    assert hardware.cite("a100.nic_bandwidth", 1e9, "GB/s") == "25 GB/s (a100.nic_bandwidth)"
    assert hardware.band("a100.mfu").verdict(0.63) == "above"
    assert hardware.band("a100.mfu").verdict(0.54) == "within"


def test_an_unknown_name_or_a_sourceless_entry_is_refused() -> None:
    with pytest.raises(KeyError, match="a100.nvlink_per_direction"):
        hardware.value("a100.nvlink_per_directon")
    with pytest.raises(ValueError, match="x.y"):
        hardware._parse({"entries": {"x.y": {"value": 1, "unit": "B", "what": "", "source": ""}}})
    with pytest.raises(ValueError, match="low <= high"):
        hardware._parse({"entries": {}, "bands": {"b": {"low": .6, "high": .5, "unit": "MFU",
                                                        "what": "w", "source": "s", "short": "s"}}})


# a ratchet like PENDING below: found when the scan arrived in a notebook another helper owns;
# it must still be there (delete the entry once fixed), and nothing may join it
LITERAL_PENDING: set[str] = set()


def test_no_hardware_literal_outside_the_catalog() -> None:
    hits = [hit for name, src in _sources() for hit in hardware_literals(src, name)]
    bad = [h for h in hits if h.split(": ", 1)[0] not in LITERAL_PENDING]
    assert not bad, "hardware figures typed outside labkit/data/files/hardware.json " \
        "(read labkit.hardware.value(...)):\n" + "\n".join(bad)  # fmt: skip
    stale = LITERAL_PENDING - {h.split(": ", 1)[0] for h in hits}
    assert not stale, f"fixed: delete these entries from LITERAL_PENDING: {sorted(stale)}"


def test_the_literal_scan_catches_a_typed_figure() -> None:  # negative control
    old = 'LINKS = {"NVLink": AlphaBeta(5e-6, 1 / 150e9)}  # A100 NVLink\n'
    assert hardware_literals(old, "old") == [f"old:1: {old.strip()}"]
    assert hardware_literals("intra_bandwidth=300 * GB,\n", "c")
    assert hardware_literals("peak_flops=312e12\n", "p")
    assert hardware_literals("ok = estimate(cfg).fits(80e9)\n", "f")
    # a read from the catalog, a unit conversion and a token count pass
    fine = ('bw = value("a100.nvlink_per_direction")\nprint(bw / 1e9, "GB/s bandwidth")\n'
            'tokens = 300e9\nLINKS = {"NVLink": AlphaBeta(value("link.nvlink_latency"), 1 / bw)}\n')
    assert hardware_literals(fine, "fine") == []


# -- prose: numbers with units in markdown and Say templates --------------------------------
NUMBER = r"(?<![\w.^/-])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
UNIT = re.compile(NUMBER + r"(?:\s*(?:GB/s|Gb/s|TB/s|MB/s|GiB|MiB|KiB|GB|MB|KB|TB|PB|TFLOP/s|"
                  r"TFLOPS|TFLOP|PFLOP/s|ms|µs|us|min|days?|hours?|%)(?![\w/])|"
                  r"\s+(?:s|h)(?![\w/])|x(?![\w/]))")
CITED = re.compile(r"`([a-z0-9_]+\.[a-z0-9_]+)`")
# the few unit-bearing phrases that are no figure at all (a confidence level, a definition)
ALLOWED = {
    "95% interval": "the confidence level of bench_cells.median_interval, not a measurement",
}
SAY_MD = re.compile(r"\*\*Say:\*\*(.*?)(?:\*\*|$)", re.DOTALL)
CLAIM = re.compile(r"\d|\b(?:twice|half|double|triple|tens of|hundreds of|thousands of|dozens|"
                   r"inside (?:a|the) node|across (?:the )?nodes|crosses)\b", re.IGNORECASE)


def unit_numbers(text: str) -> list[str]:
    """Lines of ``text`` with a number and a unit that no catalog name or ALLOWED excuses."""
    names = set(hardware.entries()) | set(hardware.bands())
    bad = []
    for line in text.splitlines():
        if any(c in names for c in CITED.findall(line)):
            continue
        rest = line
        for phrase in ALLOWED:
            rest = rest.replace(phrase, "")
        bad += [f"{m.group(0)!r} in: {line.strip()[:110]}" for m in UNIT.finditer(rest)]
    return bad


def say_claims(markdown: str) -> list[str]:
    """A markdown **Say:** that carries a number, a magnitude or a placement (typed, not
    printed)."""
    return [f"typed Say: {say.strip()[:110]}" for say in SAY_MD.findall(markdown)
            if CLAIM.search(say)]  # fmt: skip


def say_templates(code: str) -> list[str]:
    """The literal text of every ``"Say: ..."`` string in ``code`` (f-string fields dropped),
    with the strings implicitly joined to it on the same call."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            parts = [a for a in node.args if isinstance(a, (ast.JoinedStr, ast.Constant))]
            text = "".join(_literal(a) for a in parts)
            if text.startswith("Say:"):
                out.append(text)
    return out


def _literal(node: ast.AST) -> str:
    if isinstance(node, ast.Constant):
        return node.value if isinstance(node.value, str) else ""
    if isinstance(node, ast.JoinedStr):
        return "".join(_literal(v) if isinstance(v, ast.Constant) else " {} "
                       for v in node.values)  # fmt: skip
    return ""


def prose_problems(path: Path) -> list[str]:
    out = []
    for i, cell in enumerate(nbformat.read(path, as_version=4).cells):
        where = f"{path.name}[{i}]"
        if cell.cell_type == "markdown":
            out += [f"{where}: {p}" for p in unit_numbers(cell.source) + say_claims(cell.source)]
        elif cell.cell_type == "code":
            out += [f"{where}: Say template {p}" for t in say_templates(cell.source)
                    for p in unit_numbers(t)]  # fmt: skip
    return out


# Typed numbers found in notebooks other helpers were editing when the scan arrived (issue 35):
# a ratchet, not an exemption. Each entry must still be found (fix the line, then delete the
# entry, or the test fails), and nothing new may join it.
PENDING: dict[str, tuple[str, ...]] = {}


def _found() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for nb in sorted(NB.glob("*.ipynb")):
        for p in prose_problems(nb):
            where, what = p.split(": ", 1)
            out.setdefault(where, []).append(what)
    return out


def test_every_prose_number_is_printed_or_a_named_catalog_entry() -> None:
    found = _found()
    new = [f"{w}: {p}" for w, ps in found.items()
           for p in ps[len(PENDING.get(w, ())):]]  # fmt: skip
    assert not new, "typed numbers in the prose (print them from the cell, or cite a catalog " \
        "entry by name on the line):\n" + "\n".join(new)  # fmt: skip
    stale = [w for w, nums in PENDING.items()
             if [p.split("'")[1] for p in found.get(w, [])][: len(nums)] != list(nums)]
    assert not stale, f"fixed: delete these entries from PENDING: {stale}"


def test_the_prose_scan_catches_the_typed_lines_issue_35_found() -> None:  # negative control
    assert unit_numbers("**Say:** at 32k tokens the scores alone are tens of GB per layer")  == []
    assert say_claims("**Say:** at 32k tokens the scores alone are tens of GB per layer. x")
    assert say_claims("**Say:** tp inside, pp and dp across nodes. **Monitor:** x")
    assert unit_numbers("A typical node: NVLink inside (here ~150 GB/s per GPU, 5 µs)")
    assert unit_numbers("ZeRO-3 sends 1.5x the bytes") and unit_numbers("a 60 s save")
    code = 'print(f"Say: a synchronous 1.2 TB save at {bw / 1e9:.0f} GB/s ({t:.0f} s)")'
    assert [p for t in say_templates(code) for p in unit_numbers(t)]
    # a cited entry, a printed value, spelled-out words and definitions pass
    assert unit_numbers("one 200 Gb/s NIC per GPU (`a100.nic_bandwidth`)") == []
    assert unit_numbers("decided by the 95% interval of the median ratio") == []
    assert unit_numbers("8 x 8 GPUs, 224x224 images, 2(p-1)/p of the bytes, GPT-2 1.3B") == []
    assert say_claims("**Say:** printed below, from the cell's numbers. **Monitor:**") == []
    ok = 'print(f"Say: a synchronous {tb:.1f} TB save at {bw / 1e9:.0f} GB/s ({t:.0f} s)")'
    assert [p for t in say_templates(ok) for p in unit_numbers(t)] == []


def test_the_a100_mfu_band_is_model_flops_not_narayanans_hardware_flops() -> None:
    from labkit.planner.flops import MEGATRON_TABLE1, megatron_flops_per_iteration
    from labkit.planner.published import MEGATRON_README_UTILIZATION

    b = hardware.band("a100.mfu")
    assert b.high == MEGATRON_README_UTILIZATION["1T"][0]  # the README's MFU, not its HFU
    # Narayanan et al. 2021's 1T row: 163 TFLOP/s counted with the recompute forward (96 B s l
    # h^2) is hardware FLOP utilisation; without that forward (72) it is below the band
    row = MEGATRON_TABLE1[-1]
    args = (row.batch, 2048, row.layers, row.hidden, 51_200)
    hfu = row.tflops_per_gpu * 1e12 / hardware.value("a100.peak_bf16")
    mfu = hfu * megatron_flops_per_iteration(*args, recompute=False) / (
        megatron_flops_per_iteration(*args, recompute=True))
    assert b.verdict(mfu) == "below" and 0.38 < mfu < 0.40
    # negative control: the 2021 figure read as MFU (0.52) would sit inside the band
    assert b.verdict(hfu) == "within"
