"""Benchmark of `rh.patching_sweep` against the loop of one forward per (layer, position) cell.

    python benchmarks/sweep.py                       # demo.tiny_model, T = 64, every layer x position
    python benchmarks/sweep.py --tokens 128 --batch-size 128 --repeats 5

The model is `recurrent_hooks.demo.tiny_model()` (Qwen3.5, 4 layers: gated DeltaNet at 0 and 2, attention
at 1 and 3; hidden 64, random weights). Both sides patch the whole memory (state and conv window) and
include their clean run:

- naive: one clean forward keeping states and windows, then one batch-1 forward of the corrupt prompt
  per cell, with `w.mixer(layer).set_memory_after(position, clean_memory)`;
- batched: `patching_sweep(..., batch_size=B)`: a clean and a corrupt forward, then ceil(cells / B)
  forwards of B rows.

Time is the median over `--repeats` rounds, each round running both once (naive first), after one
untimed warm-up round. A third timing, the floor, runs the same batched forwards unwatched and
unpatched: what batching alone buys on this model, which bounds the ratio from below. The two results must agree within float32 rounding (rtol 1e-5, atol 1e-6:
they take different kernel paths; tests/test_sweep.py checks bit equality where the paths are the
same); the script exits non-zero when they do not, or when the ratio misses the 0.2 target.
`main(argv)` runs everything; importing this module does no work.
"""

import argparse
import pathlib
import statistics
import sys
import time

TARGET = 0.2  # batched / naive


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the machine is shared)")
    args = parser.parse_args(argv)

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # this checkout's package
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
            return rh.patching_sweep(model, clean, corrupt, metric, batch_size=args.batch_size, progress=False).values

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
        print(f"patching sweep, {type(model).__name__} (demo.tiny_model), T={args.tokens}, {cells} cells"
              f" ({expected.shape[0]} layers x {expected.shape[1]} positions), batch {args.batch_size},"
              f" {args.threads} thread(s), median of {args.repeats}")
        print(f"  naive (one forward per cell): {naive_s:.3f} s ({naive_s / cells * 1e3:.2f} ms/cell)")
        print(f"  batched patching_sweep:       {batched_s:.3f} s ({batched_s / cells * 1e3:.2f} ms/cell)")
        print(f"  ratio batched / naive:        {ratio:.3f} (target <= {TARGET}; per round:"
              f" {', '.join(f'{b / n:.3f}' for b, n in zip(batched_times, naive_times))})")
        print(f"  floor: the same batched forwards, unwatched and unpatched: {statistics.median(floor_times):.3f} s,"
              f" ratio to naive {statistics.median(f / n for f, n in zip(floor_times, naive_times)):.3f}")
        print(f"  results agree: {close} (max |diff| {diff.max().item():.3g};"
              f" metric spread over cells {(expected.max() - expected.min()).item():.3g})")
        if not close:
            print("ERROR: the batched sweep and the loop disagree")
            return 1
        return 0 if ratio <= TARGET else 2
    finally:
        torch.set_num_threads(threads)


if __name__ == "__main__":
    sys.exit(main())
