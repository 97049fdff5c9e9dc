"""The memory and scaling widgets, without a browser: build them, move a control, and check
that what they display equals labkit.memory.estimate / labkit.measure.scaling."""

from __future__ import annotations

import re

import matplotlib
import pytest

matplotlib.use("Agg")

from labkit.measure.scaling import (  # noqa: E402
    LINKS,
    ScalingRun,
    efficiency,
    extrapolate,
    gpu_hours_per_million,
    load_runs,
    mfu,
    save_runs,
    speedup,
    time_to_accuracy,
)
from labkit.memory.estimate import TrainSetup, estimate  # noqa: E402
from labkit.models import PRESETS, preset  # noqa: E402
from labkit.viz.memory_widget import (  # noqa: E402
    MemoryWidget,
    fmt_gb,
    memory_bars,
    selective_note,
)
from labkit.viz.scaling import (  # noqa: E402
    GPU_PEAK_FLOPS,
    MODEL_MFU,
    ScalingWidget,
    modeled_runs,
    scaling_figure,
)


def _shown_total(w: MemoryWidget) -> str:
    return re.search(r'labkit-mem-total">([^<]*)<', w.total.value).group(1)


def test_memory_widget_shows_the_estimate_and_follows_its_controls():
    w = MemoryWidget("gpt2-1.3b", micro_batch=2)
    cfg = preset("gpt2-1.3b")
    assert _shown_total(w) == fmt_gb(estimate(cfg, TrainSetup(micro_batch=2)).total)
    w.micro_batch.value = 8
    w.zero.value = "zero3"
    w.dp.value = 8
    w.recompute.value = "full"
    want = estimate(cfg, TrainSetup(micro_batch=8, dp=8, zero="zero3", recompute="full"))
    assert w.estimate() == want
    assert _shown_total(w) == fmt_gb(want.total)
    for cat, v in want.by_category().items():  # the table holds every category's number
        assert (
            f"<td>{cat.replace('_', ' ')}</td><td style='text-align:right'>{fmt_gb(v)}</td>"
            in w.table.value
        )
    w.capacity.value = "24 GB"
    assert ("does not fit" in w.message.value) == (want.total > 24e9)
    w.capacity.value = "custom"
    w.custom_gb.value = want.total / 1e9 + 1
    assert "fits:" in w.message.value and "1.00 GB to spare" in w.message.value
    w.offload.value = True
    assert "CPU memory" in w.message.value
    assert w.estimate().optimizer_state == 0


def test_memory_widget_preset_custom_shape_and_bad_split():
    w = MemoryWidget("gpt2")
    w.preset.value = "gpt2-xl"
    assert w.config() == PRESETS["gpt2-xl"] and w.layers.value == 48
    w.layers.value = 10  # a custom shape
    assert w.preset.value == "custom" and w.config().n_layer == 10
    assert _shown_total(w) == fmt_gb(estimate(PRESETS["gpt2-xl"].with_(n_layer=10)).total)
    w.tp.value = 16  # 25 heads do not split 16 ways: the widget says so instead of raising
    assert "not divisible" in w.message.value and _shown_total(w) == "-"


def test_memory_widget_error_leaves_no_stale_numbers():
    """heads=12 with tp=8: the message says what is wrong, and the table and chart of the
    previous setting are gone (they would read as this setting's); fixing it brings them back."""
    w = MemoryWidget("gpt2-1.3b", micro_batch=1)
    cleared: list[dict] = []  # the chart's Output only captures inside a kernel: watch it
    w.plot.clear_output = lambda **kw: cleared.append(kw)  # type: ignore[method-assign]
    assert "<table" in w.table.value
    w.tp.value = 8
    cleared.clear()
    w.heads.value = 12
    assert "cannot estimate" in w.message.value and "12" in w.message.value
    assert w.table.value == "" and _shown_total(w) == "-"
    assert cleared == [{}]  # cleared now, not "when the next output arrives" (wait=True)
    w.heads.value = 16
    assert "<table" in w.table.value and cleared[-1] == {"wait": True}  # redrawn
    assert _shown_total(w) == fmt_gb(w.estimate().total)


def test_memory_widget_says_why_selective_changes_nothing_under_sdpa():
    w = MemoryWidget("gpt2-1.3b", micro_batch=1)
    assert w.config().attention == "sdpa"
    none_total = w.estimate().total
    w.recompute.value = "selective"
    assert w.estimate().total == none_total  # the fact the note explains
    assert "SDPA" in w.message.value and "changes nothing" in w.message.value
    w.recompute.value = "full"
    assert "changes nothing" not in w.message.value
    # explicit attention stores the core: selective saves, and no note claims otherwise
    cfg = w.config().with_(attention="explicit")
    assert selective_note(cfg, TrainSetup(recompute="selective")) == ""
    assert estimate(cfg, TrainSetup(recompute="selective")).total < estimate(cfg).total


def test_memory_widget_labels_are_not_cut_off():
    w = MemoryWidget("gpt2")
    for control in (w.capacity, w.recompute, w.micro_batch, w.custom_gb):
        assert control.style.description_width == "initial", control.description


def test_planner_widget_says_why_no_layout_exists():
    from labkit.viz.planner import PlannerWidget

    w = PlannerWidget(billions=100, nodes=3)  # 24 GPUs: no even split of 80 heads/layers, 512
    assert w.preds == []
    text = w.table.value
    assert "0 of 0" not in text and "24 GPUs" in text and "global batch of 512" in text
    assert "[3, 6, 12, 24]" in text  # the dp values left, none dividing 512
    w.nodes.value = 4
    assert w.preds and "layouts fit" in w.table.value
    w.nodes.value, w.memory.value = 1, 16  # candidates, none fits: the smallest is named
    assert "none fits: the smallest layout needs" in w.table.value


def test_pipeline_timeline_has_a_legend():
    from labkit.pipeline import Costs, make_schedule, simulate
    from labkit.viz.pipeline import draw_timeline

    for name, kinds in (
        ("1f1b", {"F: forward", "B: backward"}),
        ("zb-h1", {"F: forward", "B: backward (input grad)", "W: weight grad"}),
    ):
        res = simulate(make_schedule(name, 2, 4), Costs(1, 1, 1))
        fig = draw_timeline(res.timeline, name)
        legend = fig.axes[0].get_legend()
        assert legend is not None, name
        labels = {t.get_text() for t in legend.get_texts()}
        assert labels == kinds | {"gap: bubble (idle)"}, labels


def test_memory_widget_measured_bars_and_figure():
    measured = {"measured": {"parameters": 1e9, "activations": 2e9}}
    w = MemoryWidget("gpt2", measured=measured)
    assert w.measured == measured
    fig = memory_bars({"a": {"parameters": 3e9, "gradients": 1e9}, **measured}, capacity=8e9)
    heights = sorted(round(p.get_height(), 6) for p in fig.axes[0].patches if p.get_height())
    assert heights == [1.0, 1.0, 2.0, 3.0]


RUNS = [
    ScalingRun(1, 1.0, 8, "weak"),
    ScalingRun(2, 1.25, 16, "weak"),
    ScalingRun(4, 2.0, 32, "weak"),
]


def test_scaling_arithmetic():
    assert speedup(RUNS) == {1: 1.0, 2: 1.6, 4: 2.0}
    assert efficiency(RUNS) == {1: 1.0, 2: 0.8, 4: 0.5}
    strong = [ScalingRun(1, 1.0, 8), ScalingRun(2, 0.625, 8)]
    assert efficiency(strong) == {1: 1.0, 2: 0.8}
    assert mfu(1000.0, 6e9, 1e13) == pytest.approx(0.6)
    assert gpu_hours_per_million(1e6 / 3600, 4) == pytest.approx(4.0)
    assert time_to_accuracy([(1.0, 0.5), (2.0, 0.91), (3.0, 0.95)], 0.9) == 2.0
    assert time_to_accuracy([(1.0, 0.5)], 0.9) is None
    with pytest.raises(ValueError, match="no 1-rank run"):
        speedup(RUNS[1:])
    with pytest.raises(ValueError, match="mix of scaling modes"):
        speedup(RUNS + strong)


def test_extrapolation_is_the_alpha_beta_ring():
    link = LINKS["InfiniBand NDR (50 GB/s)"]
    pred = extrapolate(RUNS[0], 1e9, link, (8, 1024))
    a, b = link
    assert pred[0].step_time == pytest.approx(1.0 + 2 * 7 * a + 2 * 7 / 8 * 1e9 * b)
    assert pred[1].global_batch == 8 * 1024
    strong = extrapolate(ScalingRun(1, 1.0, 8), 1e9, link, (8,))
    assert strong[0].step_time == pytest.approx(1.0 / 8 + 2 * 7 * a + 2 * 7 / 8 * 1e9 * b)


def test_scaling_widget_follows_its_controls(tmp_path):
    save_runs(RUNS, tmp_path / "runs.json")
    runs = load_runs(tmp_path / "runs.json")
    assert runs == RUNS
    w = ScalingWidget(runs, model="gpt2", link="NVLink 4 (450 GB/s)")

    def shown() -> str:
        return re.search(r'labkit-scaling-eff">([^<]*)<', w.summary.value).group(1)

    def want(model: str, link: str, n: int) -> str:
        pred = modeled_runs(RUNS[0], PRESETS[model], LINKS[link], [n])
        return f"{100 * efficiency(pred)[n]:.1f}%"

    assert shown() == want("gpt2", "NVLink 4 (450 GB/s)", 1024)
    w.link.value = "Ethernet 10 Gb/s (1.25 GB/s)"
    w.model.value = "gpt2-1.3b"
    w.max_ranks.value = 64
    assert shown() == want("gpt2-1.3b", "Ethernet 10 Gb/s (1.25 GB/s)", 64)
    assert shown() != want("gpt2", "NVLink 4 (450 GB/s)", 64)  # the control did change it
    fig = scaling_figure(RUNS, w.predicted())
    assert len(fig.axes) == 3
    legend = fig.axes[2].get_legend()
    assert legend is not None
    labels = {t.get_text() for t in legend.get_texts()}
    assert {"measured", "modeled"} <= labels  # measured and modeled are named apart


def test_scaling_model_scales_compute_with_the_model():
    """The issue's case: a 536k-parameter CPU step must not be the compute of 1.3B's step.
    The modeled 1-GPU step is 6 N T / (peak x MFU), and efficiency is modeled against it."""
    proxy = ScalingRun(1, 0.05, 4, "weak")  # a tiny CPU proxy's 50 ms step, 4 sequences
    cfg = PRESETS["gpt2-1.3b"]
    link = LINKS["InfiniBand NDR (50 GB/s)"]
    runs = modeled_runs(proxy, cfg, link, [1024])
    one, big = runs
    assert one.ranks == 1 and one.label == "modeled"
    assert one.step_time == pytest.approx(
        6 * cfg.num_params() * 4 * cfg.block_size / (GPU_PEAK_FLOPS * MODEL_MFU)
    )
    a, b = link
    comm = 2 * 1023 * a + 2 * 1023 / 1024 * cfg.num_params() * 2 * b
    assert big.step_time == pytest.approx(one.step_time + comm)
    eff = efficiency(runs)[1024]
    # negative control: the proxy's CPU step plus 1.3B's all-reduce (the old widget) is far off
    old = efficiency([proxy] + extrapolate(proxy, cfg.num_params() * 2, link, [1024]))[1024]
    assert old < 0.35 < 0.7 < eff
    w = ScalingWidget([proxy, ScalingRun(2, 0.11, 8, "weak")], model="gpt2-1.3b")
    assert f"{100 * eff:.1f}%" in w.summary.value and f"{100 * old:.1f}%" not in w.summary.value
    assert "measured" in w.summary.value and "modeled" in w.summary.value
    with pytest.raises(ValueError, match="1-rank"):
        modeled_runs(ScalingRun(2, 0.1, 8, "weak"), cfg, link)
    with pytest.raises(ValueError, match="mfu"):
        modeled_runs(proxy, cfg, link, mfu=1.5)


def test_progress_prints_whole_lines_on_rank0_only(capsys):
    from labkit.progress import progress

    assert list(progress(range(3), desc="work", rank=0, mininterval=0)) == [0, 1, 2]
    out = capsys.readouterr().out
    assert "work" in out and "3/3" in out and "\r" not in out  # whole lines, for pipes
    assert list(progress(range(3), desc="quiet", rank=1)) == [0, 1, 2]
    assert "quiet" not in capsys.readouterr().out  # other ranks draw nothing
