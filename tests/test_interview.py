"""Interview rehearsal: every topic id is rehearsed, indexed and quizzed; the checks grade."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import nbformat
import pytest

from labkit.checks.core import CheckFailed
from labkit.checks.interview import ask, check, feedback, is_right, quiz
from labkit.interview.estimates import (
    LINKS,
    checkpoint_overhead,
    first_fitting_stage,
    predict_ddp_step,
    resnet50_counts,
    young_daly_interval,
)
from labkit.interview.quiz import BANK_PATH, QUESTIONS, load_questions, questions_for
from labkit.interview.topics import TOPICS_PATH, load_topics, topic_ids

ROOT = Path(__file__).resolve().parent.parent
INDEX = ROOT / "notebooks" / "14_interview_index.ipynb"
# JupyterLab opens a notebook at a section by "#heading=<anchor>" (plain "#<anchor>" too)
LINK = re.compile(r"\]\((?P<nb>[\w./-]+\.ipynb)#(?:heading=)?(?P<anchor>[\w.-]+)\)")


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
        moves = [q for q in qs if q.kind]  # a scenario's clarify, trade-off and fallback
        assert 2 <= len(qs) - len(moves) <= 4, (tid, len(qs))
        for q in qs:
            for seed in range(5):
                value = q.draw(seed).expected
                if q.choices:
                    assert value in q.choices, (q.qid, seed, value)


def test_the_bank_is_a_data_file_and_every_question_has_what_it_needs(tmp_path):
    assert BANK_PATH.suffix == ".json" and BANK_PATH.is_relative_to(ROOT / "labkit")
    assert load_questions() == QUESTIONS
    for q in QUESTIONS.values():
        assert q.prompt and q.hint and q.look and q.why, q.qid
        d = q.draw(0)
        assert "{" not in d.text, (q.qid, d.text)  # every placeholder is drawn
        for expression, hint in q.mistakes:
            d.evaluate(expression)
            hint.format(**d.values)
        if q.choices is None:  # a number: it comes from the drawn parameters, not a constant
            assert q.params, f"{q.qid}: a numeric answer with nothing drawn can be copied"
            assert any(k in q.solution for k in q.params), q.qid
    # negative control: a question without a hint is refused, naming it
    raw = json.loads(BANK_PATH.read_text())
    del next(q for q in raw["questions"] if q["id"] == "S2.2")["hint"]
    broken = tmp_path / "bank.json"
    broken.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"S2\.2.*hint"):
        load_questions(broken)


def test_no_question_is_a_coin_flip_unless_it_asks_why():
    for q in QUESTIONS.values():
        if q.choices is not None:
            assert len(q.choices) >= 3 or "why" in q.prompt.lower(), (q.qid, q.choices)
            assert len(set(q.choices)) == len(q.choices), q.qid


def _wrong(d):
    q, right = d.question, d.expected
    if q.choices:
        return next(c for c in q.choices if c != right)
    return right * 1.5 + 1


@pytest.mark.parametrize("qid", list(QUESTIONS))
def test_check_accepts_the_right_answer_and_rejects_a_wrong_one(qid, capsys):
    d = QUESTIONS[qid].draw(7)
    check(d, d.expected)
    assert "PASSED" in capsys.readouterr().out
    assert not is_right(d, _wrong(d))
    with pytest.raises(CheckFailed, match="Look at"):
        check(d, _wrong(d))


_NUMBER = re.compile(r"(?<![\w.§])[-+]?\d[\d_,]*\.?\d*(?:[eE][-+]?\d+)?(?![\d%]|\.\d)")


def _leaks(message: str, d, answer) -> bool:
    """Does ``message`` state the expected value? Numbers the learner already has (the prompt's
    and the answer's own) do not count."""
    want = float(d.expected)
    known = {float(x.replace(",", "").replace("_", "")) for x in _NUMBER.findall(d.text)}
    known.add(float(answer))
    for tok in _NUMBER.findall(message):
        x = float(tok.replace(",", "").replace("_", "").rstrip("."))
        if x not in known and math.isclose(x, want, rel_tol=0.01):
            return True
    return False


def test_a_wrong_answer_gets_a_hint_never_the_expected_value():
    numeric = [q for q in QUESTIONS.values() if q.choices is None]
    for q in numeric:
        for seed in range(3):
            d = q.draw(seed)
            wrong = _wrong(d)
            message = feedback(d, wrong)
            assert not _leaks(message, d, wrong), (q.qid, seed, message)
            assert "Look at" in message and ("Hint:" in message or q.mistakes), message
    # negative control: a grader that states the answer (as this one did) is caught
    d = QUESTIONS["S2.1"].draw(0)
    leaky = f"S2.1: expected {d.expected:.4g} (within 2%), got 1.0. Why: ..."
    assert _leaks(leaky, d, 1.0)


def test_a_common_mistake_is_named():
    d = QUESTIONS["S2.1"].draw(3)
    fp16 = d.evaluate("ring(resnet50_counts()[0] * 2, p, LINKS[link].alpha, LINKS[link].beta)")
    with pytest.raises(CheckFailed, match="2 bytes per gradient"):
        check(d, fp16)
    with pytest.raises(CheckFailed, match="too high"):
        check(d, d.expected * 3)


def test_a_wrong_rung_of_the_ladder_is_told_which_way():
    q = QUESTIONS["S7.2"]
    d = next(q.draw(s) for s in range(50) if q.draw(s).expected in ("zero1", "zero2", "zero3"))
    with pytest.raises(CheckFailed, match="does not fit: climb higher"):
        check(d, "ddp")
    with pytest.raises(CheckFailed, match="take the first that fits"):
        check(d, "model parallel")
    # at the ends a direction would name the one rung left that way: none is given
    a32 = QUESTIONS["A3.2"]
    top = next(a32.draw(s) for s in range(50) if a32.draw(s).expected == "model parallel")
    with pytest.raises(CheckFailed, match="Re-check each rung") as wrong:
        check(top, "zero3 + recompute + offload")
    assert "climb higher" not in str(wrong.value)
    ddp = next(q.draw(s) for s in range(50) if q.draw(s).expected == "ddp")
    with pytest.raises(CheckFailed, match="Re-check each rung") as wrong:
        check(ddp, "zero1")
    assert "cheaper one below" not in str(wrong.value)


def test_tolerance_accepts_within_and_rejects_outside():
    d = QUESTIONS["S2.1"].draw(0)
    tol, want = d.question.rel_tol, d.expected
    assert tol == 0.02
    assert is_right(d, want * (1 + tol / 2)) and is_right(d, want * (1 - tol / 2))
    assert not is_right(d, want * (1 + 2 * tol)) and not is_right(d, want * (1 - 2 * tol))
    count = QUESTIONS["S8.1"].draw(0)  # whole workers: exact
    assert count.question.rel_tol == 0 and is_right(count, count.expected)
    assert not is_right(count, count.expected + 1)


def test_two_seeds_draw_different_numbers_each_graded_against_its_own():
    for q in QUESTIONS.values():
        if not q.params:
            continue
        draws = [q.draw(s) for s in range(40)]
        assert len({tuple(sorted(d.values.items())) for d in draws}) >= 2, q.qid
        assert q.draw(5).values == q.draw(5).values  # the same seed, the same numbers
    q = QUESTIONS["S1.1"]
    a = q.draw(1)
    b = next(q.draw(s) for s in range(2, 50) if q.draw(s).expected != a.expected)
    assert a.values != b.values and a.text != b.text
    assert is_right(a, a.expected) and is_right(b, b.expected)
    # negative control: an answer copied from another attempt fails
    assert not is_right(b, a.expected) and not is_right(a, b.expected)


def test_check_explains_bad_input(capsys):
    d = ask("S7.2", seed=0)
    assert "Choose one of" in capsys.readouterr().out
    with pytest.raises(CheckFailed, match="not one of the choices"):
        check(d, "fsdp-ish")
    check(d, "abcde"[list(d.question.choices).index(d.expected)])  # a choice's letter
    with pytest.raises(CheckFailed, match="must be a number"):
        check(ask("S1.1", seed=0), "a lot")
    with pytest.raises(TypeError, match="the question ask"):
        check("S1.1", 128)
    with pytest.raises(ValueError, match="no question"):
        ask("Z9.9")
    with pytest.raises(AttributeError, match="draws"):
        _ = d.nonsense


def test_quiz_prints_each_question_once_and_returns_nothing(capsys):
    # notebook 13 printed each quiz twice: the questions, then the returned list's repr
    assert quiz("S3", seed=4) is None
    out = capsys.readouterr().out
    assert out.count("S3.1:") == 1 and out.count("S3.2:") == 1 and "[" not in out


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


WALKTHROUGHS = ROOT / "notebooks" / "13_interview_walkthroughs.ipynb"
STRONG = ("**Question", "**Clarify", "**Estimate", "**Choice", "**Say", "**Monitor", "**Fallback")


def test_every_id_has_a_strong_walkthrough_skeleton_and_a_quiz():
    # "strong" (issue 22): question, clarifying questions, an estimate computed by code, the
    # choice, a 60-second answer, monitoring and fallback, a checked quiz; the markdown names
    # each part and a code cell of the section computes and quizzes
    sections: dict[str, list] = {}
    current = None
    for cell in nbformat.read(WALKTHROUGHS, as_version=4).cells:
        if cell.cell_type == "markdown" and cell.source.startswith("## "):
            m = re.match(r"## ([SAKP]\d+)\b", cell.source)
            current = m.group(1) if m else None
        if current:
            sections.setdefault(current, []).append(cell)
    assert sorted(sections) == sorted(topic_ids())
    for tid, cells in sections.items():
        text = "\n".join(c.source for c in cells if c.cell_type == "markdown")
        code = "\n".join(c.source for c in cells if c.cell_type == "code")
        missing = [m for m in STRONG if m not in text]
        assert not missing, f"13 §{tid} lacks {missing}"
        assert f'quiz("{tid}")' in code, f"13 §{tid} has no quiz"
        assert "print(" in code, f"13 §{tid} computes nothing"


def test_the_ids_beyond_the_cards_are_marked_and_point_at_their_notebooks():
    beyond = {t.id: t for t in load_topics() if "beyond the original cards" in t.title}
    assert {"K13", "K14", "K16"} <= set(beyond)
    assert "15_long_context.ipynb" in beyond["K13"].text
    assert "16_experts.ipynb" in beyond["K14"].text
    assert "18_fp8_and_overlap.ipynb" in beyond["K16"].text


def test_time_to_train_and_hsdp_are_the_stated_arithmetic():
    from labkit.collectives.cost_model import AlphaBeta
    from labkit.interview.estimates import GPU_PEAK_FLOPS, hsdp_vs_fsdp, time_to_train

    b = time_to_train(2e9, 1e11, 64, mfu=0.5, price_per_gpu_hour=3.0)
    seconds = 6 * 2e9 * 1e11 / (64 * GPU_PEAK_FLOPS * 0.5)
    assert b.flops == 6 * 2e9 * 1e11 and b.seconds == pytest.approx(seconds)
    assert b.gpu_hours == pytest.approx(seconds * 64 / 3600) and b.cost == pytest.approx(
        3 * b.gpu_hours
    )
    assert time_to_train(2e9, 1e11, 64, recompute="full").flops == 8 * 2e9 * 1e11
    from labkit.hardware import value

    assert time_to_train(2e9, 1e11, 64).price_per_gpu_hour == value("assume.price_per_gpu_hour")
    with pytest.raises(ValueError, match="mfu"):
        time_to_train(2e9, 1e11, 64, mfu=0)
    d = 2 * 2e9
    h = hsdp_vs_fsdp(2e9, 8, 8, LINKS["NVLink"], LINKS["InfiniBand"])
    assert h["hsdp"]["uplink_bytes"] == pytest.approx(2 * 7 / 8 * d)
    assert h["fsdp"]["uplink_bytes"] == pytest.approx(3 * 63 / 64 * d)
    assert h["hsdp"]["states"] == pytest.approx(8 * h["fsdp"]["states"])  # 8-way, not 64-way
    assert h["hsdp"]["seconds"] < h["fsdp"]["seconds"]
    one = hsdp_vs_fsdp(2e9, 1, 8, LINKS["NVLink"], LINKS["InfiniBand"])  # one node: the same
    assert one["hsdp"]["seconds"] == pytest.approx(one["fsdp"]["seconds"])
    # per-unit collectives (A2): only latency changes with the unit count, bytes do not
    free = {k: AlphaBeta(0.0, v.beta) for k, v in LINKS.items()}
    whole = hsdp_vs_fsdp(2e9, 8, 8, free["NVLink"], free["InfiniBand"], nics_per_node=8)
    split = hsdp_vs_fsdp(2e9, 8, 8, free["NVLink"], free["InfiniBand"], nics_per_node=8, units=24)
    for name in ("fsdp", "hsdp"):
        assert split[name]["seconds"] == pytest.approx(whole[name]["seconds"])
    args = (2e9, 8, 8, LINKS["NVLink"], LINKS["InfiniBand"])
    rail1 = hsdp_vs_fsdp(*args, nics_per_node=8)
    rail24 = hsdp_vs_fsdp(*args, nics_per_node=8, units=24)
    # FSDP's 63-GPU rings pay 63 latencies per unit, HSDP's pay 7: per layer, HSDP wins on
    # 8 NICs a node; the whole-model pricing (units=1) says the opposite (the negative control)
    assert rail24["hsdp"]["seconds"] < rail24["fsdp"]["seconds"]
    assert rail1["fsdp"]["seconds"] < rail1["hsdp"]["seconds"]
    assert rail24["fsdp"]["seconds"] - rail1["fsdp"]["seconds"] > (
        rail24["hsdp"]["seconds"] - rail1["hsdp"]["seconds"]
    )


def test_long_context_and_moe_formulas():
    from labkit.interview.beyond import attention_activation_bytes, moe_counts

    s, h, a = 4096, 1024, 16
    assert attention_activation_bytes(s, h, a) == s * h * (34 + 5 * a * s / h)
    assert attention_activation_bytes(s, h, a, fused=True) == 34 * s * h
    assert attention_activation_bytes(s, h, a, fused=True, cp=4) == 34 * s * h / 4
    with pytest.raises(ValueError, match="cp"):
        attention_activation_bytes(s, h, a, cp=3)
    dense = moe_counts(24, 1024, 1, 1)
    assert dense.total_params == dense.active_params
    moe = moe_counts(24, 1024, 8, 2)
    mlp = 8 * 1024 * 1024 * 24
    assert moe.total_params - dense.total_params == pytest.approx(7 * mlp + 24 * 1024 * 8)
    assert moe.active_params - dense.active_params == pytest.approx(mlp + 24 * 1024 * 8)
    assert moe.train_flops(1e9) == 6 * moe.active_params * 1e9


def test_fp8_is_beyond_the_cards_and_its_arithmetic_is_the_formats():
    import math

    from labkit.interview.beyond import fp8_range_bits, fp8_step_seconds

    beyond = {t.id: t for t in load_topics() if "beyond the original cards" in t.title}
    assert "K15" in beyond and "18_fp8_and_overlap.ipynb" in beyond["K15"].text
    assert fp8_range_bits("e4m3") == pytest.approx(math.log2(448 / 2**-9))
    assert fp8_range_bits("e5m2", subnormals=False) == pytest.approx(math.log2(57344 / 2**-14))
    assert fp8_step_seconds(1.0, 0.6) == pytest.approx(0.7)  # only the GEMMs halve (Amdahl)
    with pytest.raises(ValueError, match="fmt='bf16'"):
        fp8_range_bits("bf16")
    with pytest.raises(ValueError, match="gemm=2"):
        fp8_step_seconds(1.0, 2)


def test_scaling_efficiency_draws_are_possible():
    import dataclasses
    import itertools

    from labkit.interview.estimates import strong_efficiency

    for qid in ("K9.1", "K9.2"):
        q = QUESTIONS[qid]
        names = list(q.params)
        for combo in itertools.product(*(q.params[n] for n in names)):
            d = dataclasses.replace(q.draw(0), values=dict(zip(names, combo, strict=True)))
            assert 0 < d.expected <= 1, (qid, d.values, d.expected)
    # negative control: the old draw (12 s on 1 GPU, 2.5 s on 4) claimed 120%
    assert strong_efficiency(12, 2.5, 4) > 1
