"""Benchmark: attribution in one backward against a plain forward, in one run.

    python benchmarks/attribution.py            # gdn_small at T = 512
    python benchmarks/attribution.py --quick    # tiny dims, a smoke run

Rows, each divided by one plain forward of the same model on the same ids (`model(ids, use_cache=False)`
under `torch.no_grad()`) timed in the same round; the ratio is the median over interleaved rounds:
- "forward + backward, every state kept differentiably": a watch with keep=("states", "windows"),
  the forward, and one `torch.autograd.grad` with respect to every mixer's states and windows (the
  issue's target: <= 4 x a plain forward);
- "rh.attribute": the above plus the clean forward that keeps every state and window without gradients.
Weights are frozen, as in a study.
"""

import argparse
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import run as bench  # noqa: E402  the benchmark's model builders

import recurrent_hooks as rh  # noqa: E402

TARGET = 4.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.quick:
        model, tokens, label = bench._gdn(64, 2, 4, 16, 128, bench.LINEAR2), 32, "gated DeltaNet (quick dims)"
    else:
        model, tokens, label = (bench._gdn(256, 4, 8, 64, 512, bench.LINEAR2), 512,
                                "gdn_small: hidden 256, 4 key / 8 value heads of 64, MLP 512")
    model.eval().requires_grad_(False)
    gen = torch.Generator().manual_seed(0)
    clean = torch.randint(3, bench.VOCAB, (1, tokens), generator=gen)
    corrupt = clean.clone()
    corrupt[0, tokens // 2] = (corrupt[0, tokens // 2] + 1) % bench.VOCAB

    def metric(logits: torch.Tensor) -> torch.Tensor:
        return logits[:, -1].logsumexp(-1)

    def plain() -> None:
        with torch.no_grad():
            model(corrupt, use_cache=False)

    def backward() -> None:
        with rh.watch(model, keep=("states", "windows")) as w:
            value = metric(model(corrupt, use_cache=False).logits).sum()
        torch.autograd.grad(value, [t for m in w.mixers for memory in ("state", "window")
                                    for t in m.calls[0].differentiable(memory)])

    def attribution() -> None:
        rh.attribute(model, clean, corrupt, metric, forward_kwargs={"use_cache": False})

    rows = {"forward + backward, every state kept differentiably": (backward, TARGET),
            "rh.attribute (and the clean forward)": (attribution, None)}
    ratios: dict[str, list[float]] = {name: [] for name in rows}
    seconds: dict[str, list[float]] = {name: [] for name in ["plain forward", *rows]}
    for round_ in range(args.repeats + 1):
        start = time.perf_counter()
        plain()
        reference = time.perf_counter() - start
        if round_:  # the first round warms up
            seconds["plain forward"].append(reference)
        for name, (run_row, _) in rows.items():
            start = time.perf_counter()
            run_row()
            elapsed = time.perf_counter() - start
            if round_:
                ratios[name].append(elapsed / reference)
                seconds[name].append(elapsed)
    print(f"{label}; T = {tokens}, batch 1, {args.threads} threads, {args.repeats} rounds (+1 warm-up)")
    print(f"plain forward: median {statistics.median(seconds['plain forward']):.3f} s")
    for name, (_, target) in rows.items():
        ratio = statistics.median(ratios[name])
        verdict = f"; target <= {target}: {'met' if ratio <= target else 'NOT met'}" if target else ""
        print(f"{name}: ratio {ratio:.2f} (range {min(ratios[name]):.2f}-{max(ratios[name]):.2f}),"
              f" median {statistics.median(seconds[name]):.3f} s{verdict}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
