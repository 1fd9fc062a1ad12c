"""`make demo`'s command end to end (shortened): server, three device processes, the report,
and the simulated H200 table."""
from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_demo_runs_three_devices_losslessly():
    done = subprocess.run([sys.executable, "-m", "sled_cli.main", "demo", "--prompts", "1",
                           "--max-new-tokens", "12", "--simulated-devices", "16"],
                          capture_output=True, text=True, timeout=900,
                          env={**__import__("os").environ, "COLUMNS": "160"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for device in ("pi-gguf", "jetson-onnx", "thin-ngram"):
        assert f"{device}" in done.stdout
        assert any(line.startswith(device) and line.rstrip().endswith("identical")
                   for line in done.stdout.splitlines()), done.stdout[-2000:]
    assert "centralized" in done.stdout
    # then the same kind of fleet against the simulated H200, labelled, every output checked
    assert "SIMULATED" in done.stdout
    assert "simulated server: h200-llama8b-flex-graph" in done.stdout
    assert "16 devices: sled carries" in done.stdout and "GPU-seconds per token" in done.stdout
    # which fleet the table is (every device always asking), beside the buyer's answer's
    words = " ".join(done.stdout.split())        # the notes wrap at the terminal's width
    assert "asks again the moment it is answered" in words and "twice a minute" in words
    simulated = done.stdout[done.stdout.index("SIMULATED"):]
    assert simulated.count("as scripted") == 4 and "DIFFERENT" not in simulated
