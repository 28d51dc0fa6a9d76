"""Benchmark of `rh.patching_sweep` against the loop of one forward per (layer, position) cell.

    python benchmarks/sweep.py                       # demo.tiny_model, T = 64, every layer x position
    python benchmarks/sweep.py --tokens 128 --batch-size 128 --repeats 5
    python benchmarks/sweep.py --memory              # gdn_small, T = 512: memory held vs the number of positions
    python benchmarks/sweep.py --memory --library /work/main --budget-mib 256   # the same rows on another checkout
    python benchmarks/sweep.py --per-cell            # gdn_small, T = 512: seconds per cell by batch size vs naive
    python benchmarks/sweep.py --per-cell --dims qwen3_5 --cells 8 --batch-sizes None,1 --repeats 1
    python benchmarks/sweep.py --per-cell --dims mamba2_130m_full --seq 256 --cells 8 --batch-sizes None --repeats 1
    python benchmarks/sweep.py --per-cell --dims qwen3_5_slice --seq 256 --cells 8 --all-layers --reuse-prefix None
    python benchmarks/sweep.py --pairs 16            # many pairs in shared batches vs one sweep per pair; heads

The model is `recurrent_hooks.demo.tiny_model()` (Qwen3.5, 4 layers: gated DeltaNet at 0 and 2, attention
at 1 and 3; hidden 64, random weights). Both sides patch the whole memory (state and conv window) and
include their clean run:

- naive: one clean forward keeping states and windows, then one batch-1 forward of the corrupt prompt
  per cell, with `w.mixer(layer).set_memory_after(position, clean_memory)`;
- batched: `patching_sweep(..., batch_size=B)`: a clean and a corrupt forward, then ceil(cells / B)
  forwards of B rows.

Time is the median over `--repeats` rounds, each round running both once (naive first), after one
untimed warm-up round. A third timing, the floor, runs the same batched forwards unwatched and
unpatched: what batching alone buys on this model, which bounds the ratio from below. The two results must agree within
float32 rounding (rtol 1e-5, atol 1e-6: they take different kernel paths; tests/studies/test_sweep.py checks bit
equality where the paths are the same); the script exits non-zero when they do not, or when the ratio misses the 0.2
target.

`--memory`: the gated DeltaNet model `gdn_small` of benchmarks/run.py (hidden 256, 4 key / 8 value heads of
64, 2 layers, vocab 1024), T = 512, layer 0, for a growing number of positions spread over the prompt. Each row
runs in its own child process (MALLOC_MMAP_THRESHOLD_=65536, as benchmarks/run.py): `held` is the most bytes
of clean memories alive at once (every clone of the sweep's read hooks, counted until freed), `peak+` the
VmHWM during the sweep minus the VmRSS before it. `--library` measures another checkout (one without
`budget_bytes` runs without it). `--per-cell`: the same model (`--dims qwen3_5`: Qwen3.5 layer dims; `qwen3_5_slice`:
8 layers of them in Qwen3.5's 3:1 pattern; `mamba2_130m_full`: mamba2-130m's 24 layers), `--seq` tokens, `--cells`
positions of layer 0 (`--all-layers`: of every layer, without the loop), seconds per cell of the loop of one forward
per cell with `set_memory_after` and of `patching_sweep` at each `--batch-sizes`, from the corrupt run's cache and with
one forward per cell (`--reuse-prefix both`, the default; `None` or `False` for one of them; `--keep-last`: every
forward with `logits_to_keep=1`), and per cell in plain forwards of the corrupt prompt.
`--pairs N`: `demo.tiny_model()`, N prompt pairs of `--tokens` tokens (default 64), every cell: the sweep over
`[N, seq]` with an `rh.metrics` metric (the pairs' cells share batches, the baselines are one batch) against a
loop of N single-pair sweeps, and the per-head sweep (`heads=True`, 4 value heads: 4 x the cells) against the
per-layer one, per cell.
`main(argv)` runs everything; importing this module does no work.
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

TARGET = 0.2  # batched / naive
HERE = pathlib.Path(__file__).resolve().parent
SMALL_TOKENS = 512


def _small_model(dims: str = "gdn_small") -> object:
    """benchmarks/run.py's gdn_small forward model (2 gated DeltaNet layers), or (`dims="qwen3_5"`) Qwen3.5 layer
    dims (hidden 2048, 16 key / 32 value heads of 128: one gated DeltaNet and one attention layer), seeded."""
    sys.path.insert(0, str(HERE))
    import run as bench
    import torch

    torch.manual_seed(0)
    if dims == "qwen3_5":
        return bench._gdn(2048, 16, 32, 128, 6144, bench.HYBRID).eval()
    if dims == "qwen3_5_slice":  # Qwen3.5's 3:1 pattern, 8 layers
        return bench._gdn(2048, 16, 32, 128, 6144, (["linear_attention"] * 3 + ["full_attention"]) * 2).eval()
    if dims == "mamba2_130m_full":  # 24 layers
        return bench._mamba2(768, 24, 64, 128, 256, layers=24).eval()
    return bench._gdn(256, 4, 8, 64, 512, bench.LINEAR2).eval()


def _spread(count: int, tokens: int) -> list[int]:
    return sorted({min(tokens - 1, int((i + 0.5) * tokens / count)) for i in range(count)})


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def memory_child(count: int, budget_mib: float | None) -> dict:
    """One `--memory` row, in this (child) process: the held bytes and the peak RSS added by one sweep."""
    import gc
    import inspect

    import torch

    import recurrent_hooks as rh

    try:  # where the sweep's read hooks clone (studies/sweep/cells.py)
        import recurrent_hooks.studies.sweep.cells as module
    except ImportError:
        import recurrent_hooks.studies.sweep as module

    torch.set_num_threads(1)
    model = _small_model()
    gen = torch.Generator().manual_seed(0)
    clean, corrupt = (torch.randint(3, 1024, (1, SMALL_TOKENS), generator=gen) for _ in range(2))
    held = {"live": 0, "peak": 0}
    real = module.map_parts

    def freed(nbytes: int) -> None:
        held["live"] -= nbytes

    def track(part: torch.Tensor) -> torch.Tensor:
        import weakref

        held["live"] += part.nbytes
        held["peak"] = max(held["peak"], held["live"])
        weakref.finalize(part, freed, part.nbytes)
        return part

    def spied(fn, *parts):  # noqa: ANN001, ANN202 - the sweep module's map_parts, counting its clones
        out = real(fn, *parts)
        if fn is torch.clone:
            real(track, out)
        return out

    module.map_parts = spied
    kwargs = {}
    if "budget_bytes" in inspect.signature(rh.patching_sweep).parameters and budget_mib is not None:
        kwargs["budget_bytes"] = int(budget_mib * 2**20)
    run = lambda positions: rh.patching_sweep(  # noqa: E731  (one pair: [seq] prompts)
        model,
        clean[0],
        corrupt[0],
        lambda logits: logits[:, -1].log_softmax(-1)[:, 5],
        layers=[0],
        positions=positions,
        progress=False,
        forward_kwargs={"logits_to_keep": 1},
        **kwargs,
    )
    run([1, 2])  # warm-up
    gc.collect()
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    held.update(live=0, peak=0)
    start = time.perf_counter()
    run(_spread(count, SMALL_TOKENS))
    seconds = time.perf_counter() - start
    return {
        "held": held["peak"],
        "peak": _status("VmHWM") - before,
        "seconds": seconds,
        "budget": "budget_bytes" in kwargs or "budget_bytes" in inspect.signature(rh.patching_sweep).parameters,
    }


def memory_rows(args: argparse.Namespace) -> int:
    """`--memory`: one child process per number of positions; prints the table."""
    library = pathlib.Path(args.library).resolve() if args.library else HERE.parent
    env = dict(
        os.environ,
        MALLOC_MMAP_THRESHOLD_="65536",
        MALLOC_TRIM_THRESHOLD_="0",
        MALLOC_ARENA_MAX="2",
        PYTHONPATH=str(library),
    )
    budget = "default" if args.budget_mib is None else f"{args.budget_mib} MiB"
    print(
        f"patching sweep memory, gdn_small (hidden 256, 8 value heads of 64), T={SMALL_TOKENS}, layer 0,"
        f" logits_to_keep=1, 1 thread; library {library}; budget_bytes {budget}"
    )
    print(f"  {'positions':>9} {'held MiB':>9} {'peak+ MiB':>9} {'seconds':>8}")
    for count in (int(c) for c in args.positions.split(",")):
        argv = [sys.executable, str(pathlib.Path(__file__).resolve()), "--memory-child", str(count)]
        if args.budget_mib is not None:
            argv += ["--budget-mib", str(args.budget_mib)]
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=str(library))
        if proc.returncode != 0:
            print("ERROR: " + " | ".join(proc.stderr.strip().splitlines()[-3:]))
            return 1
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        print(
            f"  {count:>9} {row['held'] / 2**20:>9.2f} {row['peak'] / 2**20:>9.1f} {row['seconds']:>8.1f}", flush=True
        )
    return 0


def per_cell_rows(args: argparse.Namespace) -> int:
    """`--per-cell`: seconds per cell, the loop of one forward per cell vs the sweep at each batch size."""
    sys.path.insert(0, str(HERE.parent))
    import torch

    import recurrent_hooks as rh

    torch.set_num_threads(args.threads)
    model = _small_model(args.dims)
    gen = torch.Generator().manual_seed(0)
    clean, corrupt = (torch.randint(3, 1024, (1, args.seq), generator=gen) for _ in range(2))
    positions = _spread(args.cells, args.seq)
    cells = len(positions)
    metric = lambda logits: logits[:, -1].log_softmax(-1)[:, 5]  # noqa: E731
    keep = {"logits_to_keep": 1} if args.keep_last else None

    def naive() -> None:
        with rh.watch(model, keep={"states": positions, "windows": positions}) as a, torch.no_grad():
            model(clean, use_cache=False)
        for position in positions:
            with rh.watch(model) as w, torch.no_grad():
                w.mixer(0).set_memory_after(position, a.mixer(0).memory_after(position))
                metric(model(corrupt, use_cache=False).logits)

    def plain() -> None:
        with torch.no_grad():
            metric(model(corrupt, use_cache=False, **(keep or {})).logits)

    layers = None if args.all_layers else [0]
    runs = {"naive: one forward per cell, set_memory_after": naive, "one plain forward": plain}
    if args.all_layers:  # the naive loop above patches layer 0 only: its time per cell is the same
        del runs["naive: one forward per cell, set_memory_after"]
    for batch in (None if b == "None" else int(b) for b in args.batch_sizes.split(",")):
        for reuse in {"both": (None, False), "None": (None,), "False": (False,)}[args.reuse_prefix]:
            runs[f"patching_sweep(batch_size={batch}, reuse_prefix={reuse})"] = lambda b=batch, r=reuse: (
                rh.patching_sweep(
                    model,
                    clean[0],
                    corrupt[0],
                    metric,
                    layers=layers,
                    positions=positions,
                    batch_size=b,
                    progress=False,
                    reuse_prefix=r,
                    forward_kwargs=keep,
                )
            )
    times: dict[str, list[float]] = {name: [] for name in runs}
    for round_ in range(args.repeats + 1):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            if round_:
                times[name].append(time.perf_counter() - start)
    with rh.watch(model) as w:
        cells *= len(w.mixers) if args.all_layers else 1
    print(
        f"patching sweep per cell, {args.dims}, T={args.seq}, {cells} cells ({len(positions)} positions,"
        f" {'every layer' if args.all_layers else 'layer 0'}), logits_to_keep={1 if args.keep_last else None},"
        f" {args.threads} thread(s), median of {args.repeats} interleaved rounds"
    )
    naive_s = statistics.median(times.get("naive: one forward per cell, set_memory_after", [float("nan")]))
    forward_s = statistics.median(times["one plain forward"])
    for name, values in times.items():
        median = statistics.median(values)
        if name == "one plain forward":
            print(f"  {name:<48} {median:.3f} s")
            continue
        print(
            f"  {name:<48} {median / cells:.3f} s/cell ({median / naive_s:.2f} x naive,"
            f" {median / cells / forward_s:.2f} forwards per cell)"
        )
    return 0


def pairs_rows(args: argparse.Namespace) -> int:
    """`--pairs`: seconds of N pairs in one sweep vs N sweeps, and per cell of heads=True vs per layer."""
    sys.path.insert(0, str(HERE.parent))
    import torch

    import recurrent_hooks as rh
    from recurrent_hooks.demo import tiny_model

    torch.set_num_threads(args.threads)
    model = tiny_model()
    generator = torch.Generator().manual_seed(0)
    clean, corrupt = (torch.randint(3, 128, (args.pairs, args.tokens), generator=generator) for _ in range(2))
    answers = clean[:, -1]
    metric = rh.metrics.logit_difference(answers, wrong=4)
    runs = {
        "one sweep over [N, seq]": lambda: rh.patching_sweep(model, clean, corrupt, metric, progress=False).values,
        "N sweeps, one per pair": lambda: torch.stack(
            [
                rh.patching_sweep(model, clean[n], corrupt[n], metric.for_pair(n), progress=False).values
                for n in range(args.pairs)
            ]
        ),
        "heads=True over [N, seq]": lambda: (
            rh.patching_sweep(model, clean, corrupt, metric, heads=True, progress=False).values
        ),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    results = {}
    for _ in range(args.repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            results[name] = run()
            times[name].append(time.perf_counter() - start)
    torch.testing.assert_close(
        results["one sweep over [N, seq]"], results["N sweeps, one per pair"], rtol=1e-5, atol=1e-6
    )
    per_layer = statistics.median(times["one sweep over [N, seq]"])
    cells = {name: results[name].numel() for name in runs}
    print(
        f"{args.pairs} pairs x {args.tokens} tokens, demo.tiny_model, {args.threads} thread(s), median of"
        f" {args.repeats}:"
    )
    for name, values in times.items():
        median = statistics.median(values)
        print(
            f"  {name:<28} {median:7.2f} s  {median / cells[name] * 1e3:6.2f} ms/cell"
            f"  ({median / per_layer:.2f} x the one sweep; {cells[name]} cells)"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the machine is shared)")
    parser.add_argument("--memory", action="store_true", help="gdn_small: memory held vs the number of positions")
    parser.add_argument("--positions", default="8,32,128", help="--memory: numbers of positions, comma-separated")
    parser.add_argument("--budget-mib", type=float, default=None, help="--memory: budget_bytes in MiB")
    parser.add_argument("--library", default=None, help="--memory: the checkout to measure (default: this one)")
    parser.add_argument("--per-cell", action="store_true", help="gdn_small: seconds per cell by batch size")
    parser.add_argument("--batch-sizes", default="1,2,7,32", help="--per-cell: batch sizes (None: the default)")
    parser.add_argument(
        "--dims",
        choices=("gdn_small", "qwen3_5", "qwen3_5_slice", "mamba2_130m_full"),
        default="gdn_small",
        help="--per-cell: the model (the last two at full depth or 8 layers)",
    )
    parser.add_argument("--seq", type=int, default=SMALL_TOKENS, help="--per-cell: the prompts' tokens")
    parser.add_argument("--cells", type=int, default=16, help="--per-cell: positions of layer 0")
    parser.add_argument("--all-layers", action="store_true", help="--per-cell: sweep every layer at those positions")
    parser.add_argument(
        "--reuse-prefix",
        choices=("both", "None", "False"),
        default="both",
        help="--per-cell: the sweep's reuse_prefix (both: each batch size with None and False)",
    )
    parser.add_argument("--keep-last", action="store_true", help="--per-cell: forward_kwargs={'logits_to_keep': 1}")
    parser.add_argument("--pairs", type=int, default=None, help="N pairs in one sweep vs N sweeps; heads=True")
    parser.add_argument("--memory-child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.pairs is not None:
        return pairs_rows(args)
    if args.memory_child is not None:
        print(json.dumps(memory_child(args.memory_child, args.budget_mib)))
        return 0
    if args.memory:
        return memory_rows(args)
    if args.per_cell:
        return per_cell_rows(args)

    sys.path.insert(0, str(HERE.parent))  # this checkout's package
    import torch

    import recurrent_hooks as rh
    from recurrent_hooks.demo import tiny_model

    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        model = tiny_model()
        generator = torch.Generator().manual_seed(0)
        clean = torch.randint(3, 128, (1, args.tokens), generator=generator)
        corrupt = torch.randint(3, 128, (1, args.tokens), generator=generator)
        answer = int(clean[0, -1])

        def metric(logits: torch.Tensor) -> torch.Tensor:
            return logits[:, -1].log_softmax(-1)[:, answer]

        def naive() -> torch.Tensor:
            with rh.watch(model, keep=("states", "windows")) as a, torch.no_grad():
                model(clean, use_cache=False)
            out = torch.empty(len(a.mixers), args.tokens)
            for i, kept in enumerate(a.mixers):
                for position in range(args.tokens):
                    with rh.watch(model) as w, torch.no_grad():
                        w.mixer(kept.layer).set_memory_after(position, kept.memory_after(position))
                        out[i, position] = metric(model(corrupt, use_cache=False).logits)[0]
            return out

        def batched() -> torch.Tensor:
            return rh.patching_sweep(
                model, clean[0], corrupt[0], metric, batch_size=args.batch_size, progress=False
            ).values

        def floor() -> None:
            """The same forwards without watch or patches: what batching alone gives on this model."""
            cells = 2 * args.tokens  # the demo model has 2 recurrent layers
            with torch.no_grad():
                model(clean, use_cache=False), model(corrupt, use_cache=False)
                for start in range(0, cells, args.batch_size):
                    rows = min(args.batch_size, cells - start)
                    metric(model(corrupt.expand(rows, args.tokens), use_cache=False).logits)

        naive_times, batched_times, floor_times = [], [], []
        for round_ in range(args.repeats + 1):
            start = time.perf_counter()
            expected = naive()
            middle = time.perf_counter()
            got = batched()
            end = time.perf_counter()
            floor()
            last = time.perf_counter()
            if round_:  # round 0 warms up
                naive_times.append(middle - start)
                batched_times.append(end - middle)
                floor_times.append(last - end)
        naive_s, batched_s = statistics.median(naive_times), statistics.median(batched_times)
        ratio = statistics.median(b / n for b, n in zip(batched_times, naive_times))
        cells = expected.numel()
        diff = (got - expected).abs()
        close = bool((diff <= 1e-6 + 1e-5 * expected.abs()).all())
        print(
            f"patching sweep, {type(model).__name__} (demo.tiny_model), T={args.tokens}, {cells} cells"
            f" ({expected.shape[0]} layers x {expected.shape[1]} positions), batch {args.batch_size},"
            f" {args.threads} thread(s), median of {args.repeats}"
        )
        print(f"  naive (one forward per cell): {naive_s:.3f} s ({naive_s / cells * 1e3:.2f} ms/cell)")
        print(f"  batched patching_sweep:       {batched_s:.3f} s ({batched_s / cells * 1e3:.2f} ms/cell)")
        print(
            f"  ratio batched / naive:        {ratio:.3f} (target <= {TARGET}; per round:"
            f" {', '.join(f'{b / n:.3f}' for b, n in zip(batched_times, naive_times))})"
        )
        print(
            f"  floor: the same batched forwards, unwatched and unpatched: {statistics.median(floor_times):.3f} s,"
            f" ratio to naive {statistics.median(f / n for f, n in zip(floor_times, naive_times)):.3f}"
        )
        print(
            f"  results agree: {close} (max |diff| {diff.max().item():.3g};"
            f" metric spread over cells {(expected.max() - expected.min()).item():.3g})"
        )
        if not close:
            print("ERROR: the batched sweep and the loop disagree")
            return 1
        return 0 if ratio <= TARGET else 2
    finally:
        torch.set_num_threads(threads)


if __name__ == "__main__":
    sys.exit(main())
