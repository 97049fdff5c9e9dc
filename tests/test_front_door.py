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
    # The runner itself, on a notebook with no launch: tests/lessons already runs the real labs.
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


def _fake_checkout(tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the front door (lab, tools/, pyproject.toml) whose .venv/bin/python is the real
    venv's Python behind a wrapper that logs every call and refuses ``-m`` (pip, ipykernel):
    an install attempt shows in the log and changes nothing."""
    import shutil

    root = tmp_path / "checkout"
    (root / "tools").mkdir(parents=True)
    for name in ("lab", "pyproject.toml"):
        shutil.copy2(ROOT / name, root / name)
    for name in ("ensure_env.sh", "check_torch.py"):
        shutil.copy2(ROOT / "tools" / name, root / "tools" / name)
    log = tmp_path / "calls.log"
    venv_bin = root / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    wrapper = venv_bin / "python"
    # any "-m" (pip, ipykernel) is logged and refused, so even a regressed lab installs nothing
    wrapper.write_text(
        f'#!/bin/sh\necho "python $*" >> "{log}"\n'
        '[ "$1" = "-m" ] && exit 1\n'
        f'exec "{sys.executable}" "$@"\n'
    )
    wrapper.chmod(0o755)
    for tool in ("pip", "jupyter"):  # a direct call would show too
        fake = venv_bin / tool
        fake.write_text(f'#!/bin/sh\necho "{tool} $*" >> "{log}"\nexit 1\n')
        fake.chmod(0o755)
    return root, log


def test_lab_help_prints_labkits_usage_and_installs_nothing(tmp_path):
    root, log = _fake_checkout(tmp_path)  # no install stamp: ensure_env.sh would pip install
    env = {**os.environ, "LABKIT_TORCH": "torch==2.13.0"}
    out = subprocess.run([str(root / "lab"), "--help"], capture_output=True, text=True,
                         timeout=60, env=env)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith("usage: ./lab [NOTEBOOK | --headless [NOTEBOOK] | book]")
    assert "./lab book" in out.stdout and "./lab NOTEBOOK" in out.stdout
    assert "LABKIT_TORCH" in out.stdout and "--headless" in out.stdout
    assert "JupyterLab" in out.stdout and "jupyter lab --help" in out.stdout
    calls = log.read_text() if log.exists() else ""
    assert "-m" not in calls and "pip" not in calls and "jupyter" not in calls, calls
    assert not (root / ".venv" / ".labkit-installed").exists()
    # torch==2.13.0 is satisfied by the installed 2.13.0 (a local tag like +cpu included)
    from importlib.metadata import version

    if version("torch").startswith("2.13.0"):
        assert "LABKIT_TORCH" not in out.stderr, out.stderr


def test_a_torch_other_than_labkit_torch_is_reported_with_the_fix(tmp_path):
    from importlib.metadata import version

    root, log = _fake_checkout(tmp_path)
    env = {**os.environ, "LABKIT_TORCH": "torch==1.0.0"}
    out = subprocess.run([str(root / "lab"), "--help"], capture_output=True, text=True,
                         timeout=60, env=env)  # fmt: skip
    assert out.returncode == 0
    assert f".venv has torch {version('torch')}" in out.stderr, out.stderr
    assert "pip install --force-reinstall torch==1.0.0" in out.stderr
    # the everyday path too: an installed venv (stamp current) reports it, installs nothing
    import hashlib

    stamp = hashlib.sha256((root / "pyproject.toml").read_bytes()).hexdigest()
    (root / ".venv" / ".labkit-installed").write_text(stamp + "\n")
    log.unlink(missing_ok=True)
    got = subprocess.run([str(root / "tools" / "ensure_env.sh")], capture_output=True,
                         text=True, timeout=60, env=env)  # fmt: skip
    assert got.returncode == 0, got.stderr
    assert "asks for torch==1.0.0" in got.stderr, got.stderr
    assert "pip" not in log.read_text()
    # negative control: no LABKIT_TORCH, nothing to say
    quiet = subprocess.run([str(root / "tools" / "ensure_env.sh")], capture_output=True,
                           text=True, timeout=60,
                           env={k: v for k, v in env.items() if k != "LABKIT_TORCH"})  # fmt: skip
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
