"""Benchmark: one Mamba-1 prompt call through each path, interleaved: what the chunk-wise selective scan costs.

    python benchmarks/selective_scan.py               # the shapes below, 3 rounds
    python benchmarks/selective_scan.py --rounds 5 --chunks 16,32,64,128 --threads 1
    python benchmarks/selective_scan.py --spread 2 --shapes 1,3    # with fast-decaying state elements

For each shape (batch, T, d_inner, d_state), the median time of one call over interleaved rounds (each
round runs every path once, in turn), in ms, and each path's ratio to the library's token loop with an
identity `on_token` (what a hook on every token, or a call with too many stops, runs today):
- "hf": transformers' own `mamba_selective_scan` (its CPU path is a Python loop too; it makes the discretized
  `[batch, d_inner, T, d_state]` tensors first): what an idle call runs;
- "loop": the library's token loop (`mamba_selective_scan`), no `on_token`;
- "chunks c" ("auto": the library's `chunk_size`): the chunk-wise scan `mamba_selective_scan_chunks` with chunks of
  c tokens (output and last state only): what a segment of a sparse call runs;
- "states c": `mamba_selective_scan_states`, every token's state too: what keeping every state runs.
No gradients, float32, 2 threads (as benchmarks/run.py). A call in segments costs about one chunk-wise call
per segment, plus the per-call overhead measured by the T=1 and short rows.
"""

import argparse
import statistics
import time

import torch
import transformers.models.mamba.modeling_mamba as modeling

from recurrent_hooks.extend import torch_kernel
from recurrent_hooks.kinds.selective_scan import (
    mamba_selective_scan,
    mamba_selective_scan_chunks,
    mamba_selective_scan_states,
)

# (batch, T, d_inner, d_state): mamba-130m dims, tiny dims (the test and --quick models), large batch short T
SHAPES = [
    (1, 2048, 1536, 16),
    (1, 512, 1536, 16),
    (1, 64, 1536, 16),
    (1, 512, 128, 8),
    (1, 512, 64, 16),
    (64, 25, 64, 16),
    (8, 128, 128, 8),
    (1, 1, 1536, 16),
]


def _inputs(batch: int, seq: int, d_inner: int, d_state: int, spread: float = 0.1) -> dict:
    """Arguments as MambaMixer passes them: steps about mamba's init range (Δ in [1e-3, 0.1]), A = -(1..d_state).

    `spread` scales the noise in dt before the softplus: 0.1 keeps Δ in the init range; 2 gives tails like
    those of a randomly initialised mamba-130m forward (Δ up to ~6, so Δ|A| up to ~90 in one token), where
    many state elements decay too fast for the chunk-wise form and are stepped on their own."""
    gen = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    steps = torch.logspace(-3, -1, d_inner)
    return dict(
        hidden_states=r(batch, d_inner, seq),
        dt=r(batch, d_inner, seq) * spread,
        A=-torch.arange(1, d_state + 1, dtype=torch.float32).expand(d_inner, d_state).contiguous(),
        B=r(batch, d_state, seq),
        C=r(batch, d_state, seq),
        D=torch.ones(d_inner),
        z=r(batch, d_inner, seq),
        delta_bias=steps + torch.log(-torch.expm1(-steps)),
        delta_softplus=True,
        return_last_state=True,
    )


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--chunks", default="16,32,64,128", help="comma-separated chunk sizes")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--spread", type=float, default=0.1, help="noise in dt before softplus (2: fast-decaying elements)")
    p.add_argument("--shapes", default=None, help="indices into SHAPES, comma-separated (default: all)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    chunks = [None, *(int(c) for c in args.chunks.split(","))]  # None: the library's choice (`chunk_size`)
    hf = torch_kernel(modeling.mamba_selective_scan)  # transformers' pure-torch scan, behind its hub wrapper
    identity = lambda t, s: s  # noqa: E731
    label = lambda c: "auto" if c is None else c  # noqa: E731
    names = ["hf", "loop", *(f"chunks {label(c)}" for c in chunks), *(f"states {label(c)}" for c in chunks)]
    print(
        f"torch {torch.__version__}, {args.threads} threads, dt spread {args.spread}, median of {args.rounds}"
        f" interleaved rounds; ms of the token loop with on_token, then each path's ratio to it"
    )
    print(f"{'batch':>5} {'T':>5} {'d_in':>5} {'N':>3} | {'loop+hook':>9} | " + " ".join(f"{n:>9}" for n in names))
    with torch.no_grad():
        for shape in SHAPES if args.shapes is None else [SHAPES[int(i)] for i in args.shapes.split(",")]:
            x = _inputs(*shape, spread=args.spread)
            paths = {
                "loop+hook": lambda: mamba_selective_scan(**x, on_token=identity),
                "hf": lambda: hf(**x),
                "loop": lambda: mamba_selective_scan(**x),
            }
            for c in chunks:
                paths[f"chunks {label(c)}"] = lambda c=c: mamba_selective_scan_chunks(**x, chunk=c)
                paths[f"states {label(c)}"] = lambda c=c: mamba_selective_scan_states(**x, chunk=c)
            for fn in paths.values():  # warm up
                fn()
            times = {name: [] for name in paths}
            for _ in range(args.rounds):
                for name, fn in paths.items():
                    times[name].append(_time(fn))
            base = statistics.median(times["loop+hook"])
            print(
                f"{shape[0]:5} {shape[1]:5} {shape[2]:5} {shape[3]:3} | {base * 1e3:9.2f} | "
                + " ".join(f"{statistics.median(times[n]) / base:9.2f}" for n in names),
                flush=True,
            )


if __name__ == "__main__":
    main()
