"""One source for every number: a scenario's lesson and notebook 13's walkthrough of it plan
with the same labkit function and the same configuration (``labkit.interview.scenarios``),
and where notebooks 06, 11 and 13 show memory for the same shape they agree or name the
difference (SDPA against Korthikanti's stored scores) beside the number.

The notebooks are read as source (their code cells parsed with ``ast``), and the cheap cells
that print a scenario's key numbers are executed, so a lesson that drifts (another batch,
another cluster, a copied number) fails here rather than in front of a learner.
"""

from __future__ import annotations

import ast
import contextlib
import io
import re
from pathlib import Path

import nbformat
import pytest

from labkit.interview.scenarios import BERT_4NODES, GPT_1P3B, GPT_10B_MIXED, GPT_100B_3D, SCENARIOS
from labkit.memory.model import activation_bytes_per_layer

NB = Path(__file__).resolve().parent.parent / "notebooks"
WALK = NB / "13_interview_walkthroughs.ipynb"
LESSONS = {
    "S3": "11_gpt2_1p3b_capstone.ipynb",
    "S4": "09_bert_on_4_nodes.ipynb",
    "S5": "10_10b_mixed_interconnects.ipynb",
    "S6": "08_3d_100b_on_64_gpus.ipynb",
}
NAMES = {"S3": "GPT_1P3B", "S4": "BERT_4NODES", "S5": "GPT_10B_MIXED", "S6": "GPT_100B_3D"}
CALLS = {"S3": {"ladder", "choice", "setup"}, "S4": {"allreduce"}, "S5": {"plan", "choice"},
         "S6": {"plan", "choice"}}  # fmt: skip
# a walkthrough that calls these itself has a second configuration of the scenario
SECOND_SOURCE = {"plan_3d", "rank_layouts", "with_nodes", "allreduce_times", "TrainSetup",
                 "preset", "gpt_of_size", "plan"}  # fmt: skip


def _cells(path: Path) -> list[nbformat.NotebookNode]:
    return list(nbformat.read(path, as_version=4).cells)


def _code(cells: list[nbformat.NotebookNode]) -> str:
    return "\n".join(c.source for c in cells if c.cell_type == "code")


def _section(path: Path, sid: str) -> list[nbformat.NotebookNode]:
    """The cells from the ``## <sid> ...`` heading to the next level-2 heading."""
    cells, out, inside = _cells(path), [], False
    for c in cells:
        if c.cell_type == "markdown" and c.source.startswith("## "):
            inside = c.source.startswith(f"## {sid} ")
        if inside:
            out.append(c)
    assert out, f"{path.name}: no section ## {sid}"
    return out


def _scenario_use(code: str, name: str) -> set[str]:
    """The attributes of scenario ``name`` the code uses, if it imports it from
    ``labkit.interview.scenarios`` (empty set otherwise)."""
    tree = ast.parse(code)
    imported = any(
        isinstance(n, ast.ImportFrom) and n.module == "labkit.interview.scenarios"
        and any(a.name == name for a in n.names)
        for n in ast.walk(tree)
    )  # fmt: skip
    if not imported:
        return set()
    return {
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == name
    }


def _called(code: str) -> set[str]:
    """Names of the functions and methods called, but not the scenarios' own methods."""
    out = set()
    for n in ast.walk(ast.parse(code)):
        if isinstance(n, ast.Call):
            f = n.func
            if isinstance(f, ast.Attribute):
                if not (isinstance(f.value, ast.Name) and f.value.id in NAMES.values()):
                    out.add(f.attr)
            else:
                out.add(getattr(f, "id", ""))
    return out


def _literal_mismatches(code: str, sid: str) -> list[str]:
    """For a lesson that does not import its scenario yet (08, 10: the planner's notebooks):
    its literal configuration, read from the source, against the scenario's."""
    s = SCENARIOS[sid]
    tree = ast.parse(code)
    names: dict[str, object] = {}
    for n in ast.walk(tree):  # NAME = literal, and A, B = literal, literal
        if isinstance(n, ast.Assign) and len(n.targets) == 1:
            t = n.targets[0]
            with contextlib.suppress(ValueError, SyntaxError):
                value = ast.literal_eval(n.value)
                if isinstance(t, ast.Name):
                    names[t.id] = value
                elif isinstance(t, ast.Tuple) and isinstance(value, tuple):
                    names.update({e.id: v for e, v in zip(t.elts, value, strict=False)
                                  if isinstance(e, ast.Name)})  # fmt: skip

    def value(node: ast.expr) -> object:
        if isinstance(node, ast.Name):
            return names.get(node.id)
        with contextlib.suppress(ValueError, SyntaxError):
            return ast.literal_eval(node)
        return None

    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]

    def args(fn: str) -> list[list[object]]:
        return [[value(a) for a in c.args] for c in calls
                if (c.func.attr if isinstance(c.func, ast.Attribute) else getattr(c.func, "id", ""))
                == fn]  # fmt: skip

    strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)}
    bad = []
    searches = args(s.search)
    if not any(len(a) >= 3 and a[2] == s.global_batch for a in searches):
        bad.append(f"{s.search}(..., global batch {s.global_batch}) not called: {searches}")
    if not any(a and a[0] == s.nodes for a in args("with_nodes")):
        bad.append(f"with_nodes({s.nodes}) not called: {args('with_nodes')}")
    if s.cluster_name not in strings:
        bad.append(f"cluster {s.cluster_name!r} not named")
    if sid == "S6" and [100] not in args("gpt_of_size"):
        bad.append(f"gpt_of_size(100) not called: {args('gpt_of_size')}")
    if sid == "S5" and "GPT_10B" not in {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}:
        bad.append("GPT_10B not used")
    return bad


def _run(code: str, scope: dict) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "<notebook>", "exec"), scope)  # noqa: S102 - the project's notebooks
    return out.getvalue()


@pytest.mark.parametrize("sid", sorted(LESSONS))
def test_the_walkthrough_plans_with_the_lessons_scenario(sid):
    name = NAMES[sid]
    walk = _code(_section(WALK, sid))
    head = _code(_cells(WALK)[:2])  # the import cell
    used = _scenario_use(head + "\n" + walk, name)
    assert used & CALLS[sid], f"13 §{sid} does not call {name}'s {sorted(CALLS[sid])}: {used}"
    second = _called(walk) & SECOND_SOURCE
    assert not second, f"13 §{sid} configures the scenario a second time: calls {sorted(second)}"
    lesson = _code(_cells(NB / LESSONS[sid]))
    if _scenario_use(lesson, name):  # the lesson imports it: one source by construction
        assert _scenario_use(lesson, name) & (CALLS[sid] | {"cfg", "intra", "inter"}), sid
    else:  # not yet (08 and 10 belong to the planner's notebooks): their literals must agree
        bad = _literal_mismatches(lesson, sid)
        assert not bad, (LESSONS[sid], bad)


def test_the_literal_check_catches_a_lesson_that_drifts():
    # negative control: 08 with another global batch, 10 on another number of nodes
    drifts = (
        ("S6", "GLOBAL_BATCH = 512", "GLOBAL_BATCH = 1024"),
        ("S5", "NODES, GLOBAL_BATCH = 4, 256", "NODES, GLOBAL_BATCH = 8, 256"),
    )
    for sid, old, new in drifts:
        code = _code(_cells(NB / LESSONS[sid]))
        if old not in code:
            pytest.skip(f"{LESSONS[sid]} no longer states {old!r} (it may import its scenario)")
        assert _literal_mismatches(code.replace(old, new), sid), sid
    walk = _code(_section(WALK, "S6")) + "\nplan_3d(cfg100, CLUSTERS['dgx-a100-80gb'], 512)"
    assert _called(walk) & SECOND_SOURCE == {"plan_3d"}


def test_lesson_11_and_13_print_the_same_1p3b_ladder_and_choice():
    cells = _cells(NB / LESSONS["S3"])
    scope: dict = {}
    _run(cells[1].source + "\n" + cells[3].source, scope)  # imports, cfg; psi on meta
    table_cell = next(c.source for c in cells if c.source.startswith("STRATEGIES = {"))
    _run(table_cell, scope)
    table, gpus = scope["table"], GPT_1P3B.gpus
    ladder = GPT_1P3B.ladder()
    for stage, row in (("ddp", "DDP bf16"), ("zero1", "ZeRO-1 bf16"), ("zero2", "ZeRO-2 bf16"),
                       ("zero3", "ZeRO-3 bf16")):  # fmt: skip
        assert table[gpus, row] == ladder[stage], (stage, table[gpus, row], ladder[stage])
    # 13 prints the same choice and totals
    walk = _run(_code(_cells(WALK)[:2]) + "\n" + _code(_section(WALK, "S3")), {})
    assert f"and the choice: {GPT_1P3B.choice()}" in walk
    for stage, e in ladder.items():
        assert re.search(rf"{stage}\s+on {gpus} x 24 GB:\s+{e.total / 1e9:5.1f} GB", walk), stage
    # the Say names the chosen stage's states, not its total, as "the states" (P4)
    ch = ladder[GPT_1P3B.choice()]
    states = (ch.parameters + ch.gradients + ch.optimizer_state) / 1e9
    assert f"shards the states to {states:.1f} GB, {ch.total / 1e9:.1f} GB per GPU" in walk
    assert f"the states to {ch.total / 1e9:.1f} GB" not in walk  # the old mislabel


def test_lesson_09_and_13_print_the_same_bert_allreduce():
    cells = _cells(NB / LESSONS["S4"])
    scope: dict = {}
    lesson = _run(cells[1].source + "\n" + cells[5].source, scope)  # imports; the all-reduce
    walk = _run(_code(_cells(WALK)[:2]) + "\n" + _code(_section(WALK, "S4")), {})
    for model in ("bert-base", "bert-large"):
        for scheme in ("fp32", "fp16"):
            t = BERT_4NODES.allreduce(model, scheme)
            flat, hier = t["flat ring"] * 1e3, t["hierarchical"] * 1e3
            row = rf"{model} {scheme}\s+{flat:.1f}\s+{hier:.1f}"
            assert re.search(row, lesson), (model, scheme)
            assert f"flat ring {flat:6.1f} ms, hierarchical {hier:6.1f} ms" in walk, (model, scheme)


def test_13_prints_the_planners_choice_for_10b_and_100b():
    walk = _run(_code(_cells(WALK)[:2]) + "\n" + _code(_section(WALK, "S5"))
                + "\n" + _code(_section(WALK, "S6")), {})  # fmt: skip
    for label, scen in (("notebook 10,    choice", GPT_10B_MIXED), ("choice", GPT_100B_3D)):
        c = scen.choice().candidate
        assert f"{label}: dp={c.dp} tp={c.tp} pp={c.pp}" in walk, (label, c)
    # S5 prints the bytes each link carries (mixed_links.traffic), the slow one in the Say
    from labkit.labs.mixed_links import traffic

    c5 = GPT_10B_MIXED.choice().candidate
    sent = traffic(GPT_10B_MIXED.cfg, GPT_10B_MIXED.global_batch, c5, GPT_10B_MIXED.cluster)
    slow = sum(b for b, link in sent.values() if link == "slow")
    assert f"pp {sent['pp'][0] / 1e9:.1f} GB on the slow (Ethernet) link" in walk
    assert f"tp {sent['tp'][0] / 1e9:.1f} GB on the fast (NVLink) link" in walk
    assert f"carrying {slow / 1e9:.1f} GB a GPU a step" in walk and 0 < slow < sent["tp"][0]


def test_06_11_13_agree_on_1p3b_activations_or_name_the_difference():
    cfg, s = GPT_1P3B.cfg, GPT_1P3B.cfg.block_size
    sdpa = GPT_1P3B.ladder()["ddp"].activations
    korth = cfg.n_layer * activation_bytes_per_layer(s, 1, cfg.n_embd, cfg.n_head)
    scores = cfg.n_layer * 5 * cfg.n_head * s * s  # the named difference: 5 a s^2 b per layer
    selective = cfg.n_layer * activation_bytes_per_layer(s, 1, cfg.n_embd, cfg.n_head,
                                                         recompute="selective")  # fmt: skip
    assert korth - selective == pytest.approx(scores) and sdpa < korth
    six = next(
        c.source
        for c in _cells(NB / "06_tensor_parallel.ipynb")
        if 'preset("gpt2-1.3b")' in c.source and "activation_bytes_per_layer" in c.source
    )
    out6 = _run(six, {})
    assert f"tp=1: {korth / 1e9:5.1f} GB per GPU (Korthikanti: attention scores stored)" in out6
    assert f"no scores stored), as notebook 11 estimates: {sdpa / 1e9:.1f}" in out6
    walk = _run(_code(_cells(WALK)[:2]) + "\n" + _code(_section(WALK, "S3")), {})
    both = f"{sdpa / 1e9:.1f} GB with SDPA (notebook 11), {korth / 1e9:.1f} GB by Korthikanti"
    assert both in walk
    eleven = "\n".join(c.source for c in _cells(NB / LESSONS["S3"]) if c.cell_type == "markdown")
    assert "SDPA" in eleven  # 11 names the kernel its estimate assumes


# K11 (notebook 17): the cadence, the save costs and the reshard 13 prints come from CKPT_100B
K11_CALLS = {"measure", "intervals", "interval", "wasted", "reshard_reads", "sync_save_seconds",
             "async_save_seconds", "mtbf_seconds"}  # fmt: skip
K11_SECOND_SOURCE = {"young_daly_interval", "failure_overhead", "checkpoint_overhead",
                     "cluster_mtbf_hours", "save_vs_async", "save_checkpoint", "plan_read",
                     "AsyncCheckpointer"}  # fmt: skip
FIXED_COST = {"sync_s": 0.2, "async_s": 0.025, "write_s": 0.15, "bytes": 24e6}  # not measured


def _k11_numbers_missing(out: str, scenario) -> list[str]:
    """The scenario's intervals (minutes) and time wasted, as the two notebooks' table prints
    them, that ``out`` lacks."""
    return [row for s, name, t, w in scenario.intervals()
            if not re.search(rf"{s}\s+{name}\s+{t / 60:.0f}\s+{w:.2%}", out)
            for row in [f"{s} {name} {t / 60:.0f} min {w:.2%}"]]  # fmt: skip


def _k11_outputs(monkeypatch) -> tuple[str, str]:
    """13's K11 section and 17's § 6 + S6 cells, run with one fixed measurement."""
    from labkit.interview import scenarios

    monkeypatch.setattr(scenarios, "save_vs_async", lambda numel: dict(FIXED_COST))
    walk = _run(_code(_cells(WALK)[:2]) + "\n" + _code(_section(WALK, "K11")), {})
    cells = [c.source for c in _cells(NB / "17_node_loss.ipynb") if c.cell_type == "code"]
    measure = next(c for c in cells if "CKPT_100B.measure()" in c)
    s6 = next(c for c in cells if "CKPT_100B.intervals()" in c)
    return walk, _run(measure + "\n" + s6, {})


def test_13_and_17_take_k11_from_one_scenario(monkeypatch):
    from labkit.interview.scenarios import CKPT_100B

    walk_code = _code(_section(WALK, "K11"))
    lesson_code = _code(_cells(NB / "17_node_loss.ipynb"))
    for name, code in (("13 §K11", walk_code), ("17", lesson_code)):
        assert _scenario_use(code, "CKPT_100B") & K11_CALLS, f"{name} does not use CKPT_100B"
    second = _called(walk_code) & K11_SECOND_SOURCE
    assert not second, f"13 §K11 configures K11 a second time: calls {sorted(second)}"
    walk, lesson = _k11_outputs(monkeypatch)
    for out in (walk, lesson):
        assert not _k11_numbers_missing(out, CKPT_100B), out
        assert f"a synchronous save {CKPT_100B.sync_save_seconds:.0f} s" in out
        assert f"{CKPT_100B.mtbf_seconds / 86400:.1f} days" in out
    reads = CKPT_100B.reshard_reads(1000, 8, 7)
    assert reads[3] == [(3, 71), (4, 72)]  # [375, 500) from [375, 446) and [446, 571)
    assert sum(n for r in reads for _, n in r) == 1000
    # the node-loss reshard is S6's own: from the plan's (tp, dp) to the 7-node fallback's
    old, new = GPT_100B_3D.choice().candidate, GPT_100B_3D.fallback().candidate
    statement = CKPT_100B.node_loss_reshard(GPT_100B_3D.cfg.n_embd, (old.tp, old.dp),
                                            (new.tp, new.dp))  # fmt: skip
    assert f"tp {old.tp} x ZeRO over dp {old.dp}" in statement and statement in walk
    assert "from 2 old shards at most" in statement  # dp 2 -> 56: ranges straddle two shards
    # the Say states the batch the 7 nodes run, and an every-step save is priced at S6's step
    assert f"drops to {GPT_100B_3D.fallback_batch}" in walk
    assert f"every {GPT_100B_3D.choice().step_seconds:.1f}-s step of S6" in walk
    # 17 § 8 prints it with the same calls, after the drill (not run here: it needs the drill)
    assert "S6.fallback()" in lesson_code and "CKPT_100B.node_loss_reshard(" in lesson_code
    # negative controls: another restart cost or write bandwidth is caught in both outputs,
    # and a walkthrough that calls Young/Daly itself is a second source
    import dataclasses

    for other in (dataclasses.replace(CKPT_100B, restart_seconds=600.0),
                  dataclasses.replace(CKPT_100B, write_bandwidth=4e9)):  # fmt: skip
        assert _k11_numbers_missing(walk, other), other
        assert _k11_numbers_missing(lesson, other), other
    forged = walk_code + "\nyoung_daly_interval(75.0, 33 * 86400)"
    assert _called(forged) & K11_SECOND_SOURCE == {"young_daly_interval"}
