"""The README's commands: `./lab` serves JupyterLab on the welcome notebook; headless runs work."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(120)
def test_lab_command_serves_the_welcome_notebook():
    port, token = _free_port(), "labkit-test-token"
    proc = subprocess.Popen(
        [
            str(ROOT / "lab"),
            "--no-browser",
            f"--port={port}",
            "--ServerApp.ip=127.0.0.1",
            f"--IdentityProvider.token={token}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=5):
                    break
            except (urllib.error.URLError, ConnectionError):
                assert proc.poll() is None, (
                    proc.stderr.read().decode() if proc.stderr else "lab exited"
                )
                assert time.monotonic() < deadline, "JupyterLab did not come up"
                time.sleep(0.5)
        with urllib.request.urlopen(
            f"{base}/api/contents/notebooks?token={token}", timeout=10
        ) as r:
            names = {item["name"] for item in json.load(r)["content"]}
        assert "00_welcome.ipynb" in names
        with urllib.request.urlopen(
            f"{base}/lab/tree/notebooks/00_welcome.ipynb?token={token}", timeout=10
        ) as r:
            assert r.status == 200 and b"JupyterLab" in r.read()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)


@pytest.mark.timeout(120)
def test_headless_run_prints_each_cells_output(tmp_path):
    # The runner itself, on a notebook with no launch: nbval already runs the real labs.
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_markdown_cell("# a lab"),
        nbformat.v4.new_code_cell("x = 6 * 7\nprint('first cell says', x)"),
        nbformat.v4.new_code_cell("x + 1"),
    ]
    nbformat.write(nb, tmp_path / "lab.ipynb")
    result = subprocess.run(
        [sys.executable, "-m", "labkit", "run", str(tmp_path / "lab.ipynb")],
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "first cell says 42" in result.stdout and "\n43\n" in result.stdout
    assert "all 2 code cells ran" in result.stdout

    nb.cells.append(nbformat.v4.new_code_cell("raise ValueError('broken lab')"))
    nbformat.write(nb, tmp_path / "broken.ipynb")
    broken = subprocess.run(
        [sys.executable, "-m", "labkit", "run", str(tmp_path / "broken.ipynb")],
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert broken.returncode == 1 and "broken lab" in broken.stdout


def test_info_command_names_the_backend():
    out = subprocess.run(
        [sys.executable, "-m", "labkit", "info"], capture_output=True, text=True, check=True
    ).stdout
    assert "backend for 2 ranks: gloo" in out or "backend for 2 ranks: nccl" in out
