"""The GPU check: the suite on a device, the benchmark rows at real dims, the cost model's calibration
and the versions, in one prepared command that writes one report.

    python scripts/gpu_check.py --out DIR --device cuda          # on a GPU machine: within 8 minutes
    python scripts/gpu_check.py --out DIR --device cpu --quick   # the same stages at tiny dims: under 3 minutes

Each stage runs in a child process of its own, under its own time budget (`BUDGETS`, seconds): a stage that fails,
crashes or runs out of time is recorded in the report and the next stage runs; the exit status is 1 if any stage
failed. DIR/report.md and DIR/report.json are rewritten after every stage, so a run cut short still leaves one; at the
end DIR holds them, costs.json and stages.tar.gz (each stage's log and result, the suite's junit files).

- versions: the device, python, torch, transformers, flash-linear-attention (fla), the other kernel packages, and
  the library's commit.
- suite: `pytest --device DEV --one-family-per-kind` over the kernel and contract test files that `.ci/run`'s quick
  run lists (read from it) and tests/package/test_device.py. On CUDA twice, side by side: with fla as installed and with
  it hidden (`sys.modules["fla"] = None`: transformers then finds no fla and binds its torch kernels). On the CPU
  once, without fla (its kernels run on CUDA only). --quick: tests/package/test_device.py alone.
- benchmarks: a Qwen3.5-0.8B-like hybrid (24 layers, 3 gated DeltaNet : 1 attention) and mamba2-130m (24 layers),
  built with benchmarks/run.py's builders, bfloat16, batch 1, T = 2,048 (--quick: tiny dims, float32, T = 64).
  Rows, in interleaved rounds after a warm-up round, each the median over rounds of its time over the plain
  forward's in the same round; peak memory: `torch.cuda.max_memory_allocated` during the row less what was
  allocated before it (CUDA), or the process's peak RSS less its RSS before the row (CPU).
- calibration-bfloat16, calibration-float32: benchmarks/paths.py's `calibrate` on DEV (its call arguments cast to
  the dtype), written with its `write` into DIR/costs.json under "DEV/dtype": entries for the package's
  costs.json, which this script never touches.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any
from xml.etree import ElementTree

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))  # benchmarks/run.py and paths.py import as `run` and `paths`
sys.path.insert(0, str(ROOT))  # this checkout's package, not an installed one

STAGES = ("versions", "suite", "benchmarks", "calibration-bfloat16", "calibration-float32")
# seconds per stage, each child's start (imports) included: on a GPU 465 in all (8 minutes is 480); --quick on 2 CPU
# cores, 165 at most (3 minutes is 180; 91 s measured on a busy 2-core machine)
BUDGETS = {"versions": 45, "suite": 150, "benchmarks": 150, "calibration-bfloat16": 60, "calibration-float32": 60}
QUICK_BUDGETS = {"versions": 30, "suite": 45, "benchmarks": 60, "calibration-bfloat16": 15, "calibration-float32": 15}
PACKAGES = (
    "torch",
    "transformers",
    "flash-linear-attention",
    "fla-core",
    "kernels",
    "causal-conv1d",
    "mamba-ssm",
    "triton",
    "accelerate",
    "pytest",
    "pytest-xdist",
)
HIDDEN = "fla"  # what the suite's run without fla hides
MB = 2**20


# -- the parent: each stage in a child, under its budget; the report after each ----------------------------------


def _child(name: str, args: argparse.Namespace, budget: float) -> dict[str, Any]:
    """Run stage `name` in a child process, SIGINT at its budget (pytest and the stages then write what they
    have), killed 20 s later; its result: status, seconds, budget, what it wrote, the end of its log."""
    stages = pathlib.Path(args.out) / "stages"
    log, result = stages / f"{name}.log", stages / f"{name}.json"
    result.unlink(missing_ok=True)
    argv = [
        sys.executable,
        str(pathlib.Path(__file__).resolve()),
        "--stage",
        name,
        "--out",
        args.out,
        "--device",
        args.device,
        "--budget",
        str(budget),
    ] + (["--quick"] if args.quick else [])
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if name == "benchmarks" and args.device == "cpu":  # glibc hands large frees back: RSS follows the tensors
        env.update(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0", MALLOC_ARENA_MAX="2")
    start = time.monotonic()
    with open(log, "w") as out:
        # a session of its own: at its budget, SIGINT reaches what it started too (the suite's pytest runs)
        child = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
        try:
            timed_out = _wait(child, budget, group=True)
        except BaseException:  # this run is stopped (Ctrl-C, SIGTERM): so is the stage, with what it started
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            raise
    seconds = time.monotonic() - start
    wrote = json.loads(result.read_text()) if result.exists() else {}
    tail = log.read_text(errors="replace").strip().splitlines()[-15:]
    if timed_out:
        status = "timed out"
    elif child.returncode != 0 or not result.exists():
        status = "failed"
    else:
        status = wrote.get("status", "passed")
    return {
        "status": status,
        "seconds": round(seconds, 1),
        "budget": budget,
        "returncode": child.returncode,
        "result": wrote,
        "log": str(log.relative_to(args.out)),
        "log tail": tail if status != "passed" else [],
    }


def _wait(child: subprocess.Popen, budget: float, group: bool = False) -> bool:
    """Wait for `child` up to `budget` seconds; then SIGINT, and SIGKILL 20 s later (to its process group where
    `group`: a child started in a session of its own). Whether it ran out of time."""

    def send(sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, sig) if group else child.send_signal(sig)

    try:
        child.wait(timeout=budget)
        return False
    except subprocess.TimeoutExpired:
        send(signal.SIGINT)
        try:
            child.wait(timeout=20)
        except subprocess.TimeoutExpired:
            send(signal.SIGKILL)
            child.wait()
        return True


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.out = str(pathlib.Path(args.out).resolve())  # the children run in the checkout's root
    if args.stage:
        return _run_stage(args)
    out = pathlib.Path(args.out)
    (out / "stages").mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through `_child`, which stops its stage
    budgets = QUICK_BUDGETS if args.quick else BUDGETS
    run = {
        "command": " ".join(["python", "scripts/gpu_check.py", *(argv if argv is not None else sys.argv[1:])]),
        "device": args.device,
        "quick": args.quick,
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "stages": {},
    }
    start = time.monotonic()
    for name in args.stages.split(",") if args.stages else STAGES:
        print(f"gpu_check: {name} (budget {budgets[name]} s)", file=sys.stderr, flush=True)
        run["stages"][name] = _child(name, args, budgets[name])
        run["wall seconds"] = round(time.monotonic() - start, 1)
        write_report(out, run)
        print(
            f"gpu_check: {name}: {run['stages'][name]['status']} in {run['stages'][name]['seconds']} s",
            file=sys.stderr,
            flush=True,
        )
    shutil.rmtree(out / "stages" / "scratch", ignore_errors=True)
    # the stages' logs and results in one file: DIR holds 4 (the device tool brings back at most 8)
    shutil.make_archive(str(out / "stages"), "gztar", out, "stages")
    shutil.rmtree(out / "stages")
    failed = [name for name, stage in run["stages"].items() if stage["status"] != "passed"]
    print(
        f"gpu_check: report in {out / 'report.md'}; {len(failed)} stage(s) not passed"
        + (f": {', '.join(failed)}" if failed else ""),
        file=sys.stderr,
    )
    return 1 if failed else 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the folder the report is written into")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--quick", action="store_true", help="tiny dims, float32, short runs: the CPU's smoke run")
    parser.add_argument("--stages", default="", help=f"a comma-separated subset of {','.join(STAGES)}")
    parser.add_argument("--stage", default="", help=argparse.SUPPRESS)  # inside a child: run this stage
    parser.add_argument("--budget", type=float, default=0.0, help=argparse.SUPPRESS)
    return parser


def _run_stage(args: argparse.Namespace) -> int:
    stage = {"versions": stage_versions, "suite": stage_suite, "benchmarks": stage_benchmarks}.get(args.stage)
    if stage is None and args.stage.startswith("calibration-"):
        stage = stage_calibration
    if stage is None:
        raise SystemExit(f"unknown stage {args.stage!r}; stages: {', '.join(STAGES)}")
    return stage(args)


def _save(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """Write the stage's result (again as it grows: a stage cut short keeps what it wrote)."""
    path = pathlib.Path(args.out) / "stages" / f"{args.stage}.json"
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")


# -- versions ------------------------------------------------------------------------------------------------------


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def stage_versions(args: argparse.Namespace) -> int:
    import torch
    import transformers.utils.import_utils as imports

    device = torch.device(args.device)
    found = {
        "python": platform.python_version(),
        **{name: _version(name) for name in PACKAGES},
        "fla importable": importlib.util.find_spec("fla") is not None,
        "transformers binds fla": bool(getattr(imports, "is_flash_linear_attention_available", bool)()),
        "recurrent_hooks": _library_version(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        found["device"] = (
            f"{props.name}, {props.total_memory / 2**30:.0f} GiB, compute capability"
            f" {props.major}.{props.minor}, {props.multi_processor_count} multiprocessors"
        )
        found["CUDA (torch built for)"] = torch.version.cuda
    else:
        found["device"] = f"{device.type}: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    _save(args, {"status": "passed", "versions": found})
    return 0


def _library_version() -> str:
    import run as bench  # benchmarks/run.py

    return bench._library_version()


# -- the suite on the device -----------------------------------------------------------------------------------------

RUNNER = (
    "import os, sys\n"
    "for name in filter(None, os.environ.get('GPU_CHECK_HIDE', '').split(',')):\n"
    "    sys.modules[name] = None  # importlib.util.find_spec gives None: transformers finds no such package\n"
    "import pytest\n"
    "sys.exit(pytest.main(sys.argv[1:]))\n"
)


def ci_quick_files(ci: pathlib.Path = ROOT / ".ci" / "run") -> list[str]:
    """The test files of `.ci/run`'s quick run (the kernel-equivalence and contract tests, one family per kind)."""
    text = ci.read_text()
    start = text.find("--one-family-per-kind tests/")
    files = re.findall(r"tests/\w+/test_\w+\.py", text[start : text.find("||", start)]) if start >= 0 else []
    if not files:
        raise SystemExit(f"no test files after '--one-family-per-kind' in {ci}: its quick run has changed")
    return files


def stage_suite(args: argparse.Namespace) -> int:
    import torch

    device = torch.device(args.device)
    files = ["tests/package/test_device.py"] if args.quick else [*ci_quick_files(), "tests/package/test_device.py"]
    variants, notes, missing = {"without fla": HIDDEN}, [], {}
    if device.type != "cuda":
        notes.append(f"on {device.type}: the run without fla only (fla's kernels run on CUDA only)")
    elif importlib.util.find_spec("fla") is None:  # the check is incomplete: the stage fails, saying why
        missing["with fla"] = {"not run": "flash-linear-attention is not installed (README, Tests: its wheels)"}
    else:
        variants["with fla"] = ""
    workers = ["-n", "6"] if device.type == "cuda" and importlib.util.find_spec("xdist") else []
    stages = pathlib.Path(args.out) / "stages"
    runs = {}
    for name, hide in variants.items():
        xml = stages / f"suite {name}.xml".replace(" ", "-")
        argv = [
            sys.executable,
            "-c",
            RUNNER,
            "-q",
            "-p",
            "no:cacheprovider",
            "--device",
            args.device,
            "--one-family-per-kind",
            "-rfEs",
            f"--junitxml={xml}",
            *workers,
            *files,
        ]
        log = open(stages / f"suite {name}.log".replace(" ", "-"), "w")
        runs[name] = (
            subprocess.Popen(
                argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, GPU_CHECK_HIDE=hide)
            ),
            xml,
            log,
            time.monotonic(),
        )
    result = {"files": files, "notes": notes, "variants": dict(missing)}
    for name, (child, xml, log, start) in runs.items():
        # stopped before the parent stops this stage, so that pytest writes its report
        timed_out = _wait(child, max(5.0, 0.85 * args.budget - (time.monotonic() - start)))
        log.close()
        counts = _junit(xml)
        counts.update(
            returncode=child.returncode,
            seconds=round(time.monotonic() - start, 1),
            log=pathlib.Path(log.name).name,
            **({"timed out": True} if timed_out else {}),
        )
        result["variants"][name] = counts
    passed = not missing and all(v["returncode"] == 0 and not v.get("timed out") for v in result["variants"].values())
    result["status"] = "passed" if passed else "failed"
    _save(args, result)
    return 0 if passed else 1


def _junit(xml: pathlib.Path) -> dict[str, Any]:
    """Counts of a pytest junit file, and the failures' ids with their messages' first lines."""
    if not xml.exists():
        return {"junit": "missing (pytest did not finish its report)"}
    cases = ElementTree.parse(xml).getroot().iter("testcase")
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures = []
    for case in cases:
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), None)
        key = {"failure": "failed", "error": "errors", "skipped": "skipped", None: "passed"}[outcome]
        counts[key] += 1
        if outcome in ("failure", "error"):
            message = next(child for child in case if child.tag == outcome).get("message") or ""
            first = message.splitlines()[0][:200] if message else ""
            failures.append(f"{case.get('classname')}::{case.get('name')}: {first}")
    return {**counts, "failures": failures}


# -- the benchmark rows --------------------------------------------------------------------------------------------


def _models(quick: bool) -> dict[str, tuple[str, Callable[[], Any]]]:
    import run as bench  # benchmarks/run.py's builders

    if quick:
        return {
            "qwen3_5": (
                "Qwen3.5-like hybrid at quick dims: hidden 64, 4 value heads of 16, 4 layers (3:1)",
                lambda: bench._gdn(64, 2, 4, 16, 128, ["linear_attention"] * 3 + ["full_attention"]),
            ),
            "mamba2": (
                "Mamba-2 at quick dims: hidden 64, 4 heads of 32, state 16, chunk 16, 4 layers",
                lambda: bench._mamba2(64, 4, 32, 16, 16, layers=4),
            ),
        }
    return {
        "qwen3_5": (
            (
                "Qwen3.5-0.8B-like hybrid: hidden 1024, gated DeltaNet 16 key / 16 value heads of 128, MLP 3584,"
                " attention 8/2 heads of 128 (the checkpoint's: 256), 24 layers in its 3:1 pattern, vocab 1024"
            ),
            lambda: bench._gdn(1024, 16, 16, 128, 3584, (["linear_attention"] * 3 + ["full_attention"]) * 6),
        ),
        "mamba2": (
            "mamba2-130m: hidden 768, 24 heads of 64, state 128, chunk 256, 24 layers, vocab 1024",
            lambda: bench._mamba2(768, 24, 64, 128, 256, layers=24),
        ),
    }


def metric(logits):
    return logits[:, -1].float().logsumexp(-1)


def benchmark_rows(model: Any, ids: Any, scratch: pathlib.Path) -> dict[str, Callable[[], Any]]:
    """The rows of one model over `ids` ([1, T] on its device), each a function that runs it once."""
    import run as bench
    import torch

    import recurrent_hooks as rh

    tokens, device = ids.shape[1], ids.device
    with torch.no_grad(), rh.watch(model, keep={"states": [0]}) as w:  # the mixers and their states' shapes
        model(ids[:, :2], use_cache=False)
    first, second = (m.layer for m in w.mixers[:2])
    state = w.mixers[0].state_after(0)
    zeros = {m.layer: torch.zeros_like(m.state_after(0)) for m in w.mixers}
    heads, rows, cols = state.shape[1:]
    generator = torch.Generator().manual_seed(0)
    probe = rh.probe(
        torch.randn(heads, 8, rows, generator=generator).to(device, state.dtype),
        torch.randn(heads, 8, cols, generator=generator).to(device, state.dtype),
    )
    positions = bench.positions(tokens)
    corrupt = ids.clone()
    corrupt[:, tokens // 2] = (corrupt[:, tokens // 2] + 1) % bench.VOCAB

    def forward():
        with torch.no_grad():
            return model(ids, use_cache=False).logits

    def watched(**kwargs):
        with torch.no_grad(), rh.watch(model, **kwargs) as w:
            model(ids, use_cache=False)
        return w

    def writes():
        with torch.no_grad(), rh.watch(model) as w:
            for mixer in w.mixers:
                for position in positions:
                    mixer.set_state_after(position, zeros[mixer.layer])
            model(ids, use_cache=False)

    def hooked():
        norms = []
        with torch.no_grad(), rh.watch(model, layers=[first]) as w:
            w.mixers[0].register_state_hook(lambda m, c, t, s: norms.append(s.norm()))
            model(ids, use_cache=False)
        return norms

    def harvest(reduce):
        out = scratch / "harvest"
        shutil.rmtree(out, ignore_errors=True)
        rh.harvest(
            model,
            [ids],
            out,
            keep=("states",),
            reduce={"states": reduce},
            progress=False,
            forward_kwargs={"use_cache": False},
        )
        shutil.rmtree(out)

    return {
        "plain forward": forward,
        "idle watch": lambda: watched(),
        "writes at 8 positions (every layer)": writes,
        "every state of one layer kept": lambda: watched(keep=("states",), layers=[first]),
        "a per-token hook on one layer": hooked,
        "harvest: a norm of every layer's state": lambda: harvest(bench._per_token_norm),
        "harvest: a rank-8 probe of every layer's state": lambda: harvest(probe),
        "a sweep cell (layer 0, one position; its clean and corrupt runs included)": lambda: rh.patching_sweep(
            model, ids[0], corrupt[0], metric, layers=[first], positions=[tokens // 2], progress=False
        ),
        "rh.attribute over 2 layers": lambda: rh.attribute(
            model, ids, corrupt, metric, layers=[first, second], forward_kwargs={"use_cache": False}
        ),
    }


class _Memory:
    """The peak memory a row adds: CUDA's peak allocated bytes, else the process's peak RSS (benchmarks/run.py)."""

    def __init__(self, device: Any) -> None:
        import run as bench
        import torch

        self.torch, self.bench, self.device = torch, bench, device
        self.cuda, self.rss = device.type == "cuda", False
        if not self.cuda:
            try:  # Linux: /proc/self/status's VmHWM, reset through /proc/self/clear_refs
                bench._reset_peak()
                self.rss = bench._status("VmHWM") > 0
            except OSError:
                pass

    def start(self) -> None:
        gc.collect()
        if self.cuda:
            self.torch.cuda.synchronize(self.device)
            self.torch.cuda.reset_peak_memory_stats(self.device)
            self.before = self.torch.cuda.memory_allocated(self.device)
        elif self.rss:
            self.before = self.bench._status("VmRSS")
            self.bench._reset_peak()

    def peak(self) -> float | None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)
            return (self.torch.cuda.max_memory_allocated(self.device) - self.before) / MB
        return (self.bench._status("VmHWM") - self.before) / MB if self.rss else None


def time_rows(rows: dict[str, Callable[[], Any]], device: Any, rounds: int, deadline: float) -> dict[str, dict]:
    """Round 0 warms up; rounds 1..`rounds` time every row once, round-robin (memory in round 1), until
    `deadline` (time.monotonic) passes. Each row: its seconds, ratios to the plain forward, peak MB, error."""
    import torch

    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    memory = _Memory(device)
    out = {name: {"seconds": [], "peak MB": None, "error": None} for name in rows}
    for round_ in range(rounds + 1):
        if round_ > 1 and time.monotonic() > deadline:
            break
        for name, row in rows.items():
            if out[name]["error"]:
                continue
            gc.collect()
            if round_ == 1:
                memory.start()
            else:
                sync()
            try:
                start = time.perf_counter()
                row()
                sync()
                seconds = time.perf_counter() - start
            except Exception as error:  # noqa: BLE001 -- a row that fails is reported; the others go on
                out[name]["error"] = f"{type(error).__name__}: {error}".splitlines()[0][:300]
                continue
            if round_ == 1:
                out[name]["peak MB"] = memory.peak()
            if round_:
                out[name]["seconds"].append(seconds)
    reference = out["plain forward"]["seconds"]
    for row in out.values():
        ratios = [a / b for a, b in zip(row["seconds"], reference)] if not row["error"] else []
        row.update(
            ratio=statistics.median(ratios) if ratios else None,
            range=[min(ratios), max(ratios)] if ratios else None,
            median_s=statistics.median(row["seconds"]) if row["seconds"] else None,
        )
    return out


def stage_benchmarks(args: argparse.Namespace) -> int:
    import run as bench
    import torch

    device = torch.device(args.device)
    dtype, tokens, rounds = (torch.float32, 64, 2) if args.quick else (torch.bfloat16, 2048, 3)
    if device.type == "cpu":
        torch.set_num_threads(1 if args.quick else 2)
    scratch = pathlib.Path(args.out) / "stages" / "scratch"
    scratch.mkdir(exist_ok=True)
    deadline = time.monotonic() + args.budget * 0.8
    result = {
        "dtype": str(dtype).removeprefix("torch."),
        "tokens": tokens,
        "batch": 1,
        "rounds": rounds,
        "memory": (
            "torch.cuda.max_memory_allocated during the row less the bytes allocated before it"
            if device.type == "cuda"
            else "peak RSS during the row less the RSS before it (VmHWM)"
        ),
        "models": {},
    }
    models = _models(args.quick)
    for key, (label, build) in models.items():
        share = (deadline - time.monotonic()) / (len(models) - list(models).index(key))
        with torch.device(device):  # the weights are made on the device (a full-size model in seconds)
            model = bench._ready(build).to(dtype).requires_grad_(False)
        ids = torch.randint(3, bench.VOCAB, (1, tokens), generator=torch.Generator().manual_seed(1)).to(device)
        try:
            rows = time_rows(benchmark_rows(model, ids, scratch), device, rounds, time.monotonic() + share)
        except Exception as error:  # noqa: BLE001 -- the setup itself failed: the next model still runs
            rows = {"setting up the rows": {"error": f"{type(error).__name__}: {error}".splitlines()[0][:300]}}
        result["models"][key] = {"label": label, "layers": model.config.num_hidden_layers, "rows": rows}
        _save(args, result)
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    failed = [
        f"{key}: {name}"
        for key, model in result["models"].items()
        for name, row in model["rows"].items()
        if row.get("error")
    ]
    result["status"] = "failed" if failed else "passed"
    _save(args, result)
    return 1 if failed else 0


# -- the cost model's calibration ------------------------------------------------------------------------------------


def _cast(value: Any, dtype: Any) -> Any:
    """`value` (a call's arguments: tensors, tuples, dicts) with its floating tensors cast to `dtype`."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, tuple):
        return tuple(_cast(item, dtype) for item in value)
    if isinstance(value, dict):
        return {key: _cast(item, dtype) for key, item in value.items()}
    return value


@contextlib.contextmanager
def _arguments_in(calibration: Any, dtype: Any):
    """benchmarks/paths.py's `calibrate` makes float32 arguments and moves them with its `_on`: cast them too."""
    move = calibration._on
    calibration._on = lambda device, value: _cast(move(device, value), dtype)
    try:
        yield
    finally:
        calibration._on = move


def stage_calibration(args: argparse.Namespace) -> int:
    import paths as calibration  # benchmarks/paths.py
    import torch

    dtype = getattr(torch, args.stage.removeprefix("calibration-"))
    device = torch.device(args.device)
    key = f"{device.type}/{str(dtype).removeprefix('torch.')}"  # costs.json's keys: "cpu/float32", "cuda/bfloat16"
    if device.type == "cpu":
        torch.set_num_threads(1)  # the constants' setting (benchmarks/paths.py)
    costs = pathlib.Path(args.out) / "costs.json"
    with torch.no_grad(), _arguments_in(calibration, dtype):
        fitted, errors = calibration.calibrate(args.quick, args.device)
    calibration.write(key, fitted, errors, file=costs)
    data = json.loads(costs.read_text())
    if dtype != torch.float32:  # `write` says float32: these arguments were cast
        data[key]["measured"] = data[key]["measured"].replace(
            "float32", f"{str(dtype).removeprefix('torch.')} (the arguments cast by scripts/gpu_check.py)"
        )
    data[key]["measured"] += " --quick: a smoke run, not constants to ship" if args.quick else ""
    costs.write_text(json.dumps(data, indent=2) + "\n")
    _save(args, {"status": "passed", "key": key, "file": "costs.json", "entry": data[key]})
    return 0


# -- the report ------------------------------------------------------------------------------------------------------


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def write_report(out: pathlib.Path, run: dict[str, Any]) -> None:
    """DIR/report.json (everything) and DIR/report.md (its sections: stages, versions, suite, benchmark rows,
    calibration)."""
    (out / "report.json").write_text(json.dumps(run, indent=1, default=str) + "\n")
    stages = run["stages"]
    lines = [
        f"# GPU check: {run['device']}{' (--quick)' if run['quick'] else ''}",
        "",
        f"`{run['command']}`, started {run['started']}, {run.get('wall seconds', 0):.0f} s in all.",
        "",
        "## Stages",
        "",
        "| stage | status | seconds | budget |",
        "| --- | --- | --- | --- |",
    ]
    lines += [f"| {name} | {s['status']} | {s['seconds']:.0f} | {s['budget']:.0f} |" for name, s in stages.items()]
    for name, stage in stages.items():
        if stage["log tail"]:
            lines += ["", f"{name}, the end of its log ({stage['log']}):", "", "```", *stage["log tail"], "```"]
    lines += ["", "## Versions", ""]
    versions = stages.get("versions", {}).get("result", {}).get("versions", {})
    lines += [f"- {name}: {value}" for name, value in versions.items()] or ["not measured (the stage failed)"]
    lines += ["", "## Suite", ""] + _suite_lines(stages.get("suite", {}).get("result", {}))
    lines += ["", "## Benchmark rows", ""] + _benchmark_lines(stages.get("benchmarks", {}).get("result", {}))
    lines += ["", "## Cost model calibration", ""]
    for name in (n for n in STAGES if n.startswith("calibration-")):
        entry = stages.get(name, {}).get("result", {})
        if "entry" in entry:
            lines.append(f"- {entry['key']}: written to {entry['file']}; {entry['entry']['worst relative error']}")
        else:
            lines.append(f"- {name.removeprefix('calibration-')}: {stages.get(name, {}).get('status', 'not run')}")
    (out / "report.md").write_text("\n".join(lines) + "\n")


def _suite_lines(suite: dict[str, Any]) -> list[str]:
    if not suite:
        return ["not run, or it wrote nothing (see Stages)"]
    lines = [f"Files: {', '.join(suite['files'])}; `--one-family-per-kind`.", *suite["notes"], ""]
    for name, v in suite["variants"].items():
        if "not run" in v:
            lines.append(f"- {name}: NOT RUN: {v['not run']}")
            continue
        counts = ", ".join(f"{v[k]} {k}" for k in ("passed", "failed", "errors", "skipped") if k in v)
        lines.append(
            f"- {name}: {counts or v.get('junit')}; exit {v['returncode']}, {v['seconds']:.0f} s"
            + (", TIMED OUT" if v.get("timed out") else "")
            + f" (log: stages/{v['log']})"
        )
        lines += [f"  - {failure}" for failure in v.get("failures", [])[:40]]
    return lines


def _benchmark_lines(bench: dict[str, Any]) -> list[str]:
    if not bench:
        return ["not run, or it wrote nothing (see Stages)"]
    lines = [
        (
            f"{bench['dtype']}, batch {bench['batch']}, T = {bench['tokens']}, median over {bench['rounds']}"
            " interleaved rounds after a warm-up round of each row's time over the plain forward's in the same"
            f" round. Peak memory: {bench['memory']}."
        )
    ]
    for key, model in bench["models"].items():
        lines += [
            "",
            f"{key}: {model['label']} ({model.get('layers', '?')} layers)",
            "",
            "| row | time / plain forward | range | median s | peak MB |",
            "| --- | --- | --- | --- | --- |",
        ]
        for name, row in model["rows"].items():
            if row.get("error"):
                lines.append(f"| {name} | ERROR: {row['error']} | | | |")
                continue
            spread = "-" if not row.get("range") else f"{row['range'][0]:.2f}-{row['range'][1]:.2f}"
            lines.append(
                f"| {name} | {_fmt(row.get('ratio'), '.2f')} | {spread} | {_fmt(row.get('median_s'), '.4f')}"
                f" | {_fmt(row.get('peak MB'), '.1f')} |"
            )
    return lines


if __name__ == "__main__":
    sys.exit(main())
