"""The one table helper (labkit.viz.table): units in headers, scaled cells, no bare nan, no
overflowing row, and readable fields instead of a dataclass repr."""

from __future__ import annotations

import math

import pytest

from labkit.models import preset
from labkit.planner import Candidate
from labkit.viz.table import Column, fields, format_table, mapping_table


def test_headers_carry_units_and_cells_are_scaled():
    out = format_table(
        ["variant", Column("step", "ms", ".1f", 1e3), Column("share", fmt=".0%")],
        [("ring", 0.0123, 0.25), ("hierarchical", 0.5, 1.0)],
    )
    lines = out.splitlines()
    assert lines[0].split() == ["variant", "step", "(ms)", "share"]
    assert set(lines[1]) == {"-"}
    assert lines[2].split() == ["ring", "12.3", "25%"]
    assert lines[3].split() == ["hierarchical", "500.0", "100%"]


def test_no_bare_nan_and_no_row_overflows_its_column():
    long_name = "hierarchical, powersgd rank 2, bucketed (0.05 MB)"
    out = format_table(
        ["variant", Column("sent", "KB", ".1f", 1e-3)],
        [("torch", float("nan")), ("ring", None), (long_name, 1234.0), ("x", math.inf)],
    )
    assert "nan" not in out and "inf" not in out and out.count("n/a") == 3
    lines = out.splitlines()
    assert len({len(line) for line in lines[:1] + lines[2:]}) == 1  # numbers right-aligned
    assert all(len(line) <= len(long_name) + 2 + len("sent (KB)") for line in lines)
    # negative control: the old f-string padding ({name:>40}) lets a long name push the row
    assert len(f"{long_name + ' (v2)':>40}{1.234:>9.1f}") > 49
    custom = format_table([Column("v=2", fmt=".2f", missing="-")], [(None,), (0.5,)])
    assert custom.splitlines()[2].strip() == "-"


def test_a_row_of_the_wrong_length_is_refused_with_its_values():
    with pytest.raises(ValueError, match=r"row 1 has 1 values for 2 columns .*\['only'\]"):
        format_table(["a", "b"], [(1, 2), ("only",)])


def test_mapping_table_and_fields_replace_reprs():
    out = mapping_table({"parameters": 2.5e9, "activations": 3.75e9}, Column("per GPU", "GB",
                        ".1f", 1e-9), key="memory")  # fmt: skip
    assert out.splitlines()[0].split() == ["memory", "per", "GPU", "(GB)"]
    assert "2.5" in out and "3.8" in out and "{" not in out
    c = Candidate(dp=2, tp=4, pp=8, micro_batch=1, zero=1, recompute="selective")
    line = fields(c, only=("dp", "tp", "pp", "zero", "recompute"))
    assert line == "dp=2  tp=4  pp=8  zero=1  recompute=selective"
    assert "Candidate(" not in fields(c)
    cfg_line = fields(preset("gpt2-1.3b"), units={"block_size": "tokens"})
    assert "vocab_size=50,257" in cfg_line and "block_size=2,048 tokens" in cfg_line
    assert "GPTConfig(" not in cfg_line
    assert fields({"lr": 3e-4, "x": float("nan")}) == "lr=0.0003  x=n/a"
    with pytest.raises(KeyError, match="no field"):
        fields(c, only=("nope",))
    with pytest.raises(TypeError, match="dataclass instance or a mapping"):
        fields(42)
