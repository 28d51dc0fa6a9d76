"""Measurement: how well `rh.attribute(..., steps=k)` ranks the cells the exact sweep ranks, on the trained toys.

    python benchmarks/attribution_ranking.py                        # every shipped toy, 48 pairs, steps 1, 4, 16
    python benchmarks/attribution_ranking.py --toys gdn --pairs 16 --steps 1,2,8
    python benchmarks/attribution_ranking.py --quick                # 4 pairs, steps 1 and 2: a smoke run

Per toy, `--pairs` MQAR pairs (`task.contrast(pairs, seed)`), each prompt without its last answer token, so that
clean and corrupt differ in one token (the value of the pair the last query asks for). The metric, per pair:
`rh.metrics.logit_difference(clean answer, corrupt answer, position=the last query)`.

- exact effects: `rh.patching_sweep` over every recurrent layer x position, minus the corrupt baseline,
  `[pairs, layers, positions]`;
- estimates: `rh.attribute(..., steps=k).memory`, the same shape.

Per pair, the Pearson and the Spearman (rank, ties averaged) correlation between the two over cells, and
||estimate - exact|| / ||exact||. Two sets of cells: "changed on" (the positions from the changed token on, where
the clean and corrupt memories differ) and "all" (every cell; before the changed token both are zero up to float
rounding: the exact sweep's rounding noise then takes ranks there). Reported per toy and k: median, 10th
percentile and minimum over pairs, the share of pairs above 0.9, and the time of `attribute` at steps=k over
its time at steps=1 (all pairs in one call; `--repeats` rounds after a warm-up, each timing every k once: the
median of the per-round ratios). Prints markdown tables.
"""

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch

import recurrent_hooks as rh
from recurrent_hooks.toys import TOYS, load_toy, toy_task


def ranks(values: torch.Tensor) -> torch.Tensor:
    """The ranks of a 1-d tensor, 0-based, ties given the mean of their ranks."""
    order = values.argsort()
    ranked = torch.empty(len(values), dtype=torch.float64)
    ranked[order] = torch.arange(len(values), dtype=torch.float64)
    for value in values.unique():
        tied = values == value
        if int(tied.sum()) > 1:
            ranked[tied] = ranked[tied].mean()
    return ranked


def pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double() - a.double().mean(), b.double() - b.double().mean()
    scale = a.norm() * b.norm()
    return float((a * b).sum() / scale) if scale > 0 else float("nan")


def quality(exact: torch.Tensor, estimate: torch.Tensor, first: torch.Tensor) -> dict[str, list[float]]:
    """Per pair: the correlations and the relative error over the cells `first[n]..` ("changed on") and all cells."""
    found: dict[str, list[float]] = {}
    for n in range(exact.shape[0]):
        for cells, (e, x) in (
            ("changed on", (exact[n, :, first[n] :], estimate[n, :, first[n] :])),
            ("all", (exact[n], estimate[n])),
        ):
            e, x = e.flatten(), x.flatten()
            found.setdefault(f"{cells} pearson", []).append(pearson(e, x))
            found.setdefault(f"{cells} spearman", []).append(pearson(ranks(e), ranks(x)))
            found.setdefault(f"{cells} error", []).append(float((x - e).norm() / e.norm()))
    return found


def summary(values: list[float]) -> tuple[float, float, float, float]:
    """Median, 10th percentile, minimum and the share above 0.9 (a pair without a value counts as below)."""
    kept = sorted(v for v in values if v == v)
    if not kept:
        return (float("nan"),) * 4
    p10 = kept[int(0.1 * (len(kept) - 1))]
    return statistics.median(kept), p10, kept[0], sum(v > 0.9 for v in kept) / len(values)


def timed(calls: dict[int, Callable[[], object]], repeats: int) -> dict[int, tuple[float, float]]:
    """Per key: the median seconds of its call and the median of its time over the first key's in the same round
    (rounds of one call each, interleaved: a slower stretch of a shared machine slows a round, not one row)."""
    seconds: dict[int, list[float]] = {key: [] for key in calls}
    for _ in range(repeats):
        for key, call in calls.items():
            start = time.perf_counter()
            call()
            seconds[key].append(time.perf_counter() - start)
    first = next(iter(calls))
    return {
        key: (statistics.median(times), statistics.median(t / f for t, f in zip(times, seconds[first])))
        for key, times in seconds.items()
    }


def measure(toy: str, pairs: int, steps: list[int], repeats: int, seed: int) -> list[dict]:
    model = load_toy(toy).requires_grad_(False)
    task = toy_task(toy)
    clean, corrupt = task.contrast(pairs, seed=seed)
    ids, other = clean.ids[:, :-1], corrupt.ids[:, :-1]
    query = int(task.query_positions[-1])  # the last position of the shortened prompts
    metric = rh.metrics.logit_difference(clean.answers[:, -1], corrupt.answers[:, -1], position=query)
    first = task.value_positions[clean.query_pairs[:, -1]]  # the changed token of each pair
    assert bool((ids != other).sum(1).eq(1).all()) and bool((ids != other).float().argmax(1).eq(first).all())
    start = time.perf_counter()
    sweep = rh.patching_sweep(model, ids, other, metric, progress=False)
    sweep_seconds = time.perf_counter() - start
    exact = sweep.values - sweep.corrupt[:, None, None]
    rows = []
    for k in steps:  # also the warm-up of the timing
        result = rh.attribute(model, ids, other, metric, steps=k)
        assert result.layers == sweep.layers and result.memory.shape == exact.shape
        rows.append(
            {
                "toy": toy,
                "steps": k,
                "sweep": sweep_seconds,
                "layers": len(sweep.layers),
                **quality(exact, result.memory, first),
            }
        )
    times = timed({k: lambda k=k: rh.attribute(model, ids, other, metric, steps=k) for k in steps}, repeats)
    for row in rows:
        row["seconds"], row["ratio"] = times[row["steps"]]
    return rows


def table(rows: list[dict], cells: str) -> str:
    head = (
        "| toy | steps | Pearson median | p10 | min | > 0.9 | Spearman median | p10 | min | > 0.9 |"
        " rel. error median | time / steps=1 |"
    )
    lines = [head, "| " + " | ".join("---" for _ in head.strip("|").split("|")) + " |"]
    for row in rows:
        p, s = summary(row[f"{cells} pearson"]), summary(row[f"{cells} spearman"])
        error = statistics.median(row[f"{cells} error"])
        lines.append(
            f"| {row['toy']} | {row['steps']} | {p[0]:.3f} | {p[1]:.3f} | {p[2]:.3f} | {p[3]:.0%} |"
            f" {s[0]:.3f} | {s[1]:.3f} | {s[2]:.3f} | {s[3]:.0%} | {error:.3f} | {row['ratio']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--toys", default=",".join(TOYS), help=f"comma-separated, from {','.join(TOYS)}")
    parser.add_argument("--pairs", type=int, default=48)
    parser.add_argument("--steps", default="1,4,16", help="comma-separated; the first is the time reference")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (1: steadier times on a busy machine)")
    parser.add_argument("--quick", action="store_true", help="4 pairs, steps 1 and 2, one repeat")
    args = parser.parse_args(argv)
    if args.quick:
        args.pairs, args.steps, args.repeats = 4, "1,2", 1
    torch.set_num_threads(args.threads)
    steps = [int(k) for k in args.steps.split(",")]
    rows = [row for toy in args.toys.split(",") for row in measure(toy, args.pairs, steps, args.repeats, args.seed)]
    print(f"{args.pairs} MQAR pairs per toy (seed {args.seed}), {args.threads} threads, torch {torch.__version__}")
    for row in rows[:: len(steps)]:
        print(
            f"- {row['toy']}: {row['layers']} recurrent layers; the exact sweep took {row['sweep']:.1f} s,"
            f" attribute at steps={steps[0]} {row['seconds']:.2f} s"
        )
    print("\nCells from the changed token on:\n")
    print(table(rows, "changed on"))
    print("\nAll cells:\n")
    print(table(rows, "all"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
