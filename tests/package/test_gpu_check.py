"""scripts/gpu_check.py, the GPU check's prepared command, in its CPU mode: `--device cpu --quick` runs
every stage and writes the report's every section, so that the script cannot rot between GPU runs."""

import json
import pathlib
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SECTIONS = ["## Stages", "## Versions", "## Suite", "## Benchmark rows", "## Cost model calibration"]
ROWS = [
    "plain forward",
    "idle watch",
    "writes at 8 positions (every layer)",
    "every state of one layer kept",
    "a per-token hook on one layer",
    "harvest: a norm of every layer's state",
    "harvest: a rank-8 probe of every layer's state",
    "a sweep cell (layer 0, one position; its clean and corrupt runs included)",
    "rh.attribute over 2 layers",
]


@pytest.mark.full  # about 90 s on 2 cores: its stages' child processes each import torch and transformers
@pytest.mark.cpu_only(reason="runs the script's CPU mode (--device cpu --quick); on a GPU the script itself is run")
def test_the_quick_cpu_run_writes_every_section_of_the_report(tmp_path):
    start = time.monotonic()
    run = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "--out", str(tmp_path), "--device", "cpu", "--quick"],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    seconds = time.monotonic() - start
    report = (tmp_path / "report.md").read_text()
    assert run.returncode == 0, f"{run.stderr[-3000:]}\n{report}"
    assert seconds < 180, f"--device cpu --quick took {seconds:.0f} s (at most 3 minutes)"
    positions = [report.find(section) for section in SECTIONS]
    assert -1 not in positions and positions == sorted(positions), report
    data = json.loads((tmp_path / "report.json").read_text())
    stages = data["stages"]
    assert list(stages) == ["versions", "suite", "benchmarks", "calibration-bfloat16", "calibration-float32"]
    assert all(stage["status"] == "passed" for stage in stages.values()), report
    versions = stages["versions"]["result"]["versions"]
    assert {"torch", "transformers", "flash-linear-attention", "device"} <= set(versions), versions
    suite = stages["suite"]["result"]["variants"]["without fla"]
    assert suite["passed"] > 0 and suite["failed"] == suite["errors"] == 0, suite
    models = stages["benchmarks"]["result"]["models"]
    assert list(models) == ["qwen3_5", "mamba2"]
    for model in models.values():
        assert list(model["rows"]) == ROWS
        assert all(row["ratio"] > 0 and row["error"] is None for row in model["rows"].values()), model["rows"]
    costs = json.loads((tmp_path / "costs.json").read_text())
    assert set(costs) == {"cpu/bfloat16", "cpu/float32"}
    assert all(set(entry["kernels"]) == {"delta rule", "ssd", "kimi delta"} for entry in costs.values())
