"""Cost of `rh.effective_attention` for one layer, against a plain forward of the model.

    python benchmarks/effective_attention.py             # gdn_small of benchmarks/run.py, T = 512
    python benchmarks/effective_attention.py --quick     # its quick dims, a few seconds

Rows, each timed in the same interleaved rounds as benchmarks/run.py (median over rounds of the row's
time divided by the plain forward's time in that round, after one untimed warm-up round):
- plain: model(ids, use_cache=False), unwatched (the reference);
- kept: the same forward inside `rh.watch(model, keep=("inputs", "outputs"))` (what the map needs);
- ea: `rh.effective_attention(w.mixers[0])` alone, over the kept call (layer 0, all heads, T x T);
- kept + ea: both, the whole cost of getting one layer's map from scratch.
`main(argv)` runs everything; importing this module does no work.
"""

import argparse
import gc
import importlib.util
import pathlib
import statistics
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent


def _run_module():
    spec = importlib.util.spec_from_file_location("benchmark_run", HERE / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="quick dims (a smoke run)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)

    import torch

    sys.path.insert(0, str(HERE.parent))  # the recurrent_hooks next to this script
    import recurrent_hooks as rh

    bench = _run_module()
    spec = next(s for s in bench.specs(args.quick) if s.key == "gdn_small")
    model = bench._ready(spec.build)
    ids = torch.randint(3, bench.VOCAB, (1, spec.tokens), generator=torch.Generator().manual_seed(0))

    def plain():
        return model(ids, use_cache=False).logits

    def kept():
        with rh.watch(model, keep=("inputs", "outputs")) as w:
            model(ids, use_cache=False)
        return w

    watch = kept()

    def ea():
        return rh.effective_attention(watch.mixers[0])

    def kept_ea():
        return rh.effective_attention(kept().mixers[0])

    rows = {"plain": plain, "kept": kept, "ea": ea, "kept + ea": kept_ea}
    times: dict[str, list[float]] = {name: [] for name in rows}
    with torch.no_grad():
        for r in range(args.repeats + 1):
            for name, run in rows.items():
                gc.collect()
                start = time.perf_counter()
                result = run()
                elapsed = time.perf_counter() - start
                del result
                if r > 0:
                    times[name].append(elapsed)
        check = rh.effective_attention(watch.mixers[0])
        y = watch.mixers[0].calls[0].output["output"].transpose(1, 2)
        error = float((check.output() - y).abs().max() / y.abs().max())

    print(f"effective attention, {spec.label}, T = {spec.tokens}, layer 0: weights {tuple(check.weights.shape)}")
    print(
        f"torch threads {torch.get_num_threads()}, {args.repeats} rounds;"
        f" reconstruction max error / max |y| = {error:.2g}"
    )
    print(f"{'row':<12} {'median s':>10} {'x plain':>8} {'range':>13}")
    for name in rows:
        ratios = [a / b for a, b in zip(times[name], times["plain"])]
        print(
            f"{name:<12} {statistics.median(times[name]):>10.4f} {statistics.median(ratios):>8.2f}"
            f" {min(ratios):>6.2f}-{max(ratios):<6.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
