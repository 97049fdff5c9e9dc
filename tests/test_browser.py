"""The widgets in a real browser: the project's own ``./lab`` serves JupyterLab, headless
Chromium (Debian's package, driven by Playwright) opens a notebook with both widgets, runs
it, moves a slider of each, and checks that the displayed number becomes what
:func:`labkit.memory.estimate.estimate` / :func:`labkit.viz.scaling.modeled_runs` give for
the new setting. A screenshot is saved under ``.labkit/browser-test/``.

The same notebook then draws with each idiom the lessons 06-12 use (``fig = plot(...)``,
``plot(...);``, ``draw(...); plt.show()``, two figures in one cell), and the test counts the
images each cell shows in the page: every drawing cell shows each of its figures exactly
once (a negative-control cell that ends with a bare figure shows it twice, and is seen to).

Needs ``playwright`` (the Python package; no browser download) and a Chromium binary
(``apt-get install chromium``; or ``LABKIT_CHROMIUM=/path``). Without them the test skips and
says why, except under CI (``CI=true``), where ``.ci/run`` installs them and the test is
required.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / ".labkit" / "browser-test"  # .labkit/ is git-ignored
NOTEBOOK = WORK / "widgets.ipynb"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
START_BATCH = 2
SCALING_RUNS = "[ScalingRun(1, 1.0, 8, 'weak'), ScalingRun(2, 1.25, 16, 'weak')]"
WIDGET_CELLS = [
    "from labkit.viz.memory_widget import MemoryWidget\n"
    f"MemoryWidget('gpt2-1.3b', micro_batch={START_BATCH}, capacity='80 GB')",
    "from labkit.measure.scaling import ScalingRun\n"
    "from labkit.viz.scaling import ScalingWidget\n"
    f"ScalingWidget({SCALING_RUNS}, model='gpt2-1.3b', link='InfiniBand NDR (50 GB/s)')",
]
# (lesson, cell, images it must show): each lesson's drawing idioms, on small data
FIGURE_CELLS = [
    (
        "setup",
        "import matplotlib.pyplot as plt\nfrom labkit.pipeline import Costs, "
        "make_schedule, simulate\nres = simulate(make_schedule('1f1b', 2, 4), Costs(1, 1, 1))",
        0,
    ),
    (
        "06",
        "from labkit.viz.tp import activation_bars\n"
        "activation_bars({'none': 100, 'TP t=2': 60}, {'none': 100.0, 'TP t=2': 61.0});",
        1,
    ),
    (
        "06",
        "from labkit.viz.tp import comm_vs_compute\n"
        "fig = comm_vs_compute([2, 4], {'link': [(1e-3, 2e-3), (5e-4, 3e-3)]})",
        1,
    ),
    (
        "07",
        "from labkit.viz.pipeline import draw_timeline\n"
        "draw_timeline(res.timeline, '1f1b p=2 m=4'); plt.show()",
        1,
    ),
    (
        "07",
        "draw_timeline(res.timeline, 'simulated'); plt.show()\n"
        "fig, (a, b) = plt.subplots(2, 1)\ndraw_timeline(res.timeline, 'measured', ax=a)\n"
        "draw_timeline(res.timeline, 'at measured costs', ax=b)\nplt.show()\n"
        "tl, sim = res.timeline, res",
        2,
    ),
    (
        "08",
        "from labkit.parallel import ParallelDegrees\nfrom labkit.viz.layout import draw_layout\n"
        "fig = draw_layout(ParallelDegrees(dp=2, tp=2, pp=2), gpus_per_node=4)",
        1,
    ),
    (
        "09",
        "from labkit.viz.cluster import plot_busbw_vs_size, plot_step_breakdown\n"
        "fig = plot_busbw_vs_size({'ring': {4096: 1e6, 32768: 5e6}})",
        1,
    ),
    ("09", "fig = plot_step_breakdown({'ring': {'step': 0.05, 'exposed_comm': 0.01}})", 1),
    (
        "10",
        "from labkit.viz.mixed_links import plot_miniature, plot_slow_link_scan\n"
        "rows = [{'inter_bandwidth': b, 'tp_comm': 0.1, 'pp_comm': 0.2, 'dp_comm': 1 / b * 1e9,"
        " 'step': 2.0} for b in (1e9, 4e9)]\nfig = plot_slow_link_scan(rows, title='scan')",
        1,
    ),
    ("10", "fig = plot_miniature([{'layout': 'a', 'measured': 1.0, 'predicted': 0.8}])", 1),
    (
        "12",
        "from labkit.viz.profiling import plot_scaling\n"
        "fig = plot_scaling([1, 2], {'m': [1.0, 0.6]})",
        1,
    ),
    ("control", "comm_vs_compute([2], {'l': [(1.0, 1.0)]})", 2),  # a bare figure: twice
    ("end", "print('figures done')", 0),
]
CELLS = WIDGET_CELLS + [src for _, src, _ in FIGURE_CELLS]


def _chromium() -> str | None:
    for cand in (os.environ.get("LABKIT_CHROMIUM"), "chromium", "chromium-browser"):
        if cand and shutil.which(cand):
            return shutil.which(cand)
    return None


def _requirements() -> str | None:
    """Why the test cannot run here, or None."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is not installed (pip install playwright)"
    if _chromium() is None:
        return "no chromium binary (apt-get install chromium, or set LABKIT_CHROMIUM)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_notebook() -> None:
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {
        "display_name": "Python 3",
        "language": "python",
        "name": "python3",
    }
    nb.cells = [nbformat.v4.new_code_cell(src) for src in CELLS]
    # 14 opened in the app, without reloading the page (_check_index_link copies it here)
    nb.cells.append(nbformat.v4.new_markdown_cell(f"[the interview index]({Path(INDEX).name})"))
    WORK.mkdir(parents=True, exist_ok=True)
    # a fresh workspace: a restored one reopens the last run's tabs, and Run All would run
    # whichever of them is in front
    shutil.rmtree(WORK / "workspaces", ignore_errors=True)
    nbformat.write(nb, NOTEBOOK)


def _start_lab(port: int, token: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JUPYTER_RUNTIME_DIR": str(WORK / "runtime")}
    args = [
        str(ROOT / "lab"),
        "--no-browser",
        f"--port={port}",
        "--ServerApp.port_retries=0",
        "--ServerApp.ip=127.0.0.1",
        f"--IdentityProvider.token={token}",
        f"--LabApp.workspaces_dir={WORK / 'workspaces'}",
        "--ContentsManager.allow_hidden=True",  # .labkit/ is a hidden directory
    ]
    log = open(WORK / "lab.log", "w")  # noqa: SIM115  (closed with the process)
    return subprocess.Popen(
        args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def _wait_for_server(proc: subprocess.Popen, port: int, token: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    url = f"http://127.0.0.1:{port}/api/status?token={token}"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"./lab exited with {proc.returncode}: {(WORK / 'lab.log').read_text()[-2000:]}"
            )
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                json.load(r)
                return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"JupyterLab did not answer on port {port} within {timeout} s")


def _accept_kernel_dialog(page, wait_ms: int = 3000) -> None:
    """Accept a "Select Kernel" dialog if one shows (autoStartDefaultKernel does not always
    prevent it): its default choice is the project's kernel."""
    dialog = page.locator(".jp-Dialog .jp-mod-accept")
    try:
        dialog.wait_for(state="visible", timeout=wait_ms)
    except Exception:  # no dialog: nothing to do
        return
    dialog.click()


def _text(page, selector: str, timeout: float = 90_000) -> str:
    """The text of ``selector`` once it is shown with a real value (not the '-' placeholder)."""
    page.wait_for_function(
        "s => { const e = document.querySelector(s);"
        " return e && e.textContent && e.textContent !== '-'; }",
        arg=selector,
        timeout=timeout,
    )
    return page.locator(selector).first.inner_text()


def test_widgets_in_a_real_browser(capsys):
    why = _requirements()
    if why:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI requires the browser test, but {why}")
        print(f"skipping the real-browser test: {why}")
        pytest.skip(why)
    from playwright.sync_api import sync_playwright

    from labkit.measure.scaling import LINKS, ScalingRun, efficiency
    from labkit.memory.estimate import TrainSetup, estimate
    from labkit.models import preset
    from labkit.viz.memory_widget import fmt_gb
    from labkit.viz.scaling import modeled_runs

    cfg = preset("gpt2-1.3b")
    t0 = time.monotonic()
    _write_notebook()
    port, token = _free_port(), secrets.token_hex(16)
    proc = _start_lab(port, token)
    try:
        _wait_for_server(proc, port, token)
        with sync_playwright() as pw:
            ctx = pw.chromium.launch_persistent_context(
                str(WORK / "profile"),
                executable_path=_chromium(),
                headless=True,
                args=CHROMIUM_FLAGS,
                viewport={"width": 1400, "height": 1600},
            )
            page = ctx.new_page()
            try:
                rel = NOTEBOOK.relative_to(ROOT).as_posix()
                page.goto(f"http://127.0.0.1:{port}/lab/tree/{rel}?token={token}", timeout=90_000)
                page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=90_000)
                # Run > Run All Cells, once the kernel is up (autoStartDefaultKernel)
                page.wait_for_selector(
                    ".jp-NotebookPanel .jp-Notebook-ExecutionIndicator[data-status='idle']",
                    timeout=90_000,
                )
                _accept_kernel_dialog(page)
                page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
                page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
                _accept_kernel_dialog(page)

                # 1. the memory widget: its total is the estimate's, before and after the slider
                shown = _text(page, ".labkit-mem-total")
                assert shown == fmt_gb(estimate(cfg, TrainSetup(micro_batch=START_BATCH)).total)
                slider = page.locator(".labkit-memory-widget .widget-slider").first
                slider.locator(".noUi-handle").focus()
                for _ in range(2):
                    page.keyboard.press("ArrowRight")
                new_batch = int(slider.locator(".widget-readout").inner_text())
                assert new_batch == START_BATCH + 2
                want = fmt_gb(estimate(cfg, TrainSetup(micro_batch=new_batch)).total)
                page.wait_for_function(
                    "w => document.querySelector('.labkit-mem-total').textContent === w",
                    arg=want,
                    timeout=30_000,
                )
                assert want != shown

                # 2. the scaling widget: the modeled efficiency follows the slider
                runs = [ScalingRun(1, 1.0, 8, "weak"), ScalingRun(2, 1.25, 16, "weak")]
                link = LINKS["InfiniBand NDR (50 GB/s)"]

                def eff_at(n: int) -> str:
                    pred = modeled_runs(runs[0], cfg, link, [n])
                    return f"{100 * efficiency(pred)[n]:.1f}%"

                assert _text(page, ".labkit-scaling-eff") == eff_at(1024)
                ranks = page.locator(".labkit-scaling-widget .widget-slider").first
                ranks.locator(".noUi-handle").focus()
                page.keyboard.press("ArrowLeft")
                n = int(ranks.locator(".widget-readout").inner_text())
                assert n == 512
                page.wait_for_function(
                    "w => document.querySelector('.labkit-scaling-eff').textContent === w",
                    arg=eff_at(n),
                    timeout=30_000,
                )
                page.screenshot(path=str(WORK / "widgets.png"), full_page=True)

                # 3. every drawing idiom of the lessons shows each figure once
                _check_figures(page)

                # 4. 14 -> 13: with 13 open, an id's link scrolls 13 to that id's section
                t_link = time.monotonic()
                link_error = _check_index_link(page)
                t_link = time.monotonic() - t_link
            except Exception:
                page.screenshot(path=str(WORK / "failure.png"), full_page=True)
                print(f"browser test failed; the page is in {WORK / 'failure.png'}")
                raise
            finally:
                ctx.close()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server and its kernel: our own session
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    with capsys.disabled():  # shown under -q too: the closing note asks for it
        print(
            f"\nreal-browser test: {time.monotonic() - t0:.1f} s (14 -> 13 link: "
            f"{t_link:.1f} s); screenshot {WORK / 'widgets.png'}"
        )
        print("images per lesson idiom:", ", ".join(f"{k} {v}" for k, v in SHOWN.items()))
    if link_error is not None:
        with capsys.disabled():
            print(link_error)


SHOWN: dict[str, int] = {}  # lesson -> images counted in the page (reported by the test)


def _check_figures(page) -> None:
    """Each FIGURE_CELLS cell shows exactly its images (counted in the page, not the kernel)."""
    cells = page.locator(".jp-NotebookPanel:visible .jp-Notebook .jp-Cell")
    last = cells.nth(len(CELLS) - 1)
    last.locator(".jp-OutputArea-output", has_text="figures done").wait_for(timeout=120_000)
    got = []
    for k, (lesson, _, want) in enumerate(FIGURE_CELLS):
        cell = cells.nth(len(WIDGET_CELLS) + k)
        images = cell.locator(".jp-OutputArea-output img")
        n = images.count()
        got.append((lesson, n, want))
        SHOWN[lesson] = SHOWN.get(lesson, 0) + n
    assert [n for _, n, _ in got] == [w for _, _, w in got], got


INDEX, WALKTHROUGHS = "notebooks/14_interview_index.ipynb", "13_interview_walkthroughs.ipynb"
ONLY_WHEN_OPEN = "the fragment is applied only to an already open notebook"
LINK_ID = "K11"  # deep in 13: landing at the top is easy to tell apart
# the section's heading is in view of its notebook's scroller, and that scroller has moved.
# JupyterLab's sanitizer renames a heading's id to data-jupyter-id.
IN_VIEW = """id => {
  const h = document.querySelector(`[data-jupyter-id="${id}"]`) || document.getElementById(id);
  if (!h || h.offsetParent === null) return false;
  const sc = h.closest('.jp-WindowedPanel-outer') || h.closest('.jp-Notebook');
  const r = h.getBoundingClientRect(), s = sc.getBoundingClientRect();
  return sc.scrollTop > 0 && r.top >= s.top - 1 && r.top < s.bottom; }"""


def _index_anchors() -> dict[str, str]:
    """id -> the heading anchor 14's link for it names (read from 14, not restated here)."""
    import nbformat

    text = "".join(c.source for c in nbformat.read(ROOT / INDEX, 4).cells)
    pattern = rf"\[13 · (\w+)[^\]]*\]\({re.escape(WALKTHROUGHS)}#heading=([\w.-]+)\)"
    return dict(re.findall(pattern, text))


def _lands(page, anchor: str, timeout_ms: int) -> bool:
    try:
        page.wait_for_function(IN_VIEW, arg=anchor, timeout=timeout_ms)
    except Exception:  # playwright's TimeoutError: still not in view
        return False
    return True


def _check_index_link(page) -> str | None:
    """Open (a copy of) notebook 14 and click the link of ``LINK_ID``: 13 opens (a new tab).
    JupyterLab 4.6 lands at the top on a notebook's first open (jupyterlab/jupyterlab#15207),
    which 14 tells the learner; that landing is reported, not required. Clicked again with 13
    open, the link must scroll 13 so that the section's heading is in view, and 13's first
    section must not be (negative control). None when the first open landed; else a report."""
    anchors = _index_anchors()
    anchor, first = anchors[LINK_ID], next(iter(anchors.values()))
    for name in (INDEX, f"notebooks/{WALKTHROUGHS}"):  # copies: JupyterLab may save what it opens
        shutil.copy(ROOT / name, WORK / Path(name).name)
    page.locator(".jp-NotebookPanel:visible a", has_text="the interview index").click()
    link = page.locator(f".jp-NotebookPanel:visible a[href*='#heading={anchor}']").first
    link.wait_for(timeout=60_000)
    _accept_kernel_dialog(page, wait_ms=500)
    link.click()
    current = page.locator(".lm-TabBar-tab.lm-mod-current .lm-TabBar-tabLabel")
    current.filter(has_text=WALKTHROUGHS).wait_for(timeout=30_000)
    landed = _lands(page, anchor, 4_000)
    page.screenshot(path=str(WORK / "index_link.png"))
    if not landed:
        page.locator(".lm-TabBar-tab .lm-TabBar-tabLabel", has_text="14_interview_index").click()
        link.click()  # 13 is open now
        assert _lands(page, anchor, 8_000), (
            f"clicking 14's link to {LINK_ID} (#heading={anchor}) with 13 open did not scroll "
            f"13 to the section (screenshot {WORK / 'index_link.png'})"
        )
    assert not page.evaluate(IN_VIEW, first), f"13 shows {first} too: the check is wrong"
    if landed:
        return None
    return f"14 -> 13 on 13's first open landed at the top: {ONLY_WHEN_OPEN} (as 14 says)"
