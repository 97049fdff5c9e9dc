"""The many-node entry point: the 3D lab under two torchrun "nodes" on 127.0.0.1, and the
Slurm and Kubernetes examples that start the same entry.

The two-node run (``--nnodes 2 --nproc-per-node 4``, c10d rendezvous on a free port, both
agents started here, bounded, every process killed on failure) must print the same final
parameter checksum as single-process training of the same tiny GPT, which
``tests/test_threed.py`` shows the single-launch run equals too.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
ENTRY = "labkit.labs.threed"
ARGS = ["--dp", "2", "--tp", "2", "--pp", "2", "--steps", "2"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_two_torchrun_nodes_match_single_process(tmp_path) -> None:
    from labkit.labs.threed import LabConfig, reference
    from labkit.parallel import ParallelDegrees
    from labkit.parallel.threed import ThreeDConfig

    port = _free_port()
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "4",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "threed",
        "--max-restarts", "0", "--log-dir", str(tmp_path / "agents"), "-m", ENTRY, *ARGS,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    nodes = [
        subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )  # fmt: skip
        for _ in range(2)
    ]
    outputs = []
    try:
        for node in nodes:
            out, _ = node.communicate(timeout=240)
            outputs.append(out)
            assert node.returncode == 0, out[-3000:]
    finally:
        for node in nodes:  # each agent leads its own process group: end it with its ranks
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
                node.wait()
    sums = [float(m) for out in outputs for m in re.findall(r"^checksum (\S+)$", out, re.M)]
    assert len(sums) == 1, outputs  # global rank 0 prints it, on whichever node it landed
    cfg = LabConfig(threed=ThreeDConfig(ParallelDegrees(2, 2, 2), 2), steps=2)
    assert sums[0] == pytest.approx(reference(cfg)["checksum"], abs=1e-3)
    # negative control: another number of steps gives another checksum
    assert abs(sums[0] - reference(LabConfig(threed=cfg.threed, steps=3))["checksum"]) > 1e-2


def test_slurm_script_parses_and_names_the_entry() -> None:
    script = ROOT / "examples" / "slurm" / "threed.sbatch"
    subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)
    text = script.read_text()
    assert f"-m {ENTRY}" in text and "--rdzv-backend c10d" in text
    assert re.search(r"^#SBATCH --nodes=\d+", text, re.M)


def test_pytorchjob_manifest_parses_and_names_the_entry() -> None:
    doc = yaml.safe_load((ROOT / "examples" / "k8s" / "pytorchjob.yaml").read_text())
    assert doc["kind"] == "PyTorchJob" and doc["apiVersion"].startswith("kubeflow.org/")
    assert doc["spec"]["elasticPolicy"]["rdzvBackend"] == "c10d"
    for spec in doc["spec"]["pytorchReplicaSpecs"].values():
        (container,) = spec["template"]["spec"]["containers"]
        assert container["command"] == ["torchrun"]
        assert container["args"][:2] == ["-m", ENTRY]


def test_bad_yaml_is_rejected() -> None:  # negative control for the lint
    with pytest.raises(yaml.YAMLError):
        yaml.safe_load("kind: PyTorchJob\n  spec: [unclosed")
