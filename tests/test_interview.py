"""Interview rehearsal: every topic id is rehearsed, indexed and quizzed; the checks grade."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

from labkit.checks.core import CheckFailed
from labkit.checks.interview import ask, check, is_right
from labkit.interview.estimates import (
    LINKS,
    checkpoint_overhead,
    first_fitting_stage,
    predict_ddp_step,
    resnet50_counts,
    young_daly_interval,
)
from labkit.interview.quiz import QUESTIONS, expected, questions_for
from labkit.interview.topics import TOPICS_PATH, load_topics, topic_ids

ROOT = Path(__file__).resolve().parent.parent
INDEX = ROOT / "notebooks" / "14_interview_index.ipynb"
LINK = re.compile(r"\]\((?P<nb>[\w./-]+\.ipynb)#(?P<anchor>[\w.-]+)\)")


def _anchor(heading: str) -> str:
    """Jupyter's heading anchor: spaces become '-', other characters are kept."""
    return heading.strip().replace(" ", "-")


def _headings(nb_path: Path) -> set[str]:
    nb = nbformat.read(nb_path, as_version=4)
    out = set()
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                m = re.match(r"^#+\s+(.*)$", line)
                if m:
                    out.add(_anchor(m.group(1)))
    return out


def test_the_project_ships_its_own_topics_list():
    assert TOPICS_PATH.is_file() and TOPICS_PATH.is_relative_to(ROOT / "labkit")
    ids = topic_ids()
    assert ids[:2] == ["S1", "S2"] and len(ids) == len(set(ids))
    assert {t.section for t in load_topics()} == {
        "Scenarios",
        "Answer strategies",
        "Core knowledge",
        "Pitfalls",
    }


def test_index_links_every_id_to_an_existing_heading():
    nb = nbformat.read(INDEX, as_version=4)
    text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    linked: dict[str, list[tuple[str, str]]] = {}
    for line in text.splitlines():
        m = re.match(r"^\|\s*\*?\*?(?P<id>[SAKP]\d+)\*?\*?\s*\|", line)
        if m:
            linked[m["id"]] = [(x["nb"], x["anchor"]) for x in LINK.finditer(line)]
    missing = [i for i in topic_ids() if not linked.get(i)]
    assert not missing, f"ids without a linked section in the index: {missing}"
    for qid, links in linked.items():
        for nb_rel, anchor in links:
            target = (INDEX.parent / nb_rel).resolve()
            assert target.is_file(), f"{qid}: {nb_rel} does not exist"
            assert anchor in _headings(target), f"{qid}: no heading #{anchor} in {nb_rel}"


def test_every_id_has_two_to_four_questions_and_answers_compute():
    for tid in topic_ids():
        qs = questions_for(tid)
        assert 2 <= len(qs) <= 4, (tid, len(qs))
        for q in qs:
            value = expected(q)
            if q.choices:
                assert value in q.choices, q.qid


@pytest.mark.parametrize("qid", list(QUESTIONS))
def test_check_accepts_the_right_answer_and_rejects_a_wrong_one(qid, capsys):
    q = QUESTIONS[qid]
    right = expected(q)
    check(qid, right)
    assert "PASSED" in capsys.readouterr().out
    wrong = next(c for c in q.choices if c != right) if q.choices else right * 1.5 + 1
    assert not is_right(qid, wrong)
    with pytest.raises(CheckFailed, match="Why"):
        check(qid, wrong)


def test_check_explains_bad_input():
    assert "Choose one of" in ask("S7.2")
    with pytest.raises(CheckFailed, match="not one of the choices"):
        check("S7.2", "fsdp-ish")
    with pytest.raises(CheckFailed):
        check("S1.1", "a lot")
    with pytest.raises(ValueError, match="no question"):
        check("Z9.9", 1)


def test_estimates_match_the_published_resnet50_and_the_formulas():
    params, flops = resnet50_counts()
    assert params == 25_557_032  # torchvision's ResNet-50 count
    assert flops == pytest.approx(8.18e9, rel=0.01)  # 4.09 GMACs per 224x224 image
    pcie, nvl = (
        predict_ddp_step(params, flops, 64, 4, LINKS[k], overlap=False) for k in ("PCIe", "NVLink")
    )
    assert pcie.comm > nvl.comm > 0 and pcie.compute == nvl.compute
    assert predict_ddp_step(params, flops, 64, 1, LINKS["PCIe"]).comm == 0
    tau = young_daly_interval(60, 8 * 3600)
    # the optimum: overhead is lowest there
    # (negative control: half or twice the interval costs more)
    assert checkpoint_overhead(tau, 60, 8 * 3600) < min(
        checkpoint_overhead(tau / 2, 60, 8 * 3600), checkpoint_overhead(2 * tau, 60, 8 * 3600)
    )
    assert first_fitting_stage(70e9, 8, 20e9) == "model parallel"
    assert first_fitting_stage(1e8, 8, 1e9) == "ddp"


def test_index_topics_are_never_cut_mid_word():
    # each topic cell is the topic's title (or its text when it has none), whole or cut at a
    # clause boundary: "... = per-GPU batch × GPUs " lost the accumulation factor, "communicati"
    # and "data para" were cut mid-word
    nb = nbformat.read(INDEX, as_version=4)
    text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    full = {t.id: (t.title or t.text).rstrip(".") for t in load_topics()}
    seen = 0
    for line in text.splitlines():
        m = re.match(r"^\|\s*(?P<id>[SAKP]\d+)\s*\|(?P<topic>[^|]*)\|", line)
        if not m:
            continue
        cell, want = m["topic"].strip(), full[m["id"]]
        assert want.startswith(cell), (m["id"], cell, want)
        assert cell == want or want[len(cell)] in ";:,(", (m["id"], cell, want[len(cell) :])
        seen += 1
    assert seen == len(full)


def test_ddp_step_defaults_are_fp32_gradients_and_a_sustainable_mfu():
    # autocast keeps parameters, hence gradients, in fp32: DDP all-reduces 4 bytes each unless
    # a compression hook casts them; 40% MFU is about twice what an A100 ResNet-50 input
    # pipeline sustains (a few thousand images/s at 3 x 8.2 GFLOPs)
    params, flops = resnet50_counts()
    link = LINKS["PCIe"]
    got = predict_ddp_step(params, flops, 64, 4, link, overlap=False)
    assert got.comm == pytest.approx(4 * 3 / 4 * 2 * params * link.beta + 6 * link.alpha)
    assert got.compute == pytest.approx(3 * flops * 64 / (312e12 * 0.2))
    images_per_s = 64 / got.compute
    assert 2000 < images_per_s < 4000, images_per_s
    # negative control: fp16 gradients (a compression hook) halve the bytes
    hooked = predict_ddp_step(params, flops, 64, 4, link, overlap=False, grad_bytes=2)
    assert hooked.comm < 0.51 * got.comm + 6 * link.alpha
