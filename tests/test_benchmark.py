"""The benchmark runs (in its quick mode: tiny dims, a few seconds) and reports every row; timings are not asserted."""

import importlib.util
import pathlib

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_quick_benchmark_runs_every_row(capsys):
    spec = importlib.util.spec_from_file_location("benchmark_run", ROOT / "benchmarks" / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    assert module.main(["--quick", "--repeats", "1", "--no-memory"]) == 0
    assert torch.get_num_threads() == threads
    out = capsys.readouterr().out
    for row in ("unhooked forward", "idle watch", "8 positions read", "8 positions written", "per-token hook",
                "all-token states", "generate + per-step hook"):
        assert row in out, f"the benchmark printed no {row!r} row:\n{out}"
    assert "ERROR" not in out
