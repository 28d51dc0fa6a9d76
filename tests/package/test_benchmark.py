"""The benchmark runs (in its quick mode: tiny dims, a few seconds) and reports every row; timings are not asserted."""

import importlib.util
import pathlib

import torch
from _compare import assert_close

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_quick_benchmark_runs_every_row(capsys):
    spec = importlib.util.spec_from_file_location("benchmark_run", ROOT / "benchmarks" / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    assert module.main(["--quick", "--repeats", "1", "--no-memory"]) == 0
    assert torch.get_num_threads() == threads
    out = capsys.readouterr().out
    for row in (
        "unhooked forward",
        "idle watch",
        "8 positions read",
        "8 positions written",
        "per-token hook",
        "all-token states",
        "generate + per-step hook",
    ):
        assert row in out, f"the benchmark printed no {row!r} row:\n{out}"
    assert "ERROR" not in out


def test_the_calibration_fit_is_non_negative_least_squares():
    """benchmarks/paths.py fits the cost constants by its own NNLS (no scipy): the optimum where it is interior,
    and on the boundary where the unconstrained fit would be negative (checked by the KKT conditions)."""
    spec = importlib.util.spec_from_file_location("benchmark_paths", ROOT / "benchmarks" / "paths.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    generator = torch.Generator().manual_seed(0)
    a = torch.rand(30, 5, generator=generator, dtype=torch.float64) * torch.logspace(-3, 3, 5, dtype=torch.float64)
    truth = torch.tensor([2.0, 0.5, 1e-3, 4.0, 0.25], dtype=torch.float64)
    assert_close("interior optimum", truth, module.nnls(a, a @ truth), rtol=1e-9, atol=0)
    b = a @ torch.tensor([1.0, -3.0, 0.0, 2.0, -1.0], dtype=torch.float64)
    x = module.nnls(a, b)
    gradient = a.T @ (b - a @ x)  # KKT: x >= 0, gradient <= 0, and gradient = 0 wherever x > 0
    assert (x >= 0).all() and (x == 0).any(), f"x = {x}"
    assert (gradient <= 1e-9).all(), f"a variable could still lower the residual: gradient {gradient}"
    assert_close("gradient on the free variables", torch.zeros_like(gradient[x > 0]), gradient[x > 0], atol=1e-8)


def test_quick_harvest_benchmark_runs_every_row(capsys):
    spec = importlib.util.spec_from_file_location("benchmark_harvest", ROOT / "benchmarks" / "harvest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    assert module.main(["--quick", "--models", "gdn", "--repeats", "1", "--batches", "1"]) == 0
    assert torch.get_num_threads() == threads
    out = capsys.readouterr().out
    for row in ("forward", "norm", "probe (rank 8)", "writes (key, value, beta)", "states", "x the forward"):
        assert row in out, f"the harvest benchmark printed no {row!r} row:\n{out}"


def test_quick_harvest_read_benchmark_runs_every_row(capsys):
    spec = importlib.util.spec_from_file_location("benchmark_harvest_read", ROOT / "benchmarks" / "harvest_read.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    assert module.main(["--quick", "--repeats", "1"]) == 0
    assert torch.get_num_threads() == threads
    out = capsys.readouterr().out
    for row in ("take, file order", "take, batches' indices", "batches", "DataLoader, BatchSampler", "x take"):
        assert row in out, f"the harvest read benchmark printed no {row!r} row:\n{out}"
